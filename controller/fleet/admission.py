"""Wake-on-request admission: a /v1 request for a model is counted in flight once the model
is RUNNING, or held in a bounded per-model queue while the swap coordinator wakes it.

429 when the queue is full, 503 with Retry-After when the wake fails or does not finish in
time, 499 when the client leaves while held (its slot is given back at once and no wake
is started for it). A finished wake hands the held requests their tickets before any
eviction can plan (`Lane.hand_over`); a held request otherwise waits on its ticket, the
wake, the model's record and the client at once: nothing polls. The gateway
(`controller.http.gateway`) forwards what is admitted and lets the lane go when the answer ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from starlette.types import Receive

from controller.config.servesettings import GatewaySettings
from controller.errors import HotswapError, Refusal, WakeRefused
from controller.fleet.swap import SwapCoordinator, SwapResult
from controller.models.manager import Manager
from controller.models.modelmanager import ModelManager
from controller.models.record import ModelRecord
from controller.observe.swapmetrics import SwapMetrics
from controller.state import State


class Admission:
    """Admission and holding of the gateway's requests, over the fleet's lanes."""

    def __init__(
        self,
        cfg: GatewaySettings,
        manager: Manager,
        coordinator: SwapCoordinator,
        metrics: SwapMetrics,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.cfg = cfg
        self.tasks = manager.tasks
        self.coordinator = coordinator
        self.fleet = manager.fleet
        self.life = manager.life
        self.metrics = metrics
        self._mono = monotonic

    async def aclose(self) -> None:
        """Cancel the wakes started for held requests."""
        await self.tasks.cancel(*(r.lane.gateway_wake for r in self.fleet.values()))

    @staticmethod
    def _admissible(rec: ModelRecord) -> bool:
        return rec.snapshot.ready and not rec.lane.closed  # RUNNING and verified only

    def _set_held(self, rec: ModelRecord, delta: int) -> None:
        self.metrics.queue_depth(rec.name, rec.lane.hold(delta))

    async def admit(self, mm: ModelManager, receive: Receive | None = None) -> float:
        """Count the request in flight once its model is RUNNING; returns seconds held.

        `receive` (the request's): a client that disconnects while held gives its queue slot
        back at once and starts no wake (Refusal 499, counted as `client_gone`)."""
        self._refuse_unless_serving()
        rec = mm.record
        rec.lane.touch()  # the most recently used now
        if self._admissible(rec):
            rec.lane.enter()
            return 0.0
        gone = asyncio.ensure_future(_disconnected(receive)) if receive is not None else None
        try:
            return await self._queue(mm, gone)
        finally:
            if gone is not None:
                gone.cancel()

    def _refuse_unless_serving(self) -> None:
        """Starting (the start-up reconciliation) or stopping (a SIGTERM): 503 with
        Retry-After, at once, to a new request and to a held one alike."""
        why = self.life.reason()
        if why is not None:
            reason = "shutting_down" if self.life.stopping else "starting"
            raise Refusal(503, reason, why, retry_after_s=self.cfg.retry_after_s)

    async def _queue(self, mm: ModelManager, gone: asyncio.Future[None] | None) -> float:
        rec = mm.record
        name, lane = rec.name, rec.lane
        if lane.held >= self.cfg.queue_size:
            raise Refusal(
                429,
                "queue_full",
                f"{self.cfg.queue_size} requests already wait for {name} to wake",
                retry_after_s=self.cfg.retry_after_s,
            )
        self._set_held(rec, +1)
        t0 = self._mono()
        ticket = lane.ticket()
        try:
            await self._hold(mm, ticket, t0 + self.cfg.hold_timeout_s, gone)
        except BaseException:
            if lane.forget(ticket):
                lane.leave()  # admitted just as it gave up: uncount it
            raise
        finally:
            self._set_held(rec, -1)
        if not lane.forget(ticket):
            lane.enter()  # admitted by its own look at the state, not handed over
        held = self._mono() - t0
        self.metrics.hold(name, held)
        return held

    async def _hold(
        self,
        mm: ModelManager,
        ticket: asyncio.Future[None],
        deadline: float,
        gone: asyncio.Future[None] | None = None,
    ) -> None:
        """Return when admitted; Refusal (503) when the model's wake fails or is late, 499
        as soon as the client has disconnected (before any wake is started for it). Waits
        on the ticket, the wake, the record's changes and the client: nothing polls."""
        name, rec = mm.name, mm.record
        seen: set[asyncio.Task[SwapResult]] = set()  # wakes that ran while this one waited
        if gone is not None:
            await asyncio.sleep(0)  # a client already gone says so at its first receive
        while not ticket.done() and not self._admissible(rec):
            self._refuse_unless_serving()
            if gone is not None and gone.done():
                raise Refusal(499, "client_gone", f"the client left while {name} was woken")
            now = self._mono()
            if now >= deadline:
                raise Refusal(
                    503,
                    "wake_timeout",
                    f"{name} did not become RUNNING within {self.cfg.hold_timeout_s:g} s "
                    f"(state {rec.state.value})",
                    retry_after_s=self.cfg.retry_after_s,
                )
            snap = rec.snapshot
            if snap.state in (State.FAILED, State.STOPPED):
                raise Refusal(
                    503,
                    "wake_failed",
                    f"{name} is {snap.state.value}: {snap.last_error or 'engine not running'}",
                    retry_after_s=self.cfg.retry_after_s,
                )
            task = rec.lane.gateway_wake
            if task is not None and task.done():
                rec.lane.gateway_woke(None)
                if task in seen:  # an older request's wake that ended before: not ours to judge
                    self._judge(rec, task)
                task = None
            wakeable = snap.state is State.SUSPENDED and not rec.lane.closed
            until = deadline
            if task is None and wakeable:
                if now >= rec.lane.retry_at:
                    task = self.tasks.spawn(self.coordinator.wake(mm), name=f"gateway-wake-{name}")
                    rec.lane.gateway_woke(task)
                else:
                    until = min(deadline, rec.lane.retry_at)  # a refusal said when to ask again
            if task is not None:
                seen.add(task)
            # Our wake in flight hands the ticket over itself (before any eviction can plan):
            # wait for it; otherwise for any change of the model's record.
            changed = rec.changes.next()
            waits: set[asyncio.Future[Any]] = {ticket, changed if task is None else task}
            if gone is not None:
                waits.add(gone)
            try:
                await asyncio.wait(
                    waits, timeout=max(0.0, until - now), return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                changed.cancel()

    def _judge(self, rec: ModelRecord, task: asyncio.Task[SwapResult]) -> None:
        """A finished wake: fine, retry later (a refusal that passes), or give up (503)."""
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        if isinstance(exc, WakeRefused) and exc.retry_after_s is not None:
            rec.lane.retry_after(self._mono() + exc.retry_after_s)
            return
        message = exc.message if isinstance(exc, HotswapError) else str(exc)
        detail = {"plan": exc.plan} if isinstance(exc, WakeRefused) else {}
        raise Refusal(
            503,
            "wake_failed",
            f"waking {rec.name} failed: {message}",
            retry_after_s=self.cfg.retry_after_s,
            detail=detail,
        )


async def _disconnected(receive: Receive) -> None:
    """Return once the client has disconnected (the body has been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
