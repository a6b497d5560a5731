"""Idle sleep: a model that served nothing for its `idle_sleep_s` is put to sleep.

One task per model with idle sleep on, owned by the sidecar's task group. It asks the pure
policy (`policy.plan_idle`) whether the model may sleep now and, if not yet, waits for the
first of two things: a change of the model's record (a request in or out, a state change: the
record's awaitable changes) or the one timer the plan asks for (when the model would have been
idle long enough). Nothing polls. The sleep goes through the coordinator (lane closed, drain
wait) with reason `idle`, and the gateway's next request for the model wakes it as usual.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from controller.config.settings import Settings
from controller.errors import HotswapError
from controller.fleet.policy import plan_idle
from controller.fleet.swap import SwapCoordinator
from controller.models.modelmanager import ModelManager
from controller.models.record import ModelRecord
from controller.tasks import Tasks

log = logging.getLogger("hotswap.idle")


class IdleSleeper:
    def __init__(
        self,
        coordinator: SwapCoordinator,
        settings: Settings,
        tasks: Tasks,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.coordinator = coordinator
        self.fleet = coordinator.fleet
        self.settings = settings
        self.tasks = tasks
        self._clock = clock
        models = coordinator.manager.models()
        self.watched = [m for m in models if settings.idle_sleep(m.settings)[0] is not None]

    def start(self) -> None:
        for mm in self.watched:
            self.tasks.spawn(self._watch(mm), name=f"hotswap-idle-{mm.name}")

    async def _watch(self, mm: ModelManager) -> None:
        name, rec = mm.name, mm.record
        idle_s, level = self.settings.idle_sleep(rec.settings)
        fields = {"model": name, "phase": "idle"}
        while True:
            plan = plan_idle(self.coordinator.view(mm), idle_s, self._clock())
            if not plan.sleep:
                log.debug("%s: no idle sleep: %s", name, plan.reason, extra=fields)
                await self._next_change(rec, plan.due_in_s)
                continue
            log.info("%s: idle sleep at level %d: %s", name, level, plan.reason, extra=fields)
            rec.swapping.idle_slept(self._clock())
            try:
                await self.coordinator.sleep(mm, level, drain="wait", reason="idle")
            except HotswapError as exc:
                # A request came in meanwhile (drain gave up), or the state moved: wait for
                # the next change, or a whole idle period, before asking again.
                log.info("%s: idle sleep not done: %s", name, exc, extra=fields)
                await self._next_change(rec, idle_s)

    @staticmethod
    async def _next_change(rec: ModelRecord, timeout_s: float | None) -> None:
        """The record's next change, the end of its transition or swap in flight (a task's
        end changes nothing in the record), or `timeout_s` (the model's one timer), first."""
        fut = rec.changes.next()
        moving = {t for t in (rec.in_flight_task(), rec.swapping.in_flight()) if t is not None}
        try:
            await asyncio.wait(
                {fut, *moving}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            fut.cancel()
