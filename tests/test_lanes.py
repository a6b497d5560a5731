"""CI's lanes (scripts/check.sh) cover every test: each test folder and each test file at the
top of tests/ is in exactly one lane, so a new kind of test cannot drop out of CI."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def lanes() -> dict[str, list[str]]:
    text = (ROOT / "scripts/check.sh").read_text()
    block = re.search(r"^lanes=\(\n(.*?)^\)", text, re.S | re.M)
    assert block, "scripts/check.sh has no lanes=( ... ) block"
    found = re.findall(r'"([a-z_]+):([^":]*)(?::beside)?"', block.group(1))
    return {name: paths.split() for name, paths in found}


def test_every_test_folder_and_file_is_in_exactly_one_lane() -> None:
    tests = ROOT / "tests"
    wanted = {f"tests/{p.name}" for p in tests.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    wanted |= {f"tests/{p.name}" for p in tests.glob("test_*.py")}
    named = Counter(path for paths in lanes().values() for path in paths)
    assert set(named) == wanted, "scripts/check.sh's lanes and the tests differ"
    assert [p for p, n in named.items() if n > 1] == [], "a path in two lanes runs twice"


def test_the_static_checks_have_their_own_lane() -> None:
    assert lanes().get("static") == []
