"""The host budget on real CPU vLLM servers, where a level-1 sleep keeps the weights in host
memory: with room for one sleeper's weights, a second level-1 sleep demotes the least
recently used sleeper to level 2 (its weights' storage freed inside the engine, as its worker
reports), the metrics and /models say so, and the demoted model's next wake reloads from the
checkpoint, verifies, and answers exactly as before. A woken CPU engine keeps no host backup
(its resumes say 0, so nothing is dropped), and `hotswap_drop_backup` on the real server frees
nothing and moves nothing while awake, and is refused while asleep."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from fault_harness import engine_http
from support.sidecarthread import Api, DemoPair, SidecarThread, attached, leave_awake

from controller.config.modelsettings import ModelSettings

pytestmark = pytest.mark.vllm

A, B = "tiny-a", "tiny-b"  # the demo pair's engines (conftest.demo_pair), shared
PROMPT = {"prompt": "hello world, this is", "max_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def engines_ab(demo_pair: DemoPair) -> dict[str, ModelSettings]:
    return {A: demo_pair.models[A], B: demo_pair.models[B]}


def _answer(side: SidecarThread, name: str) -> str:
    assert side.gateway_url is not None
    r = httpx.post(
        f"{side.gateway_url}/v1/completions", json={"model": name, **PROMPT}, timeout=120
    )
    assert r.status_code == 200, r.text
    return str(r.json()["choices"][0]["text"])


@pytest.fixture(scope="module")
def weights(engines_ab: dict[str, ModelSettings]) -> int:
    """Host bytes one level-1 sleeper holds: its weights, as a sidecar without a budget sees."""
    side = SidecarThread(attached(list(engines_ab.values())), gateway={"enabled": True}).start()
    try:
        api = Api(side.base_url)
        r = api.sleep(A, 1)
        assert r.status_code == 200, r.text
        held = int(api.state(A)["fleet"]["host_bytes"])
        assert api.wake(A).status_code == 200
    finally:
        side.stop()
    assert held > 0
    return held


@pytest.fixture(scope="module")
def sidecar(engines_ab: dict[str, ModelSettings], weights: int) -> Iterator[SidecarThread]:
    side = SidecarThread(
        attached(list(engines_ab.values())),
        gateway={"enabled": True},
        swap={"host_budget": weights + weights // 2, "min_awake_s": 0.0},
    )
    side.start()
    try:
        yield side
        leave_awake(side)
    finally:
        side.stop()


def test_a_second_level1_sleep_demotes_the_lru_sleeper(
    sidecar: SidecarThread, weights: int
) -> None:
    api = Api(sidecar.base_url)
    before = {n: _answer(sidecar, n) for n in (A, B)}  # B used last: A is the LRU
    assert before[A] != before[B]
    r = api.sleep(A, 1)
    assert r.status_code == 200, r.text
    assert api.state(A)["level"] == 1
    assert api.state(A)["fleet"]["host_bytes"] == weights
    assert api.metric("hotswap_demotions_total", model=A) == 0
    r = api.sleep(B, 1)  # two sleepers' weights do not fit: A goes to level 2 first
    assert r.status_code == 200, r.text
    a, b = api.state(A), api.state(B)
    assert (a["state"], a["level"], a["fleet"]["host_bytes"]) == ("SUSPENDED", 2, 0)
    assert (b["state"], b["level"], b["fleet"]["host_bytes"]) == ("SUSPENDED", 1, weights)
    assert api.metric("hotswap_demotions_total", model=A, reason="host_budget") == 1
    assert api.metric("hotswap_model_host_bytes", model=A) == 0
    assert api.metric("hotswap_model_host_bytes", model=B) == weights
    fleet = api.get("/models").json()["fleet"]
    assert fleet["host_budget_bytes"] == weights + weights // 2
    assert fleet["host_bytes"] == weights
    # The demoted model wakes from its checkpoint, verified, and answers as before.
    assert _answer(sidecar, A) == before[A]
    a = api.state(A)
    assert a["state"] == "RUNNING"
    assert a["verified"] is True
    phases = [p["name"] for p in a["last_transition"]["phases"]]
    assert any("reload" in p for p in phases), phases
    assert _answer(sidecar, B) == before[B]


def _rpc(engine: Any, method: str) -> list[dict[str, Any]]:
    with engine_http(f"unix:{engine.uds}") as client:
        r = client.post("/collective_rpc", json={"method": method, "args": [], "kwargs": {}})
    assert r.status_code == 200, r.text
    results: list[dict[str, Any]] = r.json()["results"]
    return results


def _truth(engine: Any) -> tuple[Any, ...]:
    (info,) = _rpc(engine, "hotswap_info")
    assert info["ok"], info
    assert info["host_backup_bytes"] == 0
    return info["phase"], info["transitions"], info["verified_transition"], info["boot_id"]


def test_a_woken_cpu_engine_keeps_no_backup_and_drop_backup_frees_nothing(
    sidecar: SidecarThread, engines_ab: dict[str, ModelSettings]
) -> None:
    api = Api(sidecar.base_url)
    before = _answer(sidecar, A)  # awake (woken by the previous test's request, or now)
    a = api.state(A)
    assert a["state"] == "RUNNING"
    assert a["fleet"]["host_bytes"] == 0
    resumes = [p for p in a["last_transition"]["phases"] if p["name"].startswith("resume")]
    assert resumes, a["last_transition"]["phases"]
    assert all(r["host_backup_bytes"] == 0 for p in resumes for r in p["ranks"])
    assert api.metric("hotswap_host_backups_dropped_total", model=A) == 0
    truth = _truth(engines_ab[A])
    (dropped,) = _rpc(engines_ab[A], "hotswap_drop_backup")
    assert dropped["ok"], dropped
    assert dropped["freed_host_bytes"] == {"weights": 0, "kv_cache": 0}
    assert _truth(engines_ab[A]) == truth  # host memory only: no memory step
    assert _answer(sidecar, A) == before
    r = api.sleep(A, 1)
    assert r.status_code == 200, r.text
    asleep = _truth(engines_ab[A])
    (refused,) = _rpc(engines_ab[A], "hotswap_drop_backup")
    assert refused["ok"] is False
    assert "not awake" in refused["error"]
    assert _truth(engines_ab[A]) == asleep
    assert _answer(sidecar, A) == before
