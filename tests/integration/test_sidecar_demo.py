"""The sidecar's HTTP API against the embedded default: two tiny models on two real CPU vLLM
servers (uni executor), the models `hotswap serve --demo` runs (the engines' EngineCore
forked, tests/conftest.py's demo_pair says why).

Sleep/wake cycles at levels 1 and 2 must give back identical greedy tokens and logprobs;
readiness must say 503 from the first moment of a transition until the wake is verified;
concurrent wakes coalesce; a sleep during a wake is refused; a request that reaches a
sleeping engine waits and completes after the wake.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from support.sidecarthread import (
    Api,
    Completion,
    DemoPair,
    HealthPoller,
    SidecarThread,
    attached,
    complete,
    leave_awake,
)

from controller.config.modelsettings import ModelSettings

pytestmark = pytest.mark.vllm

A, B = "tiny-a", "tiny-b"


@pytest.fixture(scope="module")
def sidecar(demo_pair: DemoPair) -> Iterator[SidecarThread]:
    side = SidecarThread(attached(list(demo_pair.models.values()))).start()
    try:
        yield side
        leave_awake(side)
    finally:
        side.stop()


@pytest.fixture(scope="module")
def api(sidecar: SidecarThread) -> Api:
    return Api(sidecar.base_url)


@pytest.fixture(scope="module")
def baseline(demo_pair: DemoPair) -> dict[str, Completion]:
    """Greedy outputs of both models before anything slept: as each engine booted."""
    return demo_pair.baseline


def _url(sidecar: SidecarThread, name: str) -> ModelSettings:
    return sidecar.model(name)  # the engine, on its Unix socket


def _ensure_running(api: Api, name: str) -> None:
    if api.state(name)["state"] != "RUNNING":
        assert api.wake(name).status_code == 200
    api.wait_state(name, "RUNNING")


def test_demo_models_start_running_and_ready(
    api: Api, sidecar: SidecarThread, baseline: dict[str, Completion]
) -> None:
    models = {m["name"]: m for m in api.get("/models").json()["models"]}
    assert set(models) == {A, B}
    assert all(m["state"] == "RUNNING" for m in models.values()), models
    health = api.get("/health")
    assert health.status_code == 200, health.text
    assert health.json()["ready"] is True
    # Different seeds, different weights: the two servers really are two models.
    assert baseline[A] != baseline[B]


@pytest.mark.parametrize("level", [1, 2])
def test_cycle_gives_identical_tokens_and_readiness_tracks_it(
    api: Api,
    sidecar: SidecarThread,
    baseline: dict[str, Completion],
    cycle_report: Callable[[str, dict[str, Any]], None],
    level: int,
) -> None:
    with HealthPoller(f"{api.base_url}/health") as poller:
        time.sleep(0.05)
        slept = api.sleep(A, level)
        assert slept.status_code == 200, slept.text
        sleep_body = slept.json()
        assert sleep_body["state"] == "SUSPENDED"
        # The other model keeps serving, and from the same weights, while A sleeps.
        assert complete(_url(sidecar, B), B) == baseline[B]
        assert api.state(A)["level"] == level
        woke = api.wake(A)
        woke_at = time.time()
        assert woke.status_code == 200, woke.text
        time.sleep(0.1)
    wake_body = woke.json()
    assert wake_body["state"] == "RUNNING"
    sleep_t, wake_t = sleep_body["transition"], wake_body["transition"]
    assert (sleep_t["kind"], sleep_t["result"], sleep_t["level"]) == ("sleep", "ok", level)
    assert (wake_t["kind"], wake_t["result"]) == ("wake", "ok")
    phases = [p["name"] for p in wake_t["phases"]]
    assert "resume_and_verify" in phases  # the fused hotswap_wake (fused_wake, the default)
    assert ("reload" in phases) == (level == 2)

    # From the sleep's first moment to the wake's verified end: never ready.
    window = poller.between(sleep_t["started_at"], wake_t["ended_at"])
    assert len(window) >= 5, f"too few polls inside the cycle to judge: {len(window)}"
    assert {p.status for p in window} == {503}, [p for p in window if p.status != 503][:5]
    # And ready again once the wake returned.
    after = poller.after(woke_at)
    assert after, "no poll after the wake"
    assert {p.status for p in after} == {200}

    assert complete(_url(sidecar, A), A) == baseline[A]
    assert api.state(A)["verified"] is True
    cycle_report("uni", sleep_t)
    cycle_report("uni", wake_t)


def test_concurrent_wakes_coalesce_into_one_transition(api: Api) -> None:
    _ensure_running(api, A)
    assert api.sleep(A, 1).status_code == 200
    before = api.transitions_total(A, "wake")
    gate = threading.Barrier(3)

    def wake() -> dict[str, Any]:
        gate.wait(10.0)
        r = api.wake(A)
        assert r.status_code == 200, r.text
        body: dict[str, Any] = r.json()
        return body

    with ThreadPoolExecutor(3) as pool:
        bodies = list(pool.map(lambda _: wake(), range(3)))
    assert all(b["state"] == "RUNNING" for b in bodies), bodies
    started = {b["transition"]["started_at"] for b in bodies if b["transition"] is not None}
    assert len(started) == 1, f"more than one wake transition ran: {bodies}"
    assert sorted(b["action"] for b in bodies).count("begin") == 1, [b["action"] for b in bodies]
    assert api.transitions_total(A, "wake") == before + 1


def test_request_sent_to_a_sleeping_engine_completes_after_the_wake(
    api: Api, sidecar: SidecarThread, baseline: dict[str, Completion]
) -> None:
    _ensure_running(api, A)
    assert api.sleep(A, 2).status_code == 200
    result: list[Completion] = []
    errors: list[BaseException] = []

    def send() -> None:
        try:
            result.append(complete(_url(sidecar, A), A))
        except BaseException as exc:
            errors.append(exc)

    sender = threading.Thread(target=send, name="asleep-request")
    sender.start()
    sender.join(1.0)
    # The engine is paused while asleep: the request waits instead of running on no weights.
    assert sender.is_alive(), f"the request finished while the model slept: {result} {errors}"
    assert api.wake(A).status_code == 200
    sender.join(60.0)
    assert not sender.is_alive()
    assert errors == []
    assert result == [baseline[A]]


def test_audit_lists_every_tensor_per_rank(api: Api) -> None:
    _ensure_running(api, A)
    r = api.get(f"/models/{A}/audit", params={"level": 2})
    assert r.status_code == 200, r.text
    ranks = r.json()["ranks"]
    assert len(ranks) == 1
    assert ranks[0]["ok"] is True
    assert ranks[0]["count"] > 0
