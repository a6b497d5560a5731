"""One real vLLM server in its default multiprocess layout (API server, EngineCore and a
separate worker process: the production topology), driven through the sidecar's API.

Levels 1 and 2 on the same server; greedy tokens and logprobs identical after each wake.
The measured phase timings land in the session summary.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from support.sidecarthread import Api, Completion, complete, post, sidecar_over

from controller.engines.launcher import EngineProcess

if TYPE_CHECKING:
    from support.engines import EngineLauncher

pytestmark = pytest.mark.vllm

NAME = "tiny-mp"


@pytest.fixture(scope="module")
def server(engines: EngineLauncher, tiny_llama: Path) -> EngineProcess:
    # The test extension only adds hotswap_test_* seams (here: hold a wake open). Its
    # EngineCore spawned as in production (the other test engines fork theirs).
    return engines.start_with_seams(tiny_llama, NAME, uni=False, fork_core=False)


@pytest.fixture(scope="module")
def api(server: EngineProcess) -> Iterator[Api]:
    with sidecar_over(NAME, server) as api:
        yield api


@pytest.fixture(scope="module")
def baseline(server: EngineProcess) -> Completion:
    return complete(server, NAME)


@pytest.mark.parametrize("level", [1, 2])
def test_cycle_in_the_multiprocess_layout(
    api: Api,
    server: EngineProcess,
    baseline: Completion,
    cycle_report: Callable[[str, dict[str, Any]], None],
    level: int,
) -> None:
    assert api.state(NAME)["state"] == "RUNNING"
    slept = api.sleep(NAME, level)
    assert slept.status_code == 200, slept.text
    assert slept.json()["state"] == "SUSPENDED"
    assert api.get("/health").status_code == 503
    woke = api.wake(NAME)
    assert woke.status_code == 200, woke.text
    assert woke.json()["state"] == "RUNNING"
    assert api.get("/health").status_code == 200
    assert complete(server, NAME) == baseline
    # The worker is its own process here: its reports come back over vLLM's RPC queues.
    # the fused sleep's one RPC (fused_sleep, the default) reports as the suspend did
    names = ("suspend", "prepare_and_suspend")
    suspend = next(p for p in slept.json()["transition"]["phases"] if p["name"] in names)
    assert [r["rank"] for r in suspend["ranks"]] == [0]
    cycle_report("mp", slept.json()["transition"])
    cycle_report("mp", woke.json()["transition"])


def test_sleep_during_a_wake_is_refused(api: Api, server: EngineProcess) -> None:
    """The wake is held open inside the ranks (a test seam), so the sleep surely lands in it."""
    assert api.sleep(NAME, 1).status_code == 200
    held = post(
        server,
        "/collective_rpc",
        json={"method": "hotswap_test_hold_next", "args": ["restore_and_verify", 2.0]},
        timeout_s=30,
    )
    assert held.status_code == 200, held.text
    accepted = api.wake(NAME, wait="false")
    assert accepted.status_code == 202, accepted.text
    assert api.state(NAME)["state"] == "RESUMING"
    refused = api.sleep(NAME, 1)
    assert refused.status_code == 409, refused.text
    assert refused.json()["error"] == "TransitionConflict"
    body = api.wait_state(NAME, "RUNNING")
    assert body["verified"] is True
    assert body["last_transition"]["kind"] == "wake"
