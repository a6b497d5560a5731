"""Tensor parallel 2 on one host (two worker processes, one core each): one RPC reaches both
ranks, the quiesce barrier spans them, and a level-2 cycle still gives identical tokens; a
rank held past the barrier timeout (but answering well within the HTTP timeout) ends the
sleep FAILED with that rank named."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.sidecarthread import Api, complete, post, sidecar_over

from controller.engines.launcher import EngineProcess

if TYPE_CHECKING:
    from support.engines import EngineLauncher

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAME = "tiny-tp2"


QUIESCE_S = 3.0  # the barrier timeout the sidecar sends; a healthy barrier takes milliseconds


@pytest.fixture(scope="module")
def server(engines: EngineLauncher, tiny_llama: Path) -> EngineProcess:
    # The test extension only adds hotswap_test_* seams (here: delay one rank's barrier).
    return engines.start_with_seams(tiny_llama, NAME, tp=2)


@pytest.fixture(scope="module")
def api(server: EngineProcess) -> Iterator[Api]:
    # fused_sleep on (the default): the ranks agree before any releases, so a prepare
    # refused on one rank leaves every rank awake as the two RPCs did
    with sidecar_over(NAME, server, {}, timeouts={"quiesce_s": QUIESCE_S}) as api:
        yield api


def test_level2_cycle_across_two_ranks(
    api: Api, server: EngineProcess, cycle_report: Callable[[str, dict[str, Any]], None]
) -> None:
    before = complete(server, NAME)
    slept = api.sleep(NAME, 2)
    assert slept.status_code == 200, slept.text
    phases = {p["name"]: p for p in slept.json()["transition"]["phases"]}
    assert sorted(r["rank"] for r in phases["quiesce"]["ranks"]) == [0, 1]
    assert all(r["late_ranks"] == [] for r in phases["quiesce"]["ranks"])
    assert sorted(r["rank"] for r in phases["suspend"]["ranks"]) == [0, 1]
    woke = api.wake(NAME)
    assert woke.status_code == 200, woke.text
    assert woke.json()["state"] == "RUNNING"
    verify = next(
        p for p in woke.json()["transition"]["phases"] if p["name"] == "resume_and_verify"
    )
    assert sorted(r["rank"] for r in verify["ranks"]) == [0, 1]
    assert all(r["mismatched"] == [] for r in verify["ranks"])
    assert complete(server, NAME) == before
    cycle_report("tp2", slept.json()["transition"])
    cycle_report("tp2", woke.json()["transition"])


def test_one_rank_failing_fails_the_sleep_naming_it_and_reconciliation_resumes_the_model(
    api: Api, server: EngineProcess
) -> None:
    """Rank 1 refuses its prepare inside the fused sleep: rank 0, whose prepare succeeded,
    releases nothing either (the ranks agree first); the sleep answers 502 naming rank 1;
    reconciliation after the failed step finds every rank awake and verified with the
    engine paused, resumes it, and the model serves again, verified."""
    before = complete(server, NAME)
    armed = post(
        server,
        "/collective_rpc",
        json={"method": "hotswap_test_fail_next_on", "args": [1, "prepare"]},
        timeout_s=30,
    )
    assert armed.status_code == 200, armed.text
    slept = api.sleep(NAME, 1)
    assert slept.status_code == 502, slept.text
    body = slept.json()
    assert body["phase"] == "prepare_and_suspend", body
    assert sorted(r["rank"] for r in body["ranks"] if not r["ok"]) == [0, 1], body
    assert "rank 1" in body["message"], body
    state = api.wait_state(NAME, "RUNNING", timeout_s=60)
    assert state["verified"] is True
    assert api.get("/health").status_code == 200
    assert complete(server, NAME) == before


def test_a_rank_late_for_the_barrier_fails_the_sleep_naming_it(
    api: Api, server: EngineProcess
) -> None:
    """Last in the module: a barrier timeout poisons the ranks' group for good."""
    assert api.state(NAME)["state"] == "RUNNING"
    held = post(
        server,
        "/collective_rpc",
        json={"method": "hotswap_test_delay_next_quiesce", "args": [1, QUIESCE_S + 3.0]},
        timeout_s=30,
    )
    assert held.status_code == 200, held.text
    slept = api.sleep(NAME, 1)
    assert slept.status_code == 504, slept.text
    body = slept.json()
    assert body["error"] == "BarrierTimeout"
    assert body["late_ranks"] == [1]
    assert body["phase"] == "quiesce"
    state = api.state(NAME)
    assert state["state"] == "FAILED"
    assert "ranks" in str(
        state["last_error"]
    )  # the reply named the late rank; this is the reconciler's later reading
    assert api.get("/health").status_code == 503
    # The ranks answered (late rank included): nothing was suspended, no queue is out of step.
    info = post(server, "/collective_rpc", json={"method": "hotswap_info"}, timeout_s=30)
    assert info.status_code == 200, info.text
    ranks = info.json()["results"]
    assert [r["suspended"] for r in ranks] == [{}, {}]
    assert all(r["poisoned"] for r in ranks)
