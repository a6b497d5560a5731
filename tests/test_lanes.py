"""CI's lanes (scripts/check.sh --lanes) cover every test: each test file under tests/ is in
exactly one lane (a lane names it or a folder above it, and does not --ignore it), so a new
test cannot drop out of CI nor run twice."""

from __future__ import annotations

import subprocess
from pathlib import Path, PurePosixPath

ROOT = Path(__file__).resolve().parent.parent


def listed() -> list[str]:
    """scripts/check.sh --lanes: NAME:WORDS[:KIND], a line each."""
    out = subprocess.run(
        ["scripts/check.sh", "--lanes"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return out.stdout.splitlines()


def lanes() -> dict[str, list[str]]:
    found = {}
    for line in listed():
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


def test_the_soak_runs_in_the_one_lane_first_in_line_for_the_cpu() -> None:
    """The soak holds a latency bound (/livez p99): its lane is the one that keeps CI's own
    priority while the others run below it (scripts/check.sh)."""
    first = [line.split(":") for line in listed() if line.endswith(":first")]
    assert len(first) == 1, first
    assert "tests/integration/test_soak.py" in first[0][1].split()
