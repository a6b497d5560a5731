"""The composition root: one `Sidecar` built from the settings owns every part.

    Settings ──> Sidecar
                  ├── registry, Metrics, SwapMetrics     (Prometheus, injected everywhere)
                  ├── Fleet: one ModelRecord per model   (controller.models.record)
                  ├── Tasks: every background task       (controller.tasks)
                  ├── Manager: a ModelManager per model  (requests, sequences, runner)
                  ├── SwapCoordinator                    (hot swap: policy wakes, draining sleeps)
                  ├── Supervisor                         (managed engines: boot, watch, restart)
                  ├── IdleSleeper                        (idle sleep: one task per model)
                  ├── Gateway                            (the /v1 router, when enabled)
                  └── app, gateway_app                   (the two ASGI apps)

`hotswap serve` (controller.server) and the integration tests' harness build the same
object; the control app's lifespan starts and stops it. Nothing reaches into an app's state
to wire a part: the apps are built from the parts here.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from controller.config.settings import Settings
from controller.fleet.coordinator import Coordinator, DirectCoordinator
from controller.fleet.idle import IdleSleeper
from controller.fleet.supervisor import EngineFactory as ProcessFactory
from controller.fleet.supervisor import Supervisor, place_engine_sockets, with_demotable_engines
from controller.fleet.swap import SwapCoordinator
from controller.http import api, gateway
from controller.models.manager import EngineFactory, Manager, default_engine_factory
from controller.models.record import Fleet
from controller.observe.metrics import Metrics
from controller.observe.swapmetrics import SwapMetrics
from controller.tasks import Tasks

log = logging.getLogger("hotswap.sidecar")

Clock = Callable[[], float]


class Sidecar:
    """Every part of one sidecar process, built from `settings`; test seams are keywords."""

    def __init__(
        self,
        settings: Settings,
        *,
        registry: CollectorRegistry | None = None,
        engine_factory: EngineFactory = default_engine_factory,
        process_factory: ProcessFactory | None = None,
        gateway_transport: httpx.AsyncBaseTransport | None = None,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
    ) -> None:
        # Managed engines' sockets, placed before anything is built from the settings.
        settings, socket_folder = place_engine_sockets(settings)
        settings = with_demotable_engines(settings)  # a host budget may demote CUDA sleepers
        self.settings = settings
        self.registry = registry if registry is not None else CollectorRegistry()
        self.tasks = Tasks()
        self.fleet = Fleet(settings.models, clock=clock)
        self.metrics = Metrics(self.registry)
        self.manager = Manager(
            settings,
            self.metrics,
            engine_factory,
            clock,
            monotonic=monotonic,
            fleet=self.fleet,
            tasks=self.tasks,
        )
        # Hot swap (a budget, managed engines, the gateway): the policy's coordinator, the
        # supervisor of the engines this process starts, and the gateway in front.
        # Every sidecar has a coordinator: without hot swap, sleeps and wakes go straight to
        # the model's manager.
        self.coordinator: Coordinator = DirectCoordinator()
        self.swap: SwapCoordinator | None = None
        self.supervisor: Supervisor | None = None
        self.gateway: gateway.Gateway | None = None
        self.idle: IdleSleeper | None = None
        if settings.hot_swap:
            self.swap_metrics = SwapMetrics(self.registry)
            self.swap = swap = SwapCoordinator(
                self.manager, settings, self.swap_metrics, clock=clock, monotonic=monotonic
            )
            self.coordinator = swap
            if settings.managed:
                self.supervisor = Supervisor(
                    self.manager,
                    swap,
                    settings,
                    self.swap_metrics,
                    engine_factory=process_factory,
                    monotonic=monotonic,
                    socket_folder=socket_folder,
                )
            if any(settings.idle_sleep(m)[0] is not None for m in settings.models):
                self.idle = IdleSleeper(swap, settings, self.tasks, clock=clock)
            if settings.gateway_enabled:
                self.gateway = gateway.Gateway(
                    settings,
                    self.manager,
                    swap,
                    self.swap_metrics,
                    transport=gateway_transport,
                    monotonic=monotonic,
                )
        self.app = api.create_app(
            api.AppContext(
                settings=settings,
                manager=self.manager,
                registry=self.registry,
                coordinator=self.coordinator,
                supervisor=self.supervisor,
            ),
            lifespan=self._lifespan,
        )
        self.gateway_app: FastAPI | None = (
            gateway.create_gateway(self.gateway) if self.gateway is not None else None
        )
        self.started = asyncio.Event()  # the start-up reconciliation is done
        self._starting: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Probe the attached engines, then boot the managed ones in the background. Until
        the probes are done, readiness answers 503 with the reason (`Lifecycle`)."""
        life = self.manager.life
        life.starting = True
        try:
            await self.manager.start()
        finally:
            life.starting = False
            self.started.set()
        if self.supervisor is not None:
            self.supervisor.start()  # staggered boot in the background: /livez answers meanwhile
        if self.idle is not None:
            self.idle.start()  # one task per model with idle sleep on, in the task group
        names = [m.name for m in self.settings.models]
        log.info("managing %d model(s): %s", len(names), names)
        for m in self.settings.models:
            if m.accept_unverified_wake:
                log.warning(
                    "%s: accept_unverified_wake is set: after vLLM's own wake of a plain "
                    "engine it is served with nothing verified (verified: false, "
                    "unverified_wake: true; docs/contracts.md §2.3)",
                    m.name,
                )

    async def drain(self, grace_s: float | None = None) -> int:
        """A SIGTERM's first step: admit nothing new (readiness 503, the gateway 503 with
        Retry-After, held requests too) and give the gateway's requests in flight, streams
        included, up to `grace_s` (`timeouts.stop_drain_s`) to finish. Returns how many
        were still in flight at the end (0: none was cut)."""
        grace = self.settings.timeouts.stop_drain_s if grace_s is None else grace_s
        self.manager.life.stopping = True
        for rec in self.fleet.values():
            rec.changed()  # held requests look again, and are refused

        def busy() -> int:
            return sum(r.lane.in_flight for r in self.fleet.values())

        if busy():
            log.info("shutting down: %d request(s) in flight get up to %g s", busy(), grace)
        await self.fleet.wait_for(lambda: busy() == 0, timeout_s=grace)
        if left := busy():
            log.warning("shutting down: %d request(s) still in flight after %g s", left, grace)
        return left

    async def stop(self) -> None:
        """Drain transitions (bounded), stop the engines, cancel every task that is left."""
        self.manager.life.stopping = True
        await self.tasks.cancel(self._starting)
        await self.manager.stop()
        log.info("manager stopped")
        if self.supervisor is not None:
            await self.supervisor.stop()
            log.info("managed engines stopped")
        await self.tasks.aclose()

    @asynccontextmanager
    async def _lifespan(self, app: FastAPI) -> AsyncIterator[None]:
        # The start-up reconciliation runs once the port is bound: a long one (an engine
        # that finishes a wake, or does not answer until its probe times out) answers 503
        # with the reason meanwhile, instead of no port for the startupProbe.
        self._starting = self.tasks.spawn(self.start(), name="hotswap-start")
        try:
            yield
        finally:
            await self.stop()
