"""Keeping the prefix cache across a level-1 sleep (docs/contracts.md §1.3), and what a
sleeper leaves on its device, against the fake engine world (fakevllm.FakeVllm).

The sequence with keep: /pause with clear_cache=false, quiesce, prepare(level, "keep"), the
kv decision, suspend(level, None, "keep"); a rank that cannot keep makes the controller
clear vLLM's prefix cache before anything is released and suspend as usual, with the
reason in the transition.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from support.fakesidecar import scenario
from support.fakevllm import FakeVllm
from support.rig import FakeClock, Rig, make_rig

from controller import protocol
from controller.config.settings import ModelSettings, Settings
from controller.errors import EngineError
from controller.models import steps
from controller.reports import PrepareReport, SuspendReport, kv_decision, resident_bytes
from controller.state import State

pytestmark = pytest.mark.anyio

KEEP_CALLS = ["/pause?wait", "/is_paused", "hotswap_quiesce", "hotswap_prepare", "hotswap_suspend"]


async def keep_rig(keep: bool = True, **world: Any) -> Rig:
    rig = make_rig(FakeClock())
    rig.m.settings = rig.m.settings.model_copy(update={"keep_prefix_cache": keep})
    for k, v in world.items():
        setattr(rig.world, k, v)
    await rig.manager.start()
    rig.world.calls.clear()
    rig.world.requests.clear()
    return rig


def sent(rig: Rig, method: str) -> list[Any]:
    """The args of every RPC `method` sent, in order."""
    bodies = [json.loads(r.content) for r in rig.world.requests if r.url.path == "/collective_rpc"]
    return [b["args"] for b in bodies if b["method"] == method]


def pause_params(rig: Rig) -> dict[str, str]:
    (pause,) = [r for r in rig.world.requests if r.url.path == "/pause"]
    return dict(pause.url.params)


async def test_a_kept_sleep_does_not_clear_and_asks_every_rank_to_keep() -> None:
    rig = await keep_rig()
    out = await rig.m.sleep(1)
    assert rig.world.calls == KEEP_CALLS
    assert pause_params(rig) == {"mode": "wait", "clear_cache": "false"}
    assert sent(rig, "hotswap_prepare") == [[1, "keep"]]
    assert sent(rig, "hotswap_suspend") == [[1, None, "keep"]]
    assert rig.world.prefix_resets == 0
    rec = out.transition
    assert rec is not None
    assert [p.name for p in rec.phases] == ["drain", "quiesce", "prepare", "kv", "suspend"]
    assert rec.phases[3].detail == {"kv": "keep"}
    assert rig.world.suspended == {"weights": "offloaded", "kv_cache": "offloaded"}
    # what the two ranks left on the device (100 each), for the policy's asleep_bytes
    assert rec.phases[4].detail["resident_bytes"] == 200
    assert rig.m.snapshot().resident_bytes == 200
    await rig.m.wake()
    assert rig.m.snapshot().state is State.RUNNING
    assert rig.m.snapshot().resident_bytes is None


async def test_a_rank_that_cannot_keep_makes_the_sleep_clear_first() -> None:
    rig = await keep_rig(kv_refusal={1: "host memory: need 9 bytes"})
    out = await rig.m.sleep(1)
    calls = rig.world.calls
    assert calls.index("hotswap_prepare") < calls.index("/reset_prefix_cache")
    assert calls.index("/reset_prefix_cache") < calls.index("hotswap_suspend")
    assert rig.world.prefix_resets == 1
    assert sent(rig, "hotswap_suspend") == [[1]]  # discarded, as a plain level-1 sleep
    assert rig.world.suspended["kv_cache"] == "discarded"
    rec = out.transition
    assert rec is not None
    kv = next(p for p in rec.phases if p.name == "kv")
    assert kv.detail["kv"] == "discard"
    assert "rank 1: host memory: need 9 bytes" in kv.detail["reason"]
    assert rig.m.snapshot().state is State.SUSPENDED


async def test_a_refused_reset_releases_nothing() -> None:
    rig = await keep_rig(kv_refusal={0: "prefix caching is off"}, reset_ok=False)
    with pytest.raises(EngineError, match="refused to reset its prefix cache"):
        await rig.m.sleep(1)
    assert "hotswap_suspend" not in rig.world.calls
    assert rig.world.suspended == {}
    assert rig.m.snapshot().state is not State.SUSPENDED


async def test_the_request_overrides_the_setting_both_ways() -> None:
    rig = await keep_rig(keep=False)
    await rig.m.sleep(1, keep_prefix_cache=True)
    assert pause_params(rig)["clear_cache"] == "false"
    assert sent(rig, "hotswap_suspend") == [[1, None, "keep"]]
    await rig.m.wake()

    rig = await keep_rig(keep=True)
    out = await rig.m.sleep(1, keep_prefix_cache=False)
    assert pause_params(rig)["clear_cache"] == "true"
    assert sent(rig, "hotswap_sleep") == [[1]]  # not kept: the fused sleep (fused_sleep)
    assert out.transition is not None
    assert "kv" not in [p.name for p in out.transition.phases]


async def test_level_2_never_keeps() -> None:
    rig = await keep_rig(keep=True)
    with pytest.raises(ValueError, match="level 1 only"):
        await rig.m.sleep(2, keep_prefix_cache=True)
    assert rig.world.calls == []
    out = await rig.m.sleep(2)  # the model's setting: said why, cleared as usual
    assert pause_params(rig)["clear_cache"] == "true"
    assert sent(rig, "hotswap_suspend") == [[2]]  # not kept; level 2 is never fused
    assert out.transition is not None
    kv = out.transition.phases[0]
    assert (kv.name, kv.detail["kv"]) == ("kv", "discard")
    assert kv.detail["reason"] == steps.LEVEL2_KV


def test_the_setting_is_checked_at_start() -> None:
    with pytest.raises(ValidationError, match="keep_prefix_cache needs default_level 1"):
        ModelSettings(name="m", url="http://m", keep_prefix_cache=True, default_level=2)
    with pytest.raises(ValidationError, match="keep_prefix_cache"):
        ModelSettings(name="m", url="http://m", keep_prefix_cache="maybe")  # type: ignore[arg-type]
    s = Settings(models=[{"name": "m", "url": "http://m", "keep_prefix_cache": True}])  # type: ignore[list-item]
    assert s.models[0].keep_prefix_cache is True


def test_protocol_arguments_and_decisions() -> None:
    keep = protocol.Params(level=1, keep_kv=True)
    plain = protocol.Params(level=1)
    assert protocol.PREPARE.call_args(keep) == (1, "keep")
    assert protocol.PREPARE.call_args(plain) == (1,)
    assert protocol.SUSPEND.call_args(keep) == (1, None, "keep")
    assert protocol.SUSPEND.call_args(protocol.Params(level=1, tags=("kv_cache",))) == (
        1,
        ["kv_cache"],
    )
    yes = PrepareReport.parse({"ok": True, "rank": 0, "kv": "keep"})
    no = PrepareReport.parse({"ok": True, "rank": 1, "kv": "discard", "kv_reason": "x"})
    assert kv_decision([yes, yes]) == (True, None)
    assert kv_decision([yes, no]) == (False, "rank 1: x")
    assert kv_decision([]) == (False, "no rank answered the prepare")
    a = SuspendReport.parse({"ok": True, "rank": 0, "resident_bytes": 5})
    b = SuspendReport.parse({"ok": True, "rank": 1, "resident_bytes": 7})
    old = SuspendReport.parse({"ok": True, "rank": 1})
    assert resident_bytes([a, b]) == 12
    assert resident_bytes([a, old]) is None  # a rank that did not say: unknown


@scenario(models={"a": {"keep_prefix_cache": True}})
async def test_api_keeps_refuses_level_2_and_shows_the_setting(
    client: httpx.AsyncClient, f: dict[str, FakeVllm]
) -> None:
    one = (await client.get("/models/a")).json()
    assert (one["keep_prefix_cache"], one["resident_bytes"]) == (True, None)
    r = await client.post("/models/a/sleep", json={"level": 2, "keep_prefix_cache": True})
    assert r.status_code == 422, r.text
    assert "level 1 only" in r.json()["message"]
    assert f["a"].suspended == {}
    r = await client.post("/models/a/sleep", json={"keep_prefix_cache": True})
    assert r.status_code == 200, r.text
    phases = {p["name"]: p for p in r.json()["transition"]["phases"]}
    assert phases["kv"]["detail"] == {"kv": "keep"}
    one = (await client.get("/models/a")).json()
    assert (one["state"], one["resident_bytes"]) == ("SUSPENDED", 200)


@scenario(models={"a": {"default_level": 2}})
async def test_api_refuses_keep_on_a_model_that_sleeps_at_level_2(
    client: httpx.AsyncClient, f: dict[str, FakeVllm]
) -> None:
    r = await client.post("/models/a/sleep", json={"keep_prefix_cache": True})
    assert r.status_code == 422, r.text
    assert "level 1" in r.json()["message"]
    assert f["a"].suspended == {}


async def test_a_split_sleep_keeps_the_kv_cache_in_its_own_suspend() -> None:
    """The overlapped swap's sleep (KV cache first, then the weights) keeps it too."""
    rig = await keep_rig()
    released: list[bool] = []
    out = await rig.m.sleep(1, kv_released=lambda: released.append(True))
    assert released == [True]
    assert sent(rig, "hotswap_suspend") == [[1, ["kv_cache"], "keep"], [1, ["weights"]]]
    assert rig.world.suspended == {"weights": "offloaded", "kv_cache": "offloaded"}
    assert out.transition is not None
    names = [p.name for p in out.transition.phases]
    assert names.index("kv") < names.index("suspend_kv_cache")
    assert rig.m.snapshot().resident_bytes == 200  # from the last suspend


async def test_a_sleeper_found_at_start_says_what_it_holds() -> None:
    """A sidecar (re)started beside a sleeping engine reads its ranks' `resident` back."""
    rig = make_rig(FakeClock())
    rig.world.asleep(1)
    await rig.manager.start()
    snap = rig.m.snapshot()
    assert (snap.state, snap.resident_bytes) == (State.SUSPENDED, 200)
    rig.world.resident_bytes = None  # an older extension: unknown, not 0
    rig2 = make_rig(FakeClock())
    rig2.world.asleep(1)
    rig2.world.resident_bytes = None
    await rig2.manager.start()
    assert rig2.m.snapshot().resident_bytes is None


async def test_what_a_sleeper_found_at_start_holds_is_kept_once_it_wakes() -> None:
    """Its leftover beside the pools stays on the device awake: the policy keeps counting it."""
    rig = make_rig(FakeClock())
    rig.world.asleep(1)
    await rig.manager.start()
    assert rig.m.record.leftover_bytes == 200
    await rig.m.wake()
    snap = rig.m.snapshot()
    assert (snap.state, snap.resident_bytes) == (State.RUNNING, None)
    assert rig.m.record.leftover_bytes == 200


async def test_a_sleeper_found_at_start_says_what_its_wake_needs_beside_its_pools() -> None:
    """The codec's staging its wake decodes through, from the ranks' hotswap_info: the
    policy adds it to the wake's need as for a sleeper of its own; gone once it woke."""
    rig = make_rig(FakeClock())
    rig.world.asleep(1)
    rig.world.wake_scratch = 64  # per rank
    await rig.manager.start()
    assert rig.m.record.holdings.wake_scratch == 128
    await rig.m.wake()
    assert rig.m.record.holdings.wake_scratch == 0


async def test_an_engine_found_at_start_counts_the_host_copy_its_ranks_keep_pinned() -> None:
    """A CUDA engine pins its backup at start: the host budget counts it before any sleep;
    a rank that keeps none (the host backend) says 0, which changes nothing."""
    rig = make_rig(FakeClock())
    rig.world.backup_held = 300  # per rank
    await rig.manager.start()
    assert rig.m.snapshot().state is State.RUNNING
    assert rig.m.record.holdings.host_bytes == 600
    rig2 = make_rig(FakeClock())
    rig2.world.asleep(1)
    await rig2.manager.start()
    assert rig2.m.record.holdings.host_bytes == 0
