"""The overlapped swap: the evicted model's KV cache goes first, the woken model's weights
come in while the evicted model's weights go out, and its KV cache only once they are gone.

Two fake engines behind one transport that logs when each RPC starts and ends (with the
pools it names); the evicted model's weights offload is made slow, so an overlap shows.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import Any

import httpx
import pytest
from policyviews import v
from support.gatewayworld import Engine, Router, World, ask, run, world

from controller.fleet.overlap import Overlap, plan_overlap
from controller.fleet.policy import Decision, WakePlan
from controller.state import State

SLOW_OFFLOAD_S = 0.3


class Logged(Router):
    """Every engine call logged as (seconds, engine, call, "start" | "end"); a chosen call
    made slow or answered by a failing rank."""

    def __init__(self, engines: dict[str, Engine]) -> None:
        super().__init__(engines)
        self.log: list[tuple[float, str, str, str]] = []
        self.slow: dict[tuple[str, str], float] = {}
        self.fail: set[tuple[str, str]] = set()

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host.split(".")[0]
        call = request.url.path
        if call == "/collective_rpc":
            body = json.loads(request.content)
            args = body.get("args") or []
            tags = next((a for a in args if isinstance(a, list)), None)
            call = body["method"] + (f"[{','.join(tags)}]" if tags else "")
        self.log.append((time.monotonic(), host, call, "start"))
        try:
            if (host, call) in self.slow:
                await asyncio.sleep(self.slow[(host, call)])
            if (host, call) in self.fail:
                result = {"ok": False, "rank": 0, "elapsed_s": 0.0, "error": "fake: no"}
                return httpx.Response(200, json={"results": [result]})
            return await super().handle_async_request(request)
        finally:
            self.log.append((time.monotonic(), host, call, "end"))

    def at(self, host: str, call: str, edge: str) -> float:
        times = [t for t, h, c, e in self.log if (h, c, e) == (host, call, edge)]
        assert times, f"{host} {call} {edge} never happened: {self.calls(host)}"
        return times[-1]

    def calls(self, host: str) -> list[str]:
        return [c for _, h, c, e in self.log if h == host and e == "start"]


def logged_world(**overrides: Any) -> Any:
    holder: dict[str, Logged] = {}

    def transport(engines: dict[str, Engine]) -> Logged:
        holder["router"] = Logged(engines)
        return holder["router"]

    return world(router=transport, **overrides), holder


def phases(w: World, name: str) -> list[str]:
    tr = w.manager.get(name).snapshot().last_transition
    assert tr is not None
    return [p.name for p in tr.phases]


def test_the_woken_models_weights_come_in_while_the_evicted_models_go_out() -> None:
    async def body() -> None:
        ctx, holder = logged_world(swap={"budget_bytes": 10_000, "overlap": "always"})
        async with ctx as w:
            log = holder["router"]
            log.slow[("a", "hotswap_suspend[weights]")] = SLOW_OFFLOAD_S
            log.log.clear()
            r = await ask(w, "b")
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "b"
            assert w.state("a") is State.SUSPENDED
            assert w.state("b") is State.RUNNING
            kv_gone = log.at("a", "hotswap_suspend[kv_cache]", "end")
            a_weights_gone = log.at("a", "hotswap_suspend[weights]", "end")
            b_weights = log.at("b", "hotswap_resume[weights]", "start")
            b_kv = log.at("b", "hotswap_wake", "start")  # the KV cache's resume + the verify
            assert kv_gone < b_weights < a_weights_gone  # the overlap
            assert a_weights_gone < b_kv  # never both KV caches and weights at once
            assert phases(w, "a") == [
                "drain",
                "quiesce",
                "prepare",
                "suspend_kv_cache",
                "kv_released",
                "suspend_weights",
            ]
            assert phases(w, "b")[:3] == ["resume_weights", "wait_room", "resume_and_verify"]
            assert w.engines["a"].wrong == []
            assert w.engines["b"].wrong == []
            assert w.sample("hotswap_evictions_total", model="a", reason="lru") == 1
            # the next swap back overlaps too (both models' pools are known by now)
            log.slow = {("b", "hotswap_suspend[weights]"): SLOW_OFFLOAD_S}
            r = await ask(w, "a")
            assert r.status_code == 200
            assert r.json()["model"] == "a"
            assert log.at("a", "hotswap_resume[weights]", "start") < log.at(
                "b", "hotswap_suspend[weights]", "end"
            )

    run(body)


def test_without_room_for_both_weights_the_swap_runs_one_after_the_other() -> None:
    async def body() -> None:
        # one model awake holds 6144 bytes; both models' weights at once would be 8192
        ctx, holder = logged_world(swap={"budget_bytes": 7_000, "overlap": "always"})
        async with ctx as w:
            log = holder["router"]
            log.log.clear()
            r = await ask(w, "b")
            assert r.status_code == 200, r.text
            # the unsplit sleep is one hotswap_sleep (fused_sleep, the default)
            assert log.at("a", "hotswap_sleep", "end") < log.at("b", "hotswap_wake", "start")
            assert "hotswap_resume[weights]" not in log.calls("b")  # one RPC: not split
            assert "prepare_and_suspend" in phases(w, "a")  # not split: fused
            assert "wait_room" not in phases(w, "b")

    run(body)


def test_without_a_byte_budget_the_swap_runs_one_after_the_other() -> None:
    async def body() -> None:
        # max_awake only: nothing to check the peak against
        ctx, holder = logged_world(swap={"overlap": "always"})
        async with ctx as w:
            log = holder["router"]
            log.log.clear()
            r = await ask(w, "b")
            assert r.status_code == 200, r.text
            assert "hotswap_suspend[kv_cache]" not in log.calls("a")

    run(body)


def test_auto_overlaps_only_when_the_evicted_models_sleep_copied_its_weights() -> None:
    """The default: a split sleep only pays off when the victim's weights are copied off
    the device (CUDA, level 1); a victim never seen asleep, or whose sleep copied nothing
    (the host backend, level 2), is put to sleep as before."""

    async def body() -> None:
        ctx, holder = logged_world(swap={"budget_bytes": 10_000})
        async with ctx as w:
            log = holder["router"]
            assert w.manager.fleet["a"].holdings.copied_bytes is None  # never slept
            assert (
                w.manager.fleet["b"].holdings.copied_bytes == 4096
            )  # slept once, weights offloaded
            log.log.clear()
            assert (await ask(w, "b")).status_code == 200
            assert "hotswap_suspend[kv_cache]" not in log.calls("a")  # a: not seen to copy
            assert (await ask(w, "a")).status_code == 200
            assert "hotswap_suspend[kv_cache]" in log.calls("b")  # b's sleep copied 4096
            w.manager.fleet["a"].holdings.slept(0, 0)  # as the host backend's sleep reports
            log.log.clear()
            assert (await ask(w, "b")).status_code == 200
            assert "hotswap_suspend[kv_cache]" not in log.calls("a")
            assert w.state("b") is State.RUNNING

    run(body)


def test_never_puts_the_evicted_model_to_sleep_first() -> None:
    async def body() -> None:
        ctx, holder = logged_world(swap={"budget_bytes": 10_000, "overlap": "never"})
        async with ctx as w:
            log = holder["router"]
            for name in ("b", "a", "b"):
                assert (await ask(w, name)).status_code == 200
            assert not [
                c for c in log.calls("a") + log.calls("b") if "[kv_cache]" in c and "suspend" in c
            ]

    run(body)


def test_an_eviction_that_fails_after_its_kv_cache_never_maps_the_woken_models_kv() -> None:
    async def body() -> None:
        ctx, holder = logged_world(swap={"budget_bytes": 10_000, "overlap": "always"}, rpc_s=0.5)
        async with ctx as w:
            log = holder["router"]
            log.fail.add(("a", "hotswap_suspend[weights]"))
            log.log.clear()
            r = await ask(w, "b")
            assert r.status_code == 503, r.text
            # a's ranks say only its KV cache is asleep: read back, a is SUSPENDED with its
            # weights still on the device, so b's KV cache must not come in
            assert w.state("a") is State.SUSPENDED
            assert w.manager.fleet["a"].facts.asleep == ("kv_cache",)
            # b's wake failed in wait_room; read back, b holds its weights, not its KV cache
            assert w.state("b") is not State.RUNNING
            assert w.manager.fleet["b"].facts.asleep == ("kv_cache",)
            assert "hotswap_resume[weights]" in log.calls("b")
            assert "hotswap_wake" not in log.calls("b")
            err = w.manager.get("b").snapshot().last_error or ""
            assert "did not release its weights" in err

    run(body)


@pytest.mark.parametrize(
    ("used", "budget", "victim", "target", "counted", "ok"),
    [
        (6144, 10_000, {"weights": 4096, "kv_cache": 2048}, {"weights": 4096}, 6144, True),
        (6144, 8_192, {"weights": 4096, "kv_cache": 2048}, {"weights": 4096}, 6144, True),
        (6144, 8_191, {"weights": 4096, "kv_cache": 2048}, {"weights": 4096}, 6144, False),
        # a third model holds 2000 bytes beside them: counted at the peak
        (8144, 10_000, {"weights": 4096, "kv_cache": 2048}, {"weights": 4096}, 6144, False),
        (8144, 10_192, {"weights": 4096, "kv_cache": 2048}, {"weights": 4096}, 6144, True),
        (6144, None, {"weights": 4096}, {"weights": 4096}, 6144, False),  # no byte budget
        (6144, 10_000, {}, {"weights": 4096}, 6144, False),  # victim's pools unknown
        (6144, 10_000, {"weights": 4096}, {}, 6144, False),  # target's pools unknown
    ],
)
def test_plan_overlap(
    used: int,
    budget: int | None,
    victim: dict[str, int],
    target: dict[str, int],
    counted: int,
    ok: bool,
) -> None:
    plan = WakePlan("b", Decision.EVICT, "", (v("a"),), 6144, used, budget, devices=("0",))
    got = plan_overlap(plan, victim, target, counted)
    assert isinstance(got, Overlap)
    assert got.ok is ok, got.reason


def test_plan_overlap_only_for_one_eviction_on_one_device() -> None:
    pools = {"weights": 10}
    two = WakePlan("c", Decision.EVICT, "", (v("a"), v("b")), 10, 20, 1000, devices=("0",))
    assert not plan_overlap(two, pools, pools, 10).ok
    tp = WakePlan("c", Decision.EVICT, "", (v("a"),), 10, 20, 1000, devices=("0", "1"))
    assert not plan_overlap(tp, pools, pools, 10).ok
    fits = WakePlan("c", Decision.WAKE, "", (), 10, 0, 1000, devices=("0",))
    assert not plan_overlap(fits, pools, pools, 10).ok


def test_plan_overlap_counts_the_wake_scratch_at_the_peak() -> None:
    pools = {"weights": 4096}
    for scratch, ok in ((0, True), (1, False)):
        plan = WakePlan(
            "b",
            Decision.EVICT,
            "",
            (v("a"),),
            6144,
            6144,
            8_192,
            devices=("0",),
            scratch_bytes=scratch,
        )
        got = plan_overlap(plan, pools, pools, 6144)
        assert got.ok is ok, got.reason
        assert ("scratch" in got.reason) is bool(scratch)


def test_plan_overlap_counts_the_victims_encode_scratch_too() -> None:
    pools = {"weights": 4096}
    plan = WakePlan("b", Decision.EVICT, "", (v("a"),), 6144, 6144, 8_200, devices=("0",))
    plan = dataclasses.replace(plan, scratch_bytes=4)
    assert plan_overlap(plan, pools, pools, 6144, victim_scratch=4).ok  # 8192 + 8 <= 8200
    late = plan_overlap(plan, pools, pools, 6144, victim_scratch=5)
    assert not late.ok
    assert late.peak_bytes == 8_201


@pytest.mark.parametrize(
    ("used", "budget", "victim", "counted", "early", "kv_early"),
    [
        # two 4096-byte weights + 2048-byte KV models: both earlier starts need 10,240
        (6144, 10_240, {"weights": 4096, "kv_cache": 2048}, 6144, True, True),
        (6144, 10_239, {"weights": 4096, "kv_cache": 2048}, 6144, False, False),
        # a victim with a big KV cache: the target whole fits beside its weights first
        (12_288, 16_384, {"weights": 4096, "kv_cache": 8192}, 12_288, True, True),
        (12_288, 16_383, {"weights": 4096, "kv_cache": 8192}, 12_288, False, True),
    ],
)
def test_plan_overlap_says_where_the_earlier_starts_fit(
    used: int, budget: int, victim: dict[str, int], counted: int, early: bool, kv_early: bool
) -> None:
    """early: the other models' bytes + the victim whole + the target's weights; kv_early:
    the others + the victim's weights + the target whole (docs/contracts.md)."""
    plan = WakePlan("b", Decision.EVICT, "", (v("a"),), 6144, used, budget, devices=("0",))
    got = plan_overlap(plan, victim, {"weights": 4096}, counted)
    assert got.ok, got.reason
    assert (got.early, got.kv_early) == (early, kv_early), got.reason
    assert got.peak_bytes is not None
    assert got.peak_bytes <= budget


def test_with_room_for_both_the_victim_sleeps_fused_and_the_woken_kv_starts_with_it() -> None:
    """Both earlier starts fit (12,000 >= 10,240): b's weights come in while a still
    drains, a's sleep stays one fused hotswap_sleep (its KV cache released first inside it)
    and b maps its KV cache as that sleep starts (a `kv_first` step just before it), not
    after a separate prepare and KV suspend (b's creates wait for the memory at the driver)."""

    async def body() -> None:
        ctx, holder = logged_world(swap={"budget_bytes": 12_000, "overlap": "always"})
        async with ctx as w:
            log = holder["router"]
            log.slow[("a", "hotswap_sleep")] = SLOW_OFFLOAD_S
            log.log.clear()
            r = await ask(w, "b")
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "b"
            assert await w.manager.fleet["a"].wait_for(lambda r: r.state is State.SUSPENDED, 5.0)
            assert (w.state("a"), w.state("b")) == (State.SUSPENDED, State.RUNNING)
            assert [c for c in log.calls("a") if c.startswith("hotswap_")] == [
                "hotswap_quiesce",
                "hotswap_sleep",
            ]
            assert phases(w, "a")[-3:] == ["quiesce", "kv_first", "prepare_and_suspend"]
            b_weights = log.at("b", "hotswap_resume[weights]", "start")
            b_kv = log.at("b", "hotswap_wake", "start")
            assert b_weights < log.at("a", "hotswap_quiesce", "end")  # early
            assert (
                log.at("a", "hotswap_quiesce", "end") <= b_kv < log.at("a", "hotswap_sleep", "end")
            )
            assert phases(w, "b")[:3] == ["resume_weights", "wait_room", "resume_and_verify"]
            assert w.engines["a"].wrong == []
            assert w.engines["b"].wrong == []

    run(body)


def test_with_room_for_both_a_victim_that_does_not_fuse_its_sleep_splits_it() -> None:
    """Both earlier starts fit, but a sleeps with two RPCs (`fused_sleep: false`): split by
    pool as before, b's KV cache mapped once a's is gone, while a's weights still go out."""

    async def body() -> None:
        ctx, holder = logged_world(
            swap={"budget_bytes": 12_000, "overlap": "always"},
            per_model={"a": {"fused_sleep": False}},
        )
        async with ctx as w:
            log = holder["router"]
            log.slow[("a", "hotswap_prepare")] = SLOW_OFFLOAD_S
            log.slow[("a", "hotswap_suspend[weights]")] = SLOW_OFFLOAD_S
            log.log.clear()
            r = await ask(w, "b")
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "b"
            # b answers while a's weights may still leave: a's sleep ends after
            assert await w.manager.fleet["a"].wait_for(lambda r: r.state is State.SUSPENDED, 5.0)
            assert (w.state("a"), w.state("b")) == (State.SUSPENDED, State.RUNNING)
            b_weights = log.at("b", "hotswap_resume[weights]", "start")
            b_kv = log.at("b", "hotswap_wake", "start")
            assert b_weights < log.at("a", "hotswap_prepare", "end")  # early
            assert log.at("a", "hotswap_suspend[kv_cache]", "end") < b_kv  # a's KV gone first
            assert b_kv < log.at("a", "hotswap_suspend[weights]", "end")  # kv_early
            assert phases(w, "b")[:3] == ["resume_weights", "wait_room", "resume_and_verify"]
            assert w.engines["a"].wrong == []
            assert w.engines["b"].wrong == []

    run(body)


def test_an_early_wake_whose_victim_fails_before_its_kv_release_maps_no_kv_cache() -> None:
    """(A victim that sleeps split by pool: a fused one's KV release is inside its one RPC,
    where the woken model's creates wait for the memory at the driver instead.)"""

    async def body() -> None:
        ctx, holder = logged_world(
            swap={"budget_bytes": 12_000, "overlap": "always"},
            per_model={"a": {"fused_sleep": False}},
        )
        async with ctx as w:
            log = holder["router"]
            log.fail.add(("a", "hotswap_prepare"))
            log.log.clear()
            r = await ask(w, "b")
            assert r.status_code == 503, r.text
            assert "hotswap_suspend[kv_cache]" not in log.calls("a")  # nothing released
            # b came in early with its weights only: read back, its KV cache still asleep
            assert w.state("b") is not State.RUNNING
            assert w.manager.fleet["b"].facts.asleep == ("kv_cache",)
            assert "hotswap_resume[weights]" in log.calls("b")
            assert "hotswap_wake" not in log.calls("b")
            err = w.manager.get("b").snapshot().last_error or ""
            assert "before its KV cache was released" in err

    run(body)


def test_no_early_start_while_the_victim_still_serves() -> None:
    """The victim has a gateway request in flight, so its drain may give up and leave it
    RUNNING: the woken model does not start early (its weights would come in for nothing
    and its wake fail in wait_room). The drain's own timeout answers, and b is untouched."""

    async def body() -> None:
        swap = {"budget_bytes": 12_000, "overlap": "always", "evict_drain_timeout_s": 0.2}
        ctx, holder = logged_world(swap=swap)
        async with ctx as w:
            log = holder["router"]
            w.manager.fleet["a"].lane.enter()  # a request a is still answering
            log.log.clear()
            r = await ask(w, "b")
            assert r.status_code == 503, (
                r.text
            )  # the gateway's wake_failed, with the drain's reason
            assert "still in flight" in r.text
            assert "hotswap_resume[weights]" not in log.calls("b")
            assert (w.state("a"), w.state("b")) == (State.RUNNING, State.SUSPENDED)
            w.manager.fleet["a"].lane.leave()

    run(body)


def test_the_woken_model_serves_while_the_victims_weights_still_leave() -> None:
    """b's held request goes to b as soon as b is RUNNING and verified, not once a's
    weights have left too (the swap's request waited for the victim's whole sleep)."""

    async def body() -> None:
        ctx, holder = logged_world(swap={"budget_bytes": 12_000, "overlap": "always"})
        async with ctx as w:
            log = holder["router"]
            log.slow[("a", "hotswap_sleep")] = 1.0  # fused: its weights leave inside it
            log.log.clear()
            r = await ask(w, "b")
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "b"
            answered = time.monotonic()
            assert ("a", "hotswap_sleep") not in [(h, c) for _, h, c, e in log.log if e == "end"]
            slept = await w.manager.fleet["a"].wait_for(lambda r: r.state is State.SUSPENDED, 5.0)
            assert slept
            assert answered < log.at("a", "hotswap_sleep", "end")
            assert log.at("b", "hotswap_wake", "start") < answered
            assert (w.state("a"), w.state("b")) == (State.SUSPENDED, State.RUNNING)
            assert w.engines["b"].wrong == []

    run(body)


def test_the_next_wake_is_planned_while_the_woken_models_verify_runs() -> None:
    """Once the victim is asleep and the woken model RESUMING (every plan counts it at its
    footprint), the device's lock goes: a small model that fits beside them wakes while the
    swap's own wake (here its verify) still runs."""

    async def body() -> None:
        swap = {"budget_bytes": 12_000, "overlap": "always", "max_awake": None}
        small = {"pool_bytes": {"weights": 512, "kv_cache": 256}}
        ctx, holder = logged_world(names=("a", "b", "c"), swap=swap, fakes={"c": small})
        async with ctx as w:
            log = holder["router"]
            log.slow[("b", "hotswap_wake")] = 1.5  # the verify of the swap's woken model
            log.log.clear()
            swap_b = asyncio.ensure_future(ask(w, "b"))
            asleep = await w.manager.fleet["a"].wait_for(lambda r: r.state is State.SUSPENDED, 5)
            assert asleep
            r = await ask(w, "c")
            assert r.status_code == 200, r.text
            c_answered = time.monotonic()
            assert w.state("b") is State.RESUMING  # still in its verify
            assert (await swap_b).status_code == 200
            assert c_answered < log.at("b", "hotswap_wake", "end")
            assert (w.state("a"), w.state("b"), w.state("c")) == (
                State.SUSPENDED,
                State.RUNNING,
                State.RUNNING,
            )

    run(body)


def test_the_victims_of_one_plan_sleep_side_by_side() -> None:
    """c's wake needs both a and b asleep: their sleeps (drains and copies) run at once, not
    one after the other."""

    async def body() -> None:
        swap = {"budget_bytes": 20_000, "max_awake": None}
        big = {"pool_bytes": {"weights": 10240, "kv_cache": 4096}}
        ctx, holder = logged_world(names=("a", "b", "c"), swap=swap, fakes={"c": big})
        async with ctx as w:
            log = holder["router"]
            await w.coordinator.sleep(w.manager.get("a"))  # its footprint measured
            for n in "ab":  # a and b awake
                res = await w.coordinator.wake(w.manager.get(n))
                assert res.plan is not None
                assert res.plan.decision is Decision.WAKE, res.plan.reason
            for n in "ab":
                log.slow[(n, "hotswap_sleep")] = SLOW_OFFLOAD_S
            log.log.clear()
            r = await ask(w, "c")
            assert r.status_code == 200, r.text
            assert [w.state(n) for n in "abc"] == [State.SUSPENDED, State.SUSPENDED, State.RUNNING]
            assert log.at("a", "hotswap_sleep", "start") < log.at("b", "hotswap_sleep", "end")
            assert log.at("b", "hotswap_sleep", "start") < log.at("a", "hotswap_sleep", "end")
            assert w.sample("hotswap_evictions_total", model="a", reason="lru") == 1
            assert w.sample("hotswap_evictions_total", model="b", reason="lru") == 1

    run(body)


def test_a_victim_woken_again_by_its_own_plan_does_not_stall_the_wake_it_made_room_for() -> None:
    """a is evicted for b (overlapped, b's KV cache waits for a's weights to leave) while a
    request for a arrives: a's own wake is planned as soon as the device's lock goes (a
    asleep, b RESUMING and counted whole), evicts c and wakes a. b's wait_room, counting on
    a's weights, starts after that (its weights come in slowly): a released them when its
    sleep ended, so b maps its KV cache at once (the H200 density run: m04 waited the whole
    RPC timeout for m08, woken again by its own plan, and every plan of the device with it)."""

    async def body() -> None:
        swap = {"budget_bytes": 15_500, "overlap": "always", "max_awake": None}
        ctx, holder = logged_world(names=("a", "b", "c"), swap=swap, rpc_s=3.0)
        async with ctx as w:
            log = holder["router"]
            assert (await ask(w, "a")).status_code == 200
            res = await w.coordinator.wake(w.manager.get("c"))
            assert res.plan is not None
            assert res.plan.decision is Decision.WAKE, res.plan.reason
            # c asked as often as a but later: b's plan evicts a; a's own plan, with its
            # held request counted, evicts c (asked less than a by then)
            assert (await ask(w, "c")).status_code == 200
            log.slow[("a", "hotswap_suspend[weights]")] = SLOW_OFFLOAD_S
            log.slow[("b", "hotswap_resume[weights]")] = 1.0
            t0 = time.monotonic()
            to_b = asyncio.ensure_future(ask(w, "b"))
            going = await w.manager.fleet["a"].wait_for(lambda r: r.state is State.SUSPENDING, 5.0)
            assert going
            to_a = asyncio.ensure_future(ask(w, "a"))  # held for a: its wake waits its turn
            rb, ra = await to_b, await to_a
            assert (rb.status_code, ra.status_code) == (200, 200), (rb.text, ra.text)
            assert (rb.json()["model"], ra.json()["model"]) == ("b", "a")
            assert time.monotonic() - t0 < 2.5  # not the RPC timeout
            assert phases(w, "b")[:3] == ["resume_weights", "wait_room", "resume_and_verify"]
            # b's KV cache came in after a's weights left, though a was awake again by then
            assert log.at("a", "hotswap_suspend[weights]", "end") < log.at(
                "b", "hotswap_wake", "start"
            )
            assert log.at("a", "hotswap_wake", "start") < log.at("b", "hotswap_wake", "start")
            assert [w.state(n) for n in "abc"] == [State.RUNNING, State.RUNNING, State.SUSPENDED]
            for n in "abc":
                assert w.engines[n].wrong == []

    run(body)


def test_the_most_asked_model_is_not_evicted_while_a_less_asked_one_still_wakes() -> None:
    """b (asked often) is the only model awake when a's wake is planned; c, asked less, is
    still RESUMING. a's plan waits for c's wake and evicts c, not b (the H200 density run: a
    1B model evicted m00, the most used model, while two 8B models were mid-wake)."""

    async def body() -> None:
        swap = {"budget_bytes": 13_000, "max_awake": None}
        ctx, holder = logged_world(names=("b", "a", "c"), swap=swap)
        async with ctx as w:
            log = holder["router"]
            for _ in range(3):
                assert (await ask(w, "b")).status_code == 200
            log.slow[("c", "hotswap_wake")] = 0.8  # c's verify
            waking_c = asyncio.ensure_future(w.coordinator.wake(w.manager.get("c")))
            up = await w.manager.fleet["c"].wait_for(lambda r: r.state is State.RESUMING, 5.0)
            assert up
            log.log.clear()
            r = await ask(w, "a")
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "a"
            res = await waking_c
            assert res.plan is not None
            assert res.plan.decision is Decision.WAKE, res.plan.reason
            assert [w.state(n) for n in "bac"] == [State.RUNNING, State.RUNNING, State.SUSPENDED]
            assert not [c for c in log.calls("b") if "sleep" in c or "suspend" in c]
            assert w.sample("hotswap_evictions_total", model="c", reason="lru") == 1
            assert w.sample("hotswap_evictions_total", model="b", reason="lru") == 0

    run(body)
