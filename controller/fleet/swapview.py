"""What the swap policy sees: the fleet's models read as `policy.ModelView`s (each view
carries its `ModelManager`, which the policy's plans hand back), each
device's budget (configured, or measured at boot), the measured awake footprints, and one
lock per device under which plans run.

`SwapView` is the read side of `controller.fleet.swap.SwapCoordinator`, which adds the actions
(policy wakes, evictions, draining sleeps). Nothing here talks to an engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from controller.config.settings import Settings
from controller.fleet.policy import Budget, ModelView, WakePlan, plan_wake
from controller.models.footprints import footprint_from_info
from controller.models.modelmanager import ModelManager
from controller.models.record import Fleet, ModelRecord
from controller.observe.swapmetrics import FleetRow, SwapMetrics
from controller.state import State

log = logging.getLogger("hotswap.swap")

Clock = Callable[[], float]


class SwapView:
    """The policy's inputs over the fleet's models, and the device locks."""

    def __init__(
        self,
        fleet: Fleet,
        models: Sequence[ModelManager],
        settings: Settings,
        metrics: SwapMetrics,
        *,
        clock: Clock = time.time,
    ) -> None:
        self.fleet = fleet
        self.models = tuple(models)  # every model, in the order of the settings
        self.settings = settings
        self.metrics = metrics
        self._clock = clock  # the manager's clock: snapshots' `since` is on it
        # Per device, not per model: what the policy plans against.
        self._measured_budget: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        # Whether a model's engine process is known to be gone: by default, for a managed model
        # whose record holds no live process (a FAILED attached engine may hold its memory).
        self.engine_gone: Callable[[ModelRecord], bool] = self._engine_gone
        for m in settings.models:
            metrics.register_model(m.name)
        metrics.read_fleet(self.fleet_rows)

    def fleet_rows(self) -> list[FleetRow]:
        return [
            FleetRow(r.name, r.settings.placement, r.holdings.host_bytes, r.leftover_bytes)
            for r in self.fleet.values()
        ]

    def budgets(self, rec: ModelRecord) -> dict[str, Budget]:
        """The budget of every device of the model's engine (its placement)."""
        return {d: self.budget(d) for d in rec.settings.placement}

    def budget(self, device: str) -> Budget:
        cfg = self.settings.swap
        measured = self._measured_budget.get(device)
        return Budget(
            bytes=cfg.budget_bytes if cfg.budget_bytes is not None else measured,
            max_awake=cfg.max_awake,
            min_awake_s=cfg.min_awake_s,
        )

    def set_measured_budget(self, device: str, n: int | None) -> None:
        if n is not None:
            self._measured_budget[device] = n
            log.info("measured budget of device %s: %d bytes", device, n)

    def learn_footprint(self, rec: ModelRecord, n: int | None, source: str) -> None:
        """Record a measured awake footprint (a configured one is never overwritten)."""
        if rec.holdings.learn_footprint(n):
            fields = {"model": rec.name}
            log.info("%s: awake footprint %d bytes (%s)", rec.name, n, source, extra=fields)

    def learn_from_info(self, rec: ModelRecord, ranks: list[dict[str, Any]]) -> None:
        self.learn_footprint(rec, footprint_from_info(ranks), "hotswap_info pools")

    def views(self) -> list[ModelView[ModelManager]]:
        return [self.view(mm) for mm in self.models]

    def view(self, mm: ModelManager) -> ModelView[ModelManager]:
        """What the policy knows of one model, read from its record now."""
        rec = mm.record
        held = rec.holdings
        return ModelView(
            model=mm,
            name=rec.name,
            state=rec.state,
            footprint_bytes=held.footprint,
            last_used=rec.lane.last_used,
            recent_uses=rec.lane.recent_uses(self._clock()),
            awake_since=rec.snapshot.since if rec.state is State.RUNNING else None,
            pinned=rec.settings.pinned,
            device=rec.settings.device,
            devices=rec.settings.placement,
            process_gone=self.engine_gone(rec),
            # What it leaves on its devices asleep: the last suspend's report (kept awake:
            # an eviction counts what the model will leave behind); a deep model waking,
            # what its restore brings back.
            asleep_bytes=_leftover(rec),
            wake_scratch_bytes=held.wake_scratch,
            host_bytes=held.host_bytes,
            host_weights_bytes=held.host_weights or held.pools.get("weights"),
            level=rec.snapshot.level if rec.state is State.SUSPENDED else None,
            demotable=held.demotable and not rec.snapshot.deep,
            deep=rec.snapshot.deep,
            restore_bytes=held.asleep_bytes if rec.snapshot.deep else 0,
            deepable=rec.settings.deep_sleep != "off"
            and rec.ckpt.deepable is not False
            and _weights_asleep(rec),
            in_flight=rec.lane.in_flight,
            queued=rec.lane.held,
            busy=any(
                t is not None
                for t in (
                    rec.in_flight_task(),
                    rec.swapping.in_flight(),
                    rec.swapping.deepening_now(),
                )
            ),
        )

    @staticmethod
    def _engine_gone(rec: ModelRecord) -> bool:
        return rec.settings.managed and not rec.process.alive()

    def plan(self, mm: ModelManager, *, allow_evict: bool = True) -> WakePlan[ModelManager]:
        budgets = self.budgets(mm.record)
        return plan_wake(mm, self.views(), budgets, self._clock(), allow_evict=allow_evict)

    def _lock(self, device: str) -> asyncio.Lock:
        return self._locks.setdefault(device, asyncio.Lock())

    @contextlib.asynccontextmanager
    async def _device_locks(self, rec: ModelRecord) -> AsyncIterator[None]:
        """Every lock of the model's devices, taken in one order (no two plans deadlock)."""
        async with contextlib.AsyncExitStack() as stack:
            for d in sorted(rec.settings.placement):
                await stack.enter_async_context(self._lock(d))
            yield

    def device_lock(self, rec: ModelRecord) -> contextlib.AbstractAsyncContextManager[None]:
        """The locks every wake plan of the model's devices runs under (boots take them too)."""
        return self._device_locks(rec)


def _leftover(rec: ModelRecord) -> int:
    """What the policy counts for the model's engine besides its pools: the record's
    figure, but for a deep model whose wake has begun (RESUMING, its restore running), what
    that restore brings back (NVML's figure after the checkpoint is what it held asleep)."""
    if rec.state is State.RESUMING and rec.snapshot.deep:
        return max(rec.leftover_bytes, rec.holdings.asleep_bytes)
    return rec.leftover_bytes


def _weights_asleep(rec: ModelRecord) -> bool:
    """Whether its weights are among the pools asleep (all are, unless a reconciliation read
    fewer back): a plan takes no sleeper deep whose checkpoint would copy its weights
    through the driver."""
    return rec.facts.asleep is None or "weights" in rec.facts.asleep
