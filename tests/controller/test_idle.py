"""Idle sleep over fake engines: a model that served nothing for `idle_sleep_s` sleeps by
itself (reason `idle` in the metrics), the gateway's next request wakes it; never a pinned
model, never with a request in flight; and the sleeper waits on the record's changes and one
timer, it does not poll."""

from __future__ import annotations

import asyncio

from support.gatewayworld import ask, run, world
from support.wait import until

from controller.state import State

IDLE = {"idle_sleep_s": 0.3, "max_awake": 2}


def test_an_idle_model_sleeps_by_itself_and_the_next_request_wakes_it() -> None:
    async def body() -> None:
        async with world(swap=IDLE) as w:
            rec = w.manager.fleet["a"]
            assert w.state("a") is State.RUNNING
            awake_since = rec.snapshot.since
            await until(lambda: w.state("a") is State.SUSPENDED, w.manager.fleet.changes)
            # Not before its time: decided at least idle_sleep_s after it was last awake-idle
            # (read from the record, not from when this test began to look: a busy machine).
            slept_at = rec.swapping.idle_slept_at
            assert slept_at is not None
            assert slept_at - awake_since >= IDLE["idle_sleep_s"]
            # The sleep is counted once its sequence returns, a moment after the state.
            await until(lambda: w.sample("hotswap_sleeps_total", model="a", reason="idle") == 1)
            r = await ask(w, "a")  # the gateway wakes it
            assert r.status_code == 200, r.text
            assert w.state("a") is State.RUNNING
            await until(
                lambda: w.state("a") is State.SUSPENDED, w.manager.fleet.changes
            )  # and idles out again
            await until(lambda: w.sample("hotswap_sleeps_total", model="a", reason="idle") == 2)
            assert w.sample("hotswap_sleeps_total", model="b", reason="idle") == 0  # asleep

    run(body)


def test_a_pinned_model_never_idles_out() -> None:
    async def body() -> None:
        async with world(swap=IDLE, per_model={"a": {"pinned": True}}) as w:
            await asyncio.sleep(0.8)
            assert w.state("a") is State.RUNNING
            assert w.sample("hotswap_sleeps_total", model="a", reason="idle") == 0

    run(body)


def test_a_model_with_a_request_in_flight_never_idles_out() -> None:
    async def body() -> None:
        async with world(swap=IDLE) as w:
            eng = w.engines["a"]
            eng.hold = asyncio.Event()
            req = asyncio.create_task(ask(w, "a"))
            await asyncio.wait_for(eng.arrived.wait(), 5)
            await asyncio.sleep(0.8)  # well past idle_sleep_s, the request still running
            assert w.state("a") is State.RUNNING
            eng.hold.set()
            assert (await req).status_code == 200
            await until(
                lambda: w.state("a") is State.SUSPENDED, w.manager.fleet.changes
            )  # idle from its end on
            await until(lambda: w.sample("hotswap_sleeps_total", model="a", reason="idle") == 1)

    run(body)


def test_per_model_zero_turns_it_off() -> None:
    async def body() -> None:
        async with world(swap=IDLE, per_model={"a": {"idle_sleep_s": 0}}) as w:
            await asyncio.sleep(0.8)
            assert w.state("a") is State.RUNNING

    run(body)
