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
from sidecar_harness import Api, Completion, complete, sidecar_over

from controller.launcher import EngineProcess

if TYPE_CHECKING:
    from conftest import EngineLauncher

pytestmark = pytest.mark.vllm

NAME = "tiny-mp"


@pytest.fixture(scope="module")
def server(engines: EngineLauncher, tiny_llama: Path) -> EngineProcess:
    return engines.start(tiny_llama, NAME, uni=False)


@pytest.fixture(scope="module")
def api(server: EngineProcess) -> Iterator[Api]:
    with sidecar_over(NAME, server.base_url) as api:
        yield api


@pytest.fixture(scope="module")
def baseline(server: EngineProcess) -> Completion:
    return complete(server.base_url, NAME)


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
    assert complete(server.base_url, NAME) == baseline
    # The worker is its own process here: its reports come back over vLLM's RPC queues.
    suspend = next(p for p in slept.json()["transition"]["phases"] if p["name"] == "suspend")
    assert [r["rank"] for r in suspend["ranks"]] == [0]
    cycle_report("mp", slept.json()["transition"])
    cycle_report("mp", woke.json()["transition"])
