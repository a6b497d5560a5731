"""The fleet of models: one `ModelManager` (controller.models.modelmanager) per configured model,
over the fleet's records; probing at start, the periodic reconcile of attached engines,
and a bounded stop.

A model's `ModelManager` is its object below the HTTP edge: the edge resolves a name once
(`Manager.get`), and every part after it is handed the object, never the name.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings, TimeoutSettings
from controller.engines.checkpoint import Checkpointer
from controller.engines.engine import EngineClient
from controller.errors import ModelNotFound
from controller.lifecycle import Lifecycle
from controller.models.modelmanager import ModelManager
from controller.models.quarantine import Quarantine
from controller.models.record import Fleet
from controller.observe.metrics import Metrics
from controller.state import (
    ModelSnapshot,
)
from controller.tasks import Tasks

log = logging.getLogger("hotswap.manager")

EngineFactory = Callable[[ModelSettings, TimeoutSettings], EngineClient]
Clock = Callable[[], float]


def default_engine_factory(model: ModelSettings, timeouts: TimeoutSettings) -> EngineClient:
    return EngineClient(model.url, uds=model.uds, timeouts=timeouts)


class Manager:
    """The fleet: one ModelManager per configured model, over the fleet's records."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        engine_factory: EngineFactory = default_engine_factory,
        clock: Clock = time.time,
        *,
        monotonic: Clock = time.monotonic,
        fleet: Fleet | None = None,
        tasks: Tasks | None = None,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self.fleet = fleet if fleet is not None else Fleet(settings.models, clock=clock)
        self.tasks = tasks if tasks is not None else Tasks()
        # The deep sleep's driver seam (§2.2): a helper process per call (started ahead),
        # never in this one.
        self.checkpointer = Checkpointer(
            lock_timeout_s=settings.timeouts.checkpoint_lock_s,
            call_timeout_s=settings.timeouts.checkpoint_s,
        )
        self.life = Lifecycle()  # starting, serving or stopping: what readiness says
        self._models = tuple(
            ModelManager(
                rec,
                settings.timeouts,
                engine_factory(rec.settings, settings.timeouts),
                metrics,
                self.tasks,
                clock=clock,
                monotonic=monotonic,
                checkpointer=self.checkpointer,
            )
            for rec in self.fleet.values()
        )
        # The HTTP edge's one lookup by name (`get`).
        self._by_name = {mm.name: mm for mm in self._models}
        for mm in self._models:  # a quarantine a sidecar before this one left
            quarantine = Quarantine.for_model(mm.settings, settings.state_dir)
            mm.record.facts.keep_quarantine_in(quarantine)
            metrics.register_model(mm.name)
        if not metrics.bound:
            metrics.read_from(self.snapshots)
        self._watcher: asyncio.Task[None] | None = None

    def get(self, name: str) -> ModelManager:
        """The model named `name`: the HTTP edge resolves a request's name here, once."""
        try:
            return self._by_name[name]
        except KeyError:
            raise ModelNotFound(f"no model named {name!r}", model=name) from None

    def models(self) -> list[ModelManager]:
        """Every model's manager, in the order of the settings."""
        return list(self._models)

    def snapshots(self) -> dict[str, ModelSnapshot]:
        return self.fleet.snapshots()

    async def start(self) -> None:
        """Probe every engine at once; an unreachable one is FAILED, not fatal to the sidecar.
        Managed engines are left UNKNOWN: the supervisor starts and probes them. Attached
        engines are then reconciled every `reprobe_interval_s` in every state but a
        transition in flight (`check_recovered`): someone else's process, restarted or
        replaced without a word to us, whose truth is read back (docs/ARCHITECTURE.md)."""
        if any(m.settings.deep_sleep != "off" for m in self._models):
            await self.checkpointer.prewarm()  # a deep sleep is this sidecar's own choice
        attached = [m for m in self._models if not m.settings.managed]
        await asyncio.gather(*(m.probe() for m in attached))
        if attached:
            self._watcher = self.tasks.spawn(self._watch(attached), name="watch-attached")

    async def _watch(self, models: list[ModelManager]) -> None:
        # A resync with external truth, not parts polling each other: vLLM tells nothing.
        interval = self.settings.timeouts.reprobe_interval_s
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(m.check_recovered() for m in models), return_exceptions=True)

    async def stop(self) -> None:
        """Wait up to timeouts.shutdown_s for transitions in flight, cancel the rest, close."""
        await self.tasks.cancel(self._watcher)
        running = [t for m in self._models if (t := m.task) is not None]
        if running:
            log.info(
                "waiting up to %g s for %d transitions",
                self.settings.timeouts.shutdown_s,
                len(running),
            )
            _, pending = await asyncio.wait(running, timeout=self.settings.timeouts.shutdown_s)
            await self.tasks.cancel(*pending)
        await asyncio.gather(
            *(m.engine.aclose() for m in self._models),
            self.checkpointer.aclose(),
            return_exceptions=True,
        )
