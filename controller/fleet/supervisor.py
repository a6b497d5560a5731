"""Managed mode: the sidecar starts its vLLM servers itself and keeps them running.

Boot is staggered per device: start one engine, wait until it answers /health, probe it
(STARTING -> RUNNING), put it to sleep, then start the next, because vLLM sizes its KV
cache from the memory it sees free at start. Pinned models stay awake. A background task
watches every model and is told of both causes of a restart, nothing polls: a model left
FAILED by a transition changes its record, and each engine process has a task awaiting its
exit (`EngineProcess.exited`, a pidfd the event loop watches) that changes the record when
it ends. Either is restarted after a bounded exponential backoff, logged with the model's
name. Each model's process, start time and restart count live in its record. Engines in
the models file without a `command` are attached: someone else runs them, and this module
leaves them alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings
from controller.engines.enginespec import EngineSpec
from controller.engines.launcher import EngineProcess
from controller.engines.sockets import private_dir, with_engine_sockets
from controller.errors import HotswapError
from controller.fleet.policy import measured_budget, restart_delay
from controller.fleet.swap import SwapCoordinator
from controller.models.fleetparts import EngineProcess as Engine
from controller.models.footprints import budget_from_info, footprint_from_info
from controller.models.manager import Manager
from controller.models.modelmanager import ModelManager
from controller.models.record import ModelRecord
from controller.observe.swapmetrics import SwapMetrics
from controller.state import ModelSnapshot, State

log = logging.getLogger("hotswap.supervisor")
DEMOTABLE_ENV = "HOTSWAP_DEMOTABLE"


EngineFactory = Callable[[ModelSettings], Engine]


def process_factory(log_dir: Path, stop_grace_s: float = 15.0, nice: int = 0) -> EngineFactory:
    """Real engines: the model's argv and env on its Unix socket, one log per model, `nice`
    steps below the sidecar's CPU priority."""

    def make(model: ModelSettings) -> Engine:
        if model.command is None or model.uds is None:
            raise ValueError(f"{model.name}: a managed model needs a command and a socket")
        spec = EngineSpec.from_command(model.name, model.command, Path(model.uds), model.env)
        log_path = log_dir / f"{model.name}.log"
        return EngineProcess(spec, log_path, stop_grace_s=stop_grace_s, nice=nice)

    return make


def place_engine_sockets(settings: Settings) -> tuple[Settings, Path | None]:
    """Give every managed model without one a socket in the private folder (0700), before
    anything is built from the settings. Returns the new settings and the folder when this
    made a temporary one (the supervisor removes it at stop), else None."""
    if not any(m.managed and m.uds is None for m in settings.models):
        return settings, None
    configured = settings.supervisor.socket_dir
    folder = private_dir(configured)
    return with_engine_sockets(settings, folder), folder if configured is None else None


def with_demotable_engines(
    settings: Settings, inherited: Mapping[str, str] = os.environ
) -> Settings:
    """Under a host budget, the managed engines this sidecar starts are told to make their
    level-1 sleeps demotable (`HOTSWAP_DEMOTABLE=1`: a CUDA rank's prepare then protects
    what a level-2 wake needs, so the budget can release a sleeper's host copy), unless a
    model's own `env` names the variable, or the sidecar's environment does (`inherited`:
    the engines inherit it). Without a budget nobody demotes, and the default (off) spares
    every sleep that cost. Attached engines are started by someone else."""
    if settings.swap.host_budget is None or DEMOTABLE_ENV in inherited:
        return settings
    models = [
        m.model_copy(update={"env": {**m.env, DEMOTABLE_ENV: "1"}})
        if m.managed and DEMOTABLE_ENV not in m.env
        else m
        for m in settings.models
    ]
    return settings.model_copy(update={"models": models})


def _info_ranks(snap: ModelSnapshot) -> list[dict[str, object]]:
    """The `hotswap_info` reports of the start probe, kept in its transition record."""
    if snap.last_transition is None:
        return []
    for phase in snap.last_transition.phases:
        if phase.name == "info":
            return [dict(r) for r in phase.ranks]
    return []


class Supervisor:
    def __init__(
        self,
        manager: Manager,
        coordinator: SwapCoordinator,
        settings: Settings,
        metrics: SwapMetrics,
        *,
        engine_factory: EngineFactory | None = None,
        monotonic: Callable[[], float] = time.monotonic,
        socket_folder: Path | None = None,
    ) -> None:
        self.manager = manager
        self.fleet = manager.fleet
        self.tasks = manager.tasks
        self.coordinator = coordinator
        self.settings = settings
        self.cfg = settings.supervisor
        self.metrics = metrics
        self._mono = monotonic
        self.models = [mm for mm in manager.models() if mm.settings.managed]
        self._socket_folder = socket_folder  # made for this run: removed at stop
        self._tmp: tempfile.TemporaryDirectory[str] | None = None
        if engine_factory is None:
            log_dir = self.cfg.log_dir
            if log_dir is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="hotswap-engines-")
                log_dir = Path(self._tmp.name)
            engine_factory = process_factory(log_dir, self.cfg.stop_grace_s, self.cfg.engine_nice)
        self._factory = engine_factory
        self._task: asyncio.Task[None] | None = None
        self.booted = asyncio.Event()

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self) -> None:
        """Boot, then watch, in one named background task (the API serves meanwhile)."""
        self._task = self.tasks.spawn(self._run(), name="hotswap-supervisor")

    async def _run(self) -> None:
        await self.boot()
        await self.watch()

    async def stop(self) -> None:
        """Stop watching and restarting, then stop every engine (SIGTERM, then SIGKILL)."""
        procs = [r.process for r in self.fleet.values()]
        await self.tasks.cancel(
            self._task, *(p.restart for p in procs), *(p.exit_watch for p in procs)
        )
        engines = [p.engine for p in procs if p.engine is not None]
        await asyncio.gather(
            *(asyncio.to_thread(e.stop, self.cfg.stop_grace_s) for e in engines),
            return_exceptions=True,
        )
        if self._tmp is not None:
            self._tmp.cleanup()
        if self._socket_folder is not None:
            shutil.rmtree(self._socket_folder, ignore_errors=True)

    # ---- boot ----------------------------------------------------------------------------

    async def boot(self) -> None:
        """Start every managed engine, one at a time per device, each asleep before the next."""
        for mm in self.models:
            # The lock covers the plan only: once STARTING, the policy counts the model at its
            # footprint, so wakes on the device go on (or wait with a reason) during the boot.
            async with self.coordinator.device_lock(mm.record):
                mm.mark_starting()
            await self._start(mm)
        await self._measure_budgets()
        self.booted.set()
        log.info("managed engines booted: %s", self._states())

    def _states(self) -> str:
        return ", ".join(f"{mm.name}={mm.record.state.value}" for mm in self.models)

    async def _start(self, mm: ModelManager) -> bool:
        """Start one engine of a model marked STARTING, holding no lock (a boot may take
        `boot_timeout_s`); True when it serves or sleeps."""
        m, rec = mm.settings, mm.record
        fields = {"model": m.name, "phase": "start"}
        engine = self._factory(m)
        t0 = self._mono()
        try:
            # On the loop's thread: the keeper's parent-death signal follows the thread that
            # started it, and this one lives as long as the sidecar.
            engine.start()
            rec.process.launched(engine, self._watch_exit(rec, engine))
            await asyncio.to_thread(engine.wait_ready, self.cfg.boot_timeout_s)
        except (HotswapError, OSError) as exc:
            reason = f"engine did not start: {exc}"
            log.error("%s: %s", m.name, reason, extra=fields)
            await asyncio.to_thread(engine.kill)
            mm.mark_failed(reason)
            return False
        rec.process.ready(self._mono())
        snap = await mm.probe()
        if snap.state is not State.RUNNING:
            log.error("%s: started but the probe failed: %s", m.name, snap.last_error, extra=fields)
            return False
        self.coordinator.learn_footprint(
            rec, footprint_from_info(_info_ranks(snap)), "hotswap_info pools at start"
        )
        log.info("%s: engine ready after %.1f s", m.name, self._mono() - t0, extra=fields)
        if m.pinned:
            return True
        try:
            await self.coordinator.sleep(mm, reason="boot")
        except HotswapError as exc:
            log.error("%s: could not put it to sleep after start: %s", m.name, exc, extra=fields)
            return False
        return True

    def _watch_exit(self, rec: ModelRecord, engine: Engine) -> asyncio.Task[None]:
        """A task that awaits the engine's exit and tells the model's record (the watch loop
        wakes)."""

        async def exited() -> None:
            await engine.exited()
            rec.changed()

        return self.tasks.spawn(exited(), name=f"hotswap-exit-{rec.name}")

    async def _measure_budgets(self) -> None:
        """No configured byte budget: measure one per device with everything asleep (CUDA
        reports free memory), plus what the policy counts for the models on it then: the
        pinned ones' footprint, and every live engine's leftover besides its pools (so the
        policy, which counts those, counts nothing twice)."""
        if self.settings.swap.budget_bytes is not None:
            return
        seen: set[str] = set()
        for mm in self.models:
            placement = mm.settings.placement
            if set(placement) <= seen or mm.record.state not in (State.SUSPENDED, State.RUNNING):
                continue
            seen.update(placement)
            try:
                ranks = await mm.info()
            except HotswapError as exc:
                log.warning("%s: could not measure the budget: %s", mm.name, exc)
                continue
            free = budget_from_info(ranks)
            if free is None:
                continue
            for d in placement:  # the tightest rank's free memory, for each of its devices
                views = [self.coordinator.view(p) for p in self.models]
                self.coordinator.set_measured_budget(d, measured_budget(free, d, views))

    # ---- watch and restart ---------------------------------------------------------------

    async def watch(self) -> None:
        """Restart engines whose model a transition left FAILED or whose process exited;
        both change the model's record, which this awaits."""
        records = [mm.record for mm in self.models]
        while True:
            for mm in self.models:
                rec = mm.record
                if rec.process.restarting():
                    continue
                why = self._why_restart(rec)
                if why is not None:
                    task = self.tasks.spawn(self._restart(mm, why), f"hotswap-restart-{mm.name}")
                    rec.process.restart_begun(task)
            await self.fleet.wait_for(
                lambda: any(
                    self._why_restart(r) is not None and not r.process.restarting() for r in records
                )
            )

    @staticmethod
    def _why_restart(rec: ModelRecord) -> str | None:
        if rec.state is State.STARTING:
            return None
        if rec.state is State.FAILED:
            return f"FAILED: {rec.snapshot.last_error}"
        engine = rec.process.engine
        if engine is not None and not engine.is_alive():
            return f"engine exited with code {engine.returncode}"
        return None

    async def _end_old(self, mm: ModelManager) -> bool:
        """End the old engine's whole process group, its keeper alive or not: a keeper killed
        outright (SIGKILL, the OOM killer) leaves the engine's children (EngineCore, workers)
        alive and holding their memory. A new engine starts only once none is left (False:
        some survived the SIGKILL; the model stays FAILED with their pids, and the next
        restart tries again)."""
        engine = mm.record.process.engine
        if engine is None:
            return True
        if engine.is_alive() or engine.group_left():
            await asyncio.to_thread(engine.stop, self.cfg.stop_grace_s)
        left = engine.group_left()
        if left:
            reason = f"the old engine's processes {left} outlived SIGKILL: no new start"
            log.error("%s: %s", mm.name, reason, extra={"model": mm.name, "phase": "restart"})
            mm.mark_failed(reason)
            return False
        return True

    async def _restart(self, mm: ModelManager, why: str) -> None:
        try:
            await self._restart_once(mm, why)
        finally:
            mm.record.changed()  # the watch loop looks again (a restart that failed)

    async def _restart_once(self, mm: ModelManager, seen: str) -> None:
        m, rec = mm.settings, mm.record
        fields = {"model": m.name, "phase": "restart"}
        # The transition fails by itself on a dead engine, and a failed step is reconciled
        # inside it: let both finish, then judge by what the reconciliation says. A step
        # refused by every rank (ok: false) leaves the engine RUNNING or SUSPENDED, and an
        # engine that can be trusted is never replaced (on a GPU a restart is a cold boot).
        with contextlib.suppress(Exception, TimeoutError):
            await asyncio.wait_for(mm.settled(), self.settings.timeouts.rpc_s)
        why = self._why_restart(rec)
        if why is None:
            log.info(
                "%s: %s; reconciled to %s: no restart",
                m.name,
                seen,
                rec.state.value,
                extra=fields,
            )
            return
        started = rec.process.started_at
        stable = started is not None and self._mono() - started >= self.cfg.stable_s
        # it ran long enough: a fresh crash starts the backoff over
        n = rec.process.count_restart(stable=stable)
        delay = restart_delay(n, self.cfg.restart_backoff_s, self.cfg.restart_backoff_max_s)
        log.warning("%s: %s; restart #%d in %g s", m.name, why, n, delay, extra=fields)
        mm.mark_failed(why)
        ended = await self._end_old(mm)
        await asyncio.sleep(delay)
        if not ended:
            return
        async with self.coordinator.device_lock(rec):
            await self.coordinator.make_room(mm)
            mm.mark_starting()  # counted at its footprint from here: the lock can go
        self.metrics.restart(m.name)
        ok = await self._start(mm)
        log.info(
            "%s: restart #%d %s (%s)",
            m.name,
            n,
            "done" if ok else "failed",
            mm.snapshot().state.value,
            extra=fields,
        )
