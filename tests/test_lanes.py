"""CI's lanes (scripts/check.sh --lanes) cover every test: each test file under tests/ is in
exactly one lane (a lane names it or a folder above it, and does not --ignore it), so a new
test cannot drop out of CI nor run twice."""

from __future__ import annotations

import subprocess
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent


def lanes() -> dict[str, list[str]]:
    out = subprocess.run(
        ["scripts/check.sh", "--lanes"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    found = {}
    for line in out.stdout.splitlines():
        name, words, *_ = line.split(":")
        found[name] = words.split()
    return found


def covers(words: list[str], path: PurePosixPath) -> bool:
    def under(word: str) -> bool:
        return PurePosixPath(word) in (path, *path.parents)

    named = any(under(w) for w in words if not w.startswith("--"))
    ignored = any(under(w.removeprefix("--ignore=")) for w in words if w.startswith("--ignore="))
    return named and not ignored


def test_every_test_file_is_in_exactly_one_lane() -> None:
    lanes_ = lanes()
    wrong = {}
    for file in sorted((ROOT / "tests").rglob("test_*.py")):
        path = PurePosixPath(file.relative_to(ROOT).as_posix())
        where = [name for name, words in lanes_.items() if covers(words, path)]
        if len(where) != 1:
            wrong[str(path)] = where
    assert wrong == {}, "each test file must be in exactly one lane of scripts/check.sh"


def test_the_static_checks_have_their_own_lane() -> None:
    assert lanes().get("static") == []
