"""A model's `sleep_driver: vllm` (docs/contracts.md §2.3): the sidecar drives vLLM's own
/sleep and /wake_up, the engine paused around them, the ranks read back after each; a
plain engine's wake is served only where the operator accepted it, and /health and
/models say it is not verified. Against the fake engine (support.fakevllm), through the
control API in-process."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from pydantic import ValidationError
from support.fakevllm import FakeVllm

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings, TimeoutSettings
from controller.engines.engine import EngineClient
from controller.sidecar import Sidecar

URL = "http://a.engine.test"


def run(coro: Any) -> None:
    asyncio.run(coro)


@asynccontextmanager
async def control(fake: FakeVllm, **model: Any) -> AsyncIterator[tuple[httpx.AsyncClient, Sidecar]]:
    settings = Settings(
        models=[ModelSettings(name="a", url=URL, **model)],
        timeouts=TimeoutSettings(drain_s=5.0, shutdown_s=2.0),
    )

    def factory(m: ModelSettings, t: TimeoutSettings) -> EngineClient:
        return EngineClient(m.url, transport=fake.transport(), timeouts=t)

    side = Sidecar(settings, registry=CollectorRegistry(), engine_factory=factory)
    app = side.app
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://s") as c,
    ):
        await side.started.wait()
        yield c, side


VLLM = {"sleep_driver": "vllm"}
ACCEPT = {"sleep_driver": "vllm", "accept_unverified_wake": True}


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize(
    ("model", "says"),
    [
        ({"accept_unverified_wake": True}, "applies to sleep_driver: vllm only"),
        ({**VLLM, "keep_prefix_cache": True}, "cannot keep_prefix_cache"),
        ({**VLLM, "deep_sleep": "pressure"}, "needs deep_sleep off"),
        ({**VLLM, "deep_sleep": "always"}, "needs deep_sleep off"),
    ],
)
def test_bad_combinations_are_refused_at_load(model: dict[str, Any], says: str) -> None:
    with pytest.raises(ValidationError, match=says):
        ModelSettings(name="a", url=URL, **model)


def test_a_vllm_driven_model_beside_a_host_budget_is_refused_at_load() -> None:
    with pytest.raises(ValidationError, match="host_budget could not count it"):
        Settings(models=[ModelSettings(name="a", url=URL, **VLLM)], swap={"host_budget": 0.5})
    Settings(models=[ModelSettings(name="a", url=URL, **ACCEPT)])  # the good one loads


# ----------------------------------------------------------------------------- the backend


def _sleep_calls(calls: list[str]) -> list[str]:
    return [c for c in calls if c not in ("/health", "/metrics", "/v1/models")]


def test_the_backends_sleep_and_wake_go_through_vllm_paused_around_and_verified() -> None:
    """/pause (the drain) before vLLM's /sleep; the ranks read back after it and after
    vLLM's /wake_up; never an extension memory RPC; the wake verified by the backend."""

    async def main() -> None:
        fake = FakeVllm(name="a", sleep_backend="hotswap")
        async with control(fake, **VLLM) as (c, _):
            fake.calls.clear()
            r = await c.post("/models/a/sleep", json={"level": 1})
            assert r.status_code == 200, r.text
            assert r.json()["state"] == "SUSPENDED"
            assert _sleep_calls(fake.calls) == [
                "/pause?wait", "/is_paused", "hotswap_drop_backup", "/sleep", "/is_sleeping",
                "hotswap_info",
            ]  # fmt: skip
            phases = {p["name"]: p for p in r.json()["transition"]["phases"]}
            assert phases["vllm_check"]["detail"] == {"vllm_backend": "hotswap"}
            full = (await c.get("/models/a")).json()
            assert full["fleet"]["vllm_asleep"] == "hotswap"
            assert full["fleet"]["sleep_driver"] == "vllm"
            assert fake.executor_asleep
            assert fake.paused
            fake.calls.clear()
            r = await c.post("/models/a/wake")
            assert r.status_code == 200, r.text
            body = r.json()
            assert (body["state"], body["verified"]) == ("RUNNING", True)
            calls = _sleep_calls(fake.calls)
            assert calls[:3] == ["/wake_up", "/is_sleeping", "hotswap_info"]
            assert "/resume" in calls
            assert "/v1/completions" in calls
            assert not [c for c in fake.calls if c.startswith("hotswap_") and c != "hotswap_info"]
            # (the sleep's only other RPC is hotswap_drop_backup, which moves no pool)
            text = (await c.get("/metrics")).text
            assert 'hotswap_unverified_wakes_total{model="a"} 0.0' in text  # verified
            h = (await c.get("/models/a/health")).json()
            assert h["ready"] is True
            assert h["models"]["a"] == {
                "state": "RUNNING", "verified": True, "unverified_wake": False,
                "gate": "gated", "ready": True,
            }  # fmt: skip
            assert (await c.get("/models/a")).json()["fleet"]["vllm_asleep"] is None

    run(main())


@pytest.mark.parametrize("cuda", [True, False])
def test_a_plain_engine_without_the_operators_consent_is_refused_at_its_sleep(cuda: bool) -> None:
    """The ranks did not move under vLLM's /sleep: its wake would not be verified, so the
    sleep fails with the reason. Where vLLM's allocator holds pools asleep (CUDA) the model
    is FAILED, never resumed; where nothing was released (CPU, whose worker sleep does
    nothing) the reconciliation resumes it as after any sleep that released nothing."""

    async def main() -> None:
        fake = FakeVllm(name="a", sleep_backend="plain", allocator_shows=cuda)
        async with control(fake, **VLLM) as (c, _):
            r = await c.post("/models/a/sleep", json={"level": 1})
            assert r.status_code == 502
            assert "not the hotswap backend's" in r.json()["message"]
            snap = (await c.get("/models/a")).json()
            assert "not the hotswap backend's" in snap["last_error"]
            if cuda:
                assert snap["state"] == "FAILED"
                assert fake.paused  # left asleep and paused
                assert (await c.get("/health")).status_code == 503
            else:
                assert (snap["state"], snap["verified"]) == ("RUNNING", True)
                assert not fake.executor_asleep
                assert not fake.paused

    run(main())


# ----------------------------------------------------------------------------- plain, accepted


def test_an_accepted_unverified_wake_is_served_and_said_unverified_everywhere() -> None:
    async def main() -> None:
        fake = FakeVllm(name="a", sleep_backend="plain")
        async with control(fake, **ACCEPT) as (c, side):
            before = (await c.get("/models/a")).json()
            assert (before["verified"], before["unverified_wake"]) == (True, False)  # fresh
            r = await c.post("/models/a/sleep", json={"level": 1})
            assert r.status_code == 200, r.text
            phases = {p["name"]: p for p in r.json()["transition"]["phases"]}
            assert phases["vllm_check"]["detail"] == {"vllm_backend": "plain", "verified": False}
            assert (await c.get("/models/a")).json()["fleet"]["vllm_asleep"] == "plain"
            fake.calls.clear()
            r = await c.post("/models/a/wake")
            assert r.status_code == 200, r.text
            assert r.json()["verified"] is False
            assert _sleep_calls(fake.calls)[:2] == ["/wake_up", "/is_sleeping"]
            assert fake.reloads == 0  # level 1: one /wake_up
            h = await c.get("/health")
            assert h.status_code == 200
            entry = h.json()["models"]["a"]
            assert entry["verified"] is False
            assert entry["unverified_wake"] is True
            assert entry["ready"] is True
            one = await c.get("/models/a/health")
            assert one.status_code == 200
            assert one.json()["models"]["a"]["verified"] is False
            text = (await c.get("/metrics")).text
            assert 'hotswap_unverified_wakes_total{model="a"} 1.0' in text
            compact = (await c.get("/models")).json()["models"][0]
            assert (compact["verified"], compact["unverified_wake"]) == (False, True)
            # read back again (the periodic reconciliation): still not verified
            mm = side.manager.get("a")
            fake.paused = True  # an operator's /pause: the cache no longer fits, it probes
            await mm.check_recovered()
            snap = mm.snapshot()
            assert (snap.state.value, snap.verified, snap.unverified_wake) == (
                "RUNNING", False, True,
            )  # fmt: skip
            # a new process is a fresh load: verified again
            fake.fresh()
            await mm.check_recovered()
            snap = mm.snapshot()
            assert (snap.verified, snap.unverified_wake) == (True, False)

    run(main())


def test_a_plain_sleep_the_cpu_ranks_cannot_show_is_not_resumed_when_read_again() -> None:
    """On CPU vLLM's plain sleep leaves no trace in the ranks (awake, paused): read again,
    it stays SUSPENDED at its level (the old rules took it for an interrupted sleep and
    resumed it behind the policy's back), and its wake is still vLLM's."""

    async def main() -> None:
        fake = FakeVllm(name="a", sleep_backend="plain")
        async with control(fake, **ACCEPT) as (c, side):
            assert (await c.post("/models/a/sleep", json={"level": 1})).status_code == 200
            mm = side.manager.get("a")
            mm.record.facts.boot_ids = None  # the cache no longer fits: the ranks are read
            fake.calls.clear()
            await mm.check_recovered()
            assert "hotswap_info" in fake.calls
            snap = mm.snapshot()
            assert (snap.state.value, snap.level) == ("SUSPENDED", 1)
            assert fake.paused
            assert fake.executor_asleep
            r = await c.post("/models/a/wake")
            assert r.status_code == 200, r.text
            assert fake.reloads == 0  # level 1 kept: one /wake_up

    run(main())


def test_a_plain_level_2_wake_reloads_between_the_two_tags() -> None:
    async def main() -> None:
        fake = FakeVllm(name="a", sleep_backend="plain")
        async with control(fake, **ACCEPT) as (c, _):
            assert (await c.post("/models/a/sleep", json={"level": 2})).status_code == 200
            fake.calls.clear()
            r = await c.post("/models/a/wake")
            assert r.status_code == 200, r.text
            wakes = [q for q in fake.requests if q.url.path == "/wake_up"]
            assert [q.url.params.get_list("tags") for q in wakes[:2]] == [
                ["weights"], ["kv_cache"],
            ]  # fmt: skip
            order = _sleep_calls(fake.calls)
            assert order[:4] == ["/wake_up", "reload_weights", "/wake_up", "/is_sleeping"]
            assert fake.reloads == 1

    run(main())


def test_a_plain_sleep_a_restarted_sidecar_finds_is_asleep_and_woken_in_the_level_2_order() -> None:
    """CUDA's plain sleep shows in the ranks' allocator: with the consent it is SUSPENDED
    (not FAILED, `asleep-accepted`), its level unknown, so its wake reloads between tags."""

    async def main() -> None:
        fake = FakeVllm(name="a", sleep_backend="plain", allocator_shows=True)
        fake.executor_asleep = {"weights", "kv_cache"}
        fake.paused = True
        fake.set_truth(allocator_asleep=["kv_cache", "weights"])
        async with control(fake, **ACCEPT) as (c, _):
            snap = (await c.get("/models/a")).json()
            assert snap["state"] == "SUSPENDED"
            assert snap["fleet"]["vllm_asleep"] == "plain"
            r = await c.post("/models/a/wake")
            assert r.status_code == 200, r.text
            assert (r.json()["state"], r.json()["verified"]) == ("RUNNING", False)
            assert fake.reloads == 1
        fake.set_truth(allocator_asleep=["kv_cache", "weights"])
        fake.paused = True
        async with control(fake, **VLLM) as (c, _):  # without the consent: FAILED
            assert (await c.get("/models/a")).json()["state"] == "FAILED"

    run(main())


def test_a_sleep_the_extension_made_is_woken_by_the_extension_whatever_the_driver() -> None:
    async def main() -> None:
        fake = FakeVllm(name="a", sleep_backend="hotswap").asleep(1)  # the extension's sleep
        async with control(fake, **VLLM) as (c, _):
            assert (await c.get("/models/a")).json()["state"] == "SUSPENDED"
            fake.calls.clear()
            r = await c.post("/models/a/wake")
            assert r.status_code == 200, r.text
            assert r.json()["verified"] is True
            assert "hotswap_wake" in fake.calls  # the memory came back by the extension
            assert fake.calls.index("hotswap_wake") < fake.calls.index("/resume")
            fake.calls.clear()
            assert (await c.post("/models/a/sleep", json={"level": 1})).status_code == 200
            assert "/sleep" in fake.calls
            assert "hotswap_sleep" not in fake.calls

    run(main())


def test_the_extensions_kept_host_copy_is_dropped_before_vllms_sleep() -> None:
    """After the extension's wake the ranks keep its host copy (CUDA-like); vLLM's sleep
    keeps one of its own: the copy is released first (never two at once)."""

    async def main() -> None:
        fake = FakeVllm(name="a", sleep_backend="hotswap", host_backup=100).asleep(1)
        async with control(fake, **VLLM) as (c, _):
            assert (await c.post("/models/a/wake")).status_code == 200
            assert fake.backup_held == 100
            fake.calls.clear()
            r = await c.post("/models/a/sleep", json={"level": 1})
            assert r.status_code == 200, r.text
            assert _sleep_calls(fake.calls)[:4] == [
                "/pause?wait", "/is_paused", "hotswap_drop_backup", "/sleep",
            ]  # fmt: skip
            assert fake.backup_held == 0
            phases = {p["name"]: p for p in r.json()["transition"]["phases"]}
            assert phases["drop_backup"]["detail"] == {"freed_host_bytes": 200}  # 2 ranks

    run(main())


def test_a_deep_sleep_of_a_vllm_driven_model_is_refused_422() -> None:
    async def main() -> None:
        fake = FakeVllm(name="a", sleep_backend="hotswap")
        async with control(fake, **VLLM) as (c, _):
            r = await c.post("/models/a/sleep", json={"level": 1, "deep": True})
            assert r.status_code == 422
            assert "sleep_driver vllm" in r.json()["message"]
            assert (await c.get("/models/a")).json()["state"] == "RUNNING"

    run(main())
