"""benchmarks.kvreuse's harness on CPU: its arguments, and one JSON line per case of the
shape the lead reads, on stdout and in kvreuse.json, through the real processes and the
real fd passing (`--driver fake`: the same protocol with no CUDA)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.procs import run_module

CASES = ["d", "a", "a_wait", "c", "b", "b_after", "d_late"]
WOKEN = {"create_s", "map_s", "access_s", "touch1_s", "touch2_s", "oom_retries"}
IMPORTED = {"import_s", "map_s", "access_s", "import_map_access_s", "touch1_s", "touch2_s"}


def _lines(text: str) -> list[dict[str, object]]:
    """The JSON lines of `text` (the first may be cut: run_module keeps the output's tail)."""
    out = []
    for ln in text.splitlines():
        try:
            d = json.loads(ln)
        except ValueError:
            continue
        if isinstance(d, dict):
            out.append(d)
    return out


def test_every_case_is_one_json_line_on_stdout_and_in_the_file(tmp_path: Path) -> None:
    argv = ["benchmarks.kvreuse", "--driver", "fake", "--gib", "0.01", "--records", "3"]
    argv += ["--settle-s", "0", "--wait-s", "0.01", "--out", str(tmp_path)]
    rc, out = run_module(argv, timeout_s=120)
    assert rc == 0, out
    printed = _lines(out)
    written = _lines((tmp_path / "kvreuse.json").read_text())
    assert printed
    assert printed == written[-len(printed) :]
    assert [d["case"] for d in written] == CASES
    for d in written:
        assert d["ok"] is True, d
        assert d["bench"] == "kvreuse"
        assert d["records"] == 3
        assert d["gib"] == 0.01
        woken = d["woken"]
        assert isinstance(woken, dict)
        keys = IMPORTED if str(d["case"]).startswith("b") else WOKEN
        assert keys <= set(woken), (d["case"], sorted(woken))
        if d["case"] not in ("d", "d_late"):
            victim = d["victim"]
            assert isinstance(victim, dict)
            assert {"create_s", "touch_s", "unmap_s", "release_s"} <= set(victim)
    b = written[CASES.index("b")]["victim"]
    assert isinstance(b, dict)
    assert b["fds"] == 3
    assert b["handle_type"] == "posix_fd"
    assert "after_release_s" in written[CASES.index("a_wait")]["woken"]  # type: ignore[operator]


@pytest.mark.parametrize(
    "bad", [["--cases", "a,zz"], ["--cases", ","], ["--records", "0"], ["--gib", "-1"]]
)
def test_bad_arguments_are_refused_before_any_process(bad: list[str]) -> None:
    rc, out = run_module(["benchmarks.kvreuse", "--driver", "fake", *bad], timeout_s=60)
    assert rc == 2, out
    assert "error:" in out
    assert _lines(out) == []
