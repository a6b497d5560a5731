"""The steps of one evicting wake (`controller.fleet.swap.SwapCoordinator`): the victims put
to sleep side by side, a deep target's restore ahead of its wake, and the overlapped swap
(the victim's offload beside the target's load). docs/contracts.md (SwapCoordinator, §2.2).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING, Any

from controller.errors import EngineError, TransitionConflict
from controller.fleet.overlap import Overlap
from controller.fleet.policy import Decision, WakePlan, mib
from controller.models.modelmanager import ModelManager, Outcome
from controller.models.record import ModelRecord
from controller.models.steps import KvFirst
from controller.state import State

if TYPE_CHECKING:
    from controller.fleet.swap import SwapCoordinator

log = logging.getLogger("hotswap.swap")


async def evict_side_by_side(coord: SwapCoordinator, victims: list[ModelManager]) -> list[str]:
    """Every victim of one plan put to sleep at once (their drains and copies side by side,
    not one after another); the names of those asleep, or the first error once every sleep
    has ended."""
    results = await asyncio.gather(
        *(coord.sleep(v, drain="wait", reason="evict", deep=False) for v in victims),
        return_exceptions=True,
    )
    asleep = []
    for victim, res in zip(victims, results, strict=True):
        if not isinstance(res, BaseException):
            asleep.append(victim.name)
            coord.metrics.eviction(victim.name, "lru")
    for res in results:
        if isinstance(res, BaseException):
            raise res
    return asleep


def restore_ahead(
    coord: SwapCoordinator, mm: ModelManager, plan: WakePlan[ModelManager]
) -> asyncio.Task[Any] | None:
    """An evicting wake of a deep model: its restore started now, beside its victims'
    sleeps (it needs none of their room: only what it left beside its pools before its
    checkpoint, where that fits beside what the device holds now), in a task the wake awaits
    before it begins."""
    snap, rec = mm.snapshot(), mm.record
    if plan.decision is not Decision.EVICT or not snap.deep or snap.level is None:
        return None
    back = rec.holdings.asleep_bytes // max(1, len(plan.devices))
    fields = {"model": mm.name, "phase": "policy"}
    if plan.budget_bytes is not None and plan.used_bytes + back > plan.budget_bytes:
        log.info(
            "%s: restore after its evictions: %s held + %s it brings back > %s",
            mm.name,
            mib(plan.used_bytes),
            mib(back),
            mib(plan.budget_bytes),
            extra=fields,
        )
        return None
    log.info(
        "%s: restore started with its evictions (%s back beside %s held)",
        mm.name,
        mib(back),
        mib(plan.used_bytes),
        extra=fields,
    )
    return coord.manager.tasks.spawn(_restore(mm), f"hotswap-restore-{mm.name}")


async def _restore(mm: ModelManager) -> None:
    try:
        await mm.restore_ahead()
    except TransitionConflict as exc:  # its wake began first: that wake restores it
        log.info("%s: no restore ahead: %s", mm.name, exc.message)


class OverlappedSwap:
    """Put `victim` to sleep split by pool (fused, KV first, where both earlier starts fit)
    and wake `mm` once the victim's KV cache is gone (at once, `overlap.early`): weights in
    while the victim's go out; `mm`'s KV cache mapped once the victim is SUSPENDED (or gone),
    or its KV cache gone or going (`overlap.kv_early`). The device's lock goes once the
    victim's sleep has ended and `mm` is RESUMING (counted at its footprint by every later
    plan): the rest of its wake (a deep target's restore, its verify) runs beside the next
    plans."""

    def __init__(
        self, coord: SwapCoordinator, mm: ModelManager, victim: ModelManager, overlap: Overlap
    ) -> None:
        self.coord, self.mm, self.victim, self.overlap = coord, mm, victim, overlap
        self.released = asyncio.Event()
        self.sleep: asyncio.Task[Outcome] | None = None
        # Whether the victim had released its weights as its sleep ended (None: not ended).
        self.freed: bool | None = None

    async def run(self, lock: contextlib.AsyncExitStack) -> tuple[Outcome, float, float]:
        """The wake's outcome, when it started, and how long the victim's sleep took. A
        restore ahead of the target (`restore_ahead`) ends under its wake (which waits for
        it: the model's lock)."""
        coord, mm, victim, overlap = self.coord, self.mm, self.victim, self.overlap
        t0 = coord._mono()
        rel = self.released.set
        notify = KvFirst(rel) if overlap.early and overlap.kv_early else rel
        sleep = self.sleep = coord.manager.tasks.spawn(
            coord.sleep(victim, drain="wait", reason="evict", kv_released=notify, deep=False),
            name=f"hotswap-evict-{victim.name}",
        )
        sleep.add_done_callback(self._sleep_ended)
        if not overlap.early and not await self.kv_gone():
            await sleep  # it ended before its KV cache went: its error (drain gave up, ...)
        t1 = coord._mono()
        sleep_end: list[float] = []
        sleep.add_done_callback(lambda _: sleep_end.append(coord._mono()))
        releasing = asyncio.ensure_future(self.release(lock))
        try:
            outcome = await mm.wake(room=self.room)
            if mm.snapshot().state is State.RUNNING:
                mm.record.lane.hand_over()  # verified
        finally:
            if not sleep.done():
                await asyncio.wait({sleep})
            if not releasing.done():
                releasing.cancel()
        await sleep  # the eviction's own error, if it failed after its KV cache went
        coord.metrics.eviction(victim.name, "lru")
        return outcome, t1, (sleep_end[0] if sleep_end else coord._mono()) - t0

    async def kv_gone(self) -> bool:
        """Until the victim's KV cache is off the device (True) or its sleep ended without
        that (False)."""
        assert self.sleep is not None
        signal = asyncio.ensure_future(self.released.wait())
        try:
            await asyncio.wait({self.sleep, signal}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            signal.cancel()
        return self.released.is_set()

    async def room(self) -> None:
        """The target's wait_room: until its KV cache fits (docs/contracts.md)."""
        assert self.sleep is not None
        name, victim, rec = self.mm.name, self.victim.name, self.victim.record
        if self.overlap.early and not await self.kv_gone():
            raise EngineError(
                f"{victim}, evicted for {name}, ended its sleep before its KV cache was "
                f"released: the KV cache of {name} is not mapped",
                model=name,
                phase="wait_room",
            )
        if self.overlap.kv_early:
            return  # the victim's KV cache is gone: this one fits beside its weights
        await asyncio.wait({self.sleep})
        if self.freed:
            return  # its room is this wake's, even if its own wake has begun since
        # A reconciliation after a failed step may yet find it asleep; woken again, never.
        ended = await rec.wait_for(
            lambda r: self._room_freed(r) or r.state in (State.RESUMING, State.RUNNING),
            self.coord.settings.timeouts.rpc_s,
        )
        if not ended or not self._room_freed(rec):
            raise EngineError(
                f"{victim}, evicted for {name}, did not release its weights (state "
                f"{rec.state.value}): the KV cache of {name} is not mapped",
                model=name,
                phase="wait_room",
            )

    def _room_freed(self, rec: ModelRecord) -> bool:
        """SUSPENDED with its weights among the pools asleep (a reconciliation after a
        failed step may find only the KV cache asleep), or its process gone."""
        return self.coord.engine_gone(rec) or (
            rec.state is State.SUSPENDED
            and (rec.facts.asleep is None or "weights" in rec.facts.asleep)
        )

    def _sleep_ended(self, _: asyncio.Task[Outcome]) -> None:
        """The victim's state as its sleep ends, taken before the device's lock goes (no
        plan has woken it since): its room is the target's from then on (docs/contracts.md,
        wait_room)."""
        self.freed = self._room_freed(self.victim.record)

    async def release(self, lock: contextlib.AsyncExitStack) -> None:
        """The lock goes once the victim's sleep has ended (its error known) and the target
        is counted at its footprint (RESUMING, or its wake over)."""
        assert self.sleep is not None
        await asyncio.wait({self.sleep})
        await self.mm.record.wait_for(
            lambda r: r.state is not State.SUSPENDED or r.in_flight_task() is None,
            self.coord.settings.timeouts.rpc_s,
        )
        await lock.aclose()
