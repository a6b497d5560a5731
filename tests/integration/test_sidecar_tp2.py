"""Tensor parallel 2 on one host (two worker processes, one core each): one RPC reaches both
ranks, the quiesce barrier spans them, and a level-2 cycle still gives identical tokens."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from sidecar_harness import Api, complete, sidecar_over

from controller.launcher import EngineProcess

if TYPE_CHECKING:
    from conftest import EngineLauncher

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

NAME = "tiny-tp2"


@pytest.fixture(scope="module")
def server(engines: EngineLauncher, tiny_llama: Path) -> EngineProcess:
    return engines.start(tiny_llama, NAME, tp=2)


@pytest.fixture(scope="module")
def api(server: EngineProcess) -> Iterator[Api]:
    with sidecar_over(NAME, server.base_url) as api:
        yield api


def test_level2_cycle_across_two_ranks(
    api: Api, server: EngineProcess, cycle_report: Callable[[str, dict[str, Any]], None]
) -> None:
    before = complete(server.base_url, NAME)
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
        p for p in woke.json()["transition"]["phases"] if p["name"] == "restore_and_verify"
    )
    assert sorted(r["rank"] for r in verify["ranks"]) == [0, 1]
    assert all(r["mismatched"] == [] for r in verify["ranks"])
    assert complete(server.base_url, NAME) == before
    cycle_report("tp2", slept.json()["transition"])
    cycle_report("tp2", woke.json()["transition"])
