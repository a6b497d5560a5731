"""The coverage matrix's rows as GPU tests: ours through level 1 and level 2, per row.

Each case is one cell of the matrix's runner (`python -m benchmarks.coverage run`, driven
here as a process: its own process and engine per cell, CUDA graphs on): the extension's
sleep and wake in the controller's order, then greedy tokens and logprobs against the
pre-sleep ones. A cell of ours may be "verified, equal" or "FAILED" naming what differs;
never verified and different, never a crash. A row whose engine does not start on this
device (a kernel not built for it, a missing package) is skipped with the reason. vLLM's
own sleep is recorded by the runner (docs/coverage.md), not asserted here.

The cells run at once (HOTSWAP_GPU_COVERAGE_JOBS, default 8) before the first case. They
take a few minutes of device time, so they run only with HOTSWAP_GPU_COVERAGE=1 (the
runner itself is the usual way to run them).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

# The toolbox by its full name: on the device tests/gpu runs with --confcutdir, which leaves
# tests/ off the path.
from tests.support.procs import run_module
from worker_ext.devarches import ROWS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        os.environ.get("HOTSWAP_GPU_COVERAGE") != "1",
        reason="set HOTSWAP_GPU_COVERAGE=1 (minutes of device time; the runner covers it)",
    ),
]
LEVELS = (1, 2)
CELL_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def cells(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, int], dict[str, Any]]:
    out: Path = tmp_path_factory.mktemp("coverage")
    jobs = os.environ.get("HOTSWAP_GPU_COVERAGE_JOBS", "8")
    waves = -(-len(ROWS) * len(LEVELS) // int(jobs))
    budget_s = waves * CELL_TIMEOUT_S + 120  # every cell, each within its own timeout
    args = [
        "benchmarks.coverage", "run", "--out", str(out),
        "--sides", "ours", "--levels", ",".join(map(str, LEVELS)), "--jobs", jobs,
        "--cycles", "2", "--cell-timeout-s", str(CELL_TIMEOUT_S), "--budget-s", str(budget_s),
        "--platform", "cuda",
    ]  # fmt: skip
    rc, log = run_module(args, budget_s + 300)
    assert rc == 0, log
    doc = json.loads((out / "coverage.json").read_text())
    return {(c["row"], c["level"]): c for c in doc["cells"]}


@pytest.mark.parametrize("level", LEVELS)
@pytest.mark.parametrize("row", [r.name for r in ROWS])
def test_ours_verified_and_equal_or_failed_with_names(
    cells: dict[tuple[str, int], dict[str, Any]], row: str, level: int
) -> None:
    res = cells[(row, level)]
    outcome = res["outcome"]
    if outcome == "not supported":
        pytest.skip(f"{row}: engine does not start here: {res.get('reason')}")
    assert res.get("deterministic", False), f"{row}: greedy generation not deterministic"
    assert outcome in ("verified, equal", "FAILED"), (outcome, res.get("reason"), res["cycles"])
    if outcome == "FAILED":
        failed = [c["steps"] for c in res["cycles"] if c.get("steps", {}).get("failed_at")]
        assert failed, res["cycles"]
        assert failed[0].get("mismatched") or failed[0].get("error"), failed
    else:
        assert len(res["cycles"]) == 2
        for c in res["cycles"]:
            verify = c["steps"]["restore_and_verify"]
            assert verify["ok"], verify
            assert verify["mismatched"] == [], verify
