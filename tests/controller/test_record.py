"""The per-model record's awaitable changes (controller.models.record): waiters are told, not
polling, and a cancelled waiter always ends."""

from __future__ import annotations

import asyncio

import pytest

from controller.config.modelsettings import ModelSettings
from controller.models.record import Changes, Fleet
from controller.state import State


def run(coro: object) -> None:
    asyncio.run(asyncio.wait_for(coro, 5))  # type: ignore[arg-type]


def test_wait_for_returns_when_a_change_makes_the_predicate_true() -> None:
    async def main() -> None:
        changes = Changes()
        box = {"n": 0}
        waiter = asyncio.create_task(changes.wait_for(lambda: box["n"] >= 2, 5.0))
        for _ in range(2):
            await asyncio.sleep(0)
            assert not waiter.done()
            box["n"] += 1
            changes.notify()
        assert await waiter is True

    run(main())


def test_wait_for_gives_up_after_its_timeout() -> None:
    async def main() -> None:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        assert await Changes().wait_for(lambda: False, 0.05) is False
        assert loop.time() - t0 >= 0.05

    run(main())


def test_a_waiter_cancelled_as_a_change_arrives_ends_cancelled() -> None:
    """On 3.11 asyncio.wait_for returns the inner result when both happen in one tick; the
    waiter then went on waiting and a supervisor's stop hung."""

    async def main() -> None:
        changes = Changes()
        waiter = asyncio.create_task(changes.wait_for(lambda: False, 3.0))
        await asyncio.sleep(0)
        changes.notify()
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(waiter, 1.0)

    run(main())


def test_a_record_change_reaches_the_fleet_waiters() -> None:
    async def main() -> None:
        fleet = Fleet([ModelSettings(name="a", url="http://a:1")])  # type: ignore[call-arg]
        rec = fleet["a"]
        waiter = asyncio.create_task(fleet.wait_for(lambda: rec.lane.closed, 5.0))
        await asyncio.sleep(0)
        assert rec.state is State.UNKNOWN
        rec.lane.close()
        assert await waiter is True

    run(main())
