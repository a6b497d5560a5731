"""The coverage matrix's rows as GPU tests: ours through level 1 and level 2, per row.

Each case is one cell of `benchmarks.coverage` (its own process and engine, CUDA graphs on):
the extension's sleep and wake in the controller's order, then greedy tokens and logprobs
against the pre-sleep ones. A cell of ours may be "verified, equal" or "FAILED" naming what
differs; never verified and different, never a crash. A row whose engine does not start on
this device (a kernel not built for it, a missing package) is skipped with the reason.
vLLM's own sleep is recorded by the runner (docs/coverage.md), not asserted here.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.coverage import ROWS, prepare_models, run_cell_process

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def out(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("coverage")
    (root / "cells").mkdir()
    prepare_models(ROWS, root / "models")
    return root


@pytest.mark.parametrize("level", [1, 2])
@pytest.mark.parametrize("row", [r.name for r in ROWS])
def test_ours_verified_and_equal_or_failed_with_names(out: Path, row: str, level: int) -> None:
    res = run_cell_process(row, level, "ours", out, "cuda", cycles=2, timeout_s=240.0)
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
