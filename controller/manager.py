"""Per-model requests and sequences, and the fleet of models.

A `ModelManager` decides what a sleep or wake request does (state.decide), and runs the
sequence it begins (controller.steps: drain + the protocol's RPCs; the protocol's RPCs +
/resume + warm-up) through its `Runner`, which times, records and maps errors. Each
transition runs in one named task of the sidecar's task group, under one lock per model,
so a cancelled HTTP request never stops an engine sequence halfway and two sequences never
interleave. Any failure after the drain is FAILED: the engine must be restarted, nothing is
retried or resent.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from controller import protocol, steps
from controller.engine import EngineClient
from controller.errors import DrainTimeout, EngineError, ModelNotFound, TransitionConflict
from controller.metrics import Metrics
from controller.record import Fleet, ModelRecord
from controller.runner import AnyStep, PhaseFailed, Run, Runner
from controller.settings import ModelSettings, Settings, TimeoutSettings
from controller.state import (
    Action,
    Event,
    ModelSnapshot,
    Request,
    State,
    TransitionRecord,
    decide,
    refusal_reason,
)
from controller.steps import DrainMode
from controller.tasks import Tasks

log = logging.getLogger("hotswap.manager")

EngineFactory = Callable[[ModelSettings, TimeoutSettings], EngineClient]
Clock = Callable[[], float]


def default_engine_factory(model: ModelSettings, timeouts: TimeoutSettings) -> EngineClient:
    return EngineClient(model.url, timeouts=timeouts)


@dataclass(frozen=True)
class Outcome:
    """What a sleep or wake request did: the action taken, the model now, the transition run."""

    action: Action
    snapshot: ModelSnapshot
    transition: TransitionRecord | None = None


class ModelManager:
    """One model: its requests, its sequences and its one transition at a time."""

    def __init__(
        self,
        record: ModelRecord,
        timeouts: TimeoutSettings,
        engine: EngineClient,
        metrics: Metrics,
        tasks: Tasks,
        *,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
    ) -> None:
        self.name = record.name
        self.record = record
        self.settings = record.settings
        self.timeouts = timeouts
        self.engine = engine
        self.metrics = metrics
        self.tasks = tasks
        self.runner = Runner(record, engine, timeouts, metrics, clock=clock, monotonic=monotonic)
        self._lock = asyncio.Lock()

    def snapshot(self) -> ModelSnapshot:
        return self.record.snapshot

    @property
    def task(self) -> asyncio.Task[Outcome] | None:
        """The transition in flight, if any."""
        return self.record.in_flight_task()

    def _refuse(self, req: Request) -> TransitionConflict:
        why = refusal_reason(self.record.snapshot, req)
        return TransitionConflict(f"cannot {req.value} {self.name}: {why}", model=self.name)

    # ---- requests ------------------------------------------------------------------------

    def _begin(
        self, req: Request, make: Callable[[], Coroutine[Any, Any, Outcome]]
    ) -> tuple[Action, asyncio.Task[Outcome] | None]:
        """Decide, and for BEGIN change state and start the task; no await in between."""
        rec = self.record
        action = decide(rec.state, req)
        if action is Action.CONFLICT:
            raise self._refuse(req)
        if action is Action.NOOP:
            return action, None
        if action is Action.JOIN:
            if rec.transition is None or rec.transition_kind is not req:
                raise self._refuse(req)  # a transition not started by this manager: refuse
            return action, rec.transition
        self.runner.apply(Event.SLEEP if req is Request.SLEEP else Event.WAKE, verified=False)
        task = self.tasks.spawn(make(), name=f"hotswap-{req.value}-{self.name}")
        rec.transition, rec.transition_kind = task, req
        rec.changed()
        return action, task

    async def _await(self, action: Action, task: asyncio.Task[Outcome] | None) -> Outcome:
        if task is None:
            return Outcome(action, self.record.snapshot, None)
        # shield: a caller that goes away does not cancel the engine sequence.
        outcome = await asyncio.shield(task)
        return Outcome(action, self.record.snapshot, outcome.transition)

    def begin_sleep(
        self,
        level: int | None = None,
        drain: DrainMode = "wait",
        drain_timeout_s: float | None = None,
    ) -> Outcome:
        """Start a sleep in the background and return at once (the API's ?wait=false)."""
        action, _ = self._sleep_task(level, drain, drain_timeout_s)
        return Outcome(action, self.record.snapshot, None)

    def begin_wake(self) -> Outcome:
        action, _ = self._begin(Request.WAKE, self._wake)
        return Outcome(action, self.record.snapshot, None)

    async def sleep(
        self,
        level: int | None = None,
        drain: DrainMode = "wait",
        drain_timeout_s: float | None = None,
    ) -> Outcome:
        action, task = self._sleep_task(level, drain, drain_timeout_s)
        return await self._await(action, task)

    async def wake(self) -> Outcome:
        action, task = self._begin(Request.WAKE, self._wake)
        return await self._await(action, task)

    def _sleep_task(
        self, level: int | None, drain: DrainMode, drain_timeout_s: float | None
    ) -> tuple[Action, asyncio.Task[Outcome] | None]:
        lvl = self.settings.default_level if level is None else level
        if lvl not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {lvl}")
        if drain not in ("wait", "abort"):
            raise ValueError(f"drain must be 'wait' or 'abort', not {drain!r}")
        if drain_timeout_s is None:
            grace = self.timeouts.drain_s if drain == "wait" else 0.0
        else:
            grace = drain_timeout_s
        if grace < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        return self._begin(Request.SLEEP, lambda: self._sleep(lvl, drain, grace))

    # ---- the sequences -------------------------------------------------------------------

    async def _sleep(self, level: int, drain: DrainMode, grace: float) -> Outcome:
        run = self.runner.begin("sleep", level, State.RUNNING)
        params = protocol.Params(level=level, quiesce_timeout_s=self.timeouts.quiesce_s)
        sequence = steps.sleep_sequence(level, drain, grace)
        await self._guarded(run, sequence, params)
        self.runner.count_bytes(run)
        rec = self.runner.finish(
            run, Event.SLEEP_DONE, State.SUSPENDED, level=level, last_error=None
        )
        return Outcome(Action.BEGIN, self.record.snapshot, rec)

    def _gave_up(self, run: Run, exc: DrainTimeout) -> DrainTimeout:
        # Nothing was touched: the model is as verified as before the sleep was asked for.
        self.runner.finish(
            run, Event.SLEEP_GAVE_UP, State.RUNNING, "gave_up", error=exc.message,
            failed_phase="drain", verified=True,
        )  # fmt: skip
        return exc

    async def _wake(self) -> Outcome:
        level = self.record.snapshot.level or 1
        run = self.runner.begin("wake", level, State.SUSPENDED)
        params = protocol.Params(level=level, quiesce_timeout_s=self.timeouts.quiesce_s)
        await self._guarded(run, steps.wake_sequence(level), params)
        self.runner.count_bytes(run)
        rec = self.runner.finish(
            run, Event.WAKE_DONE, State.RUNNING, verified=True, level=None, last_error=None
        )
        return Outcome(Action.BEGIN, self.record.snapshot, rec)

    async def _guarded(
        self, run: Run, sequence: tuple[AnyStep, ...], params: protocol.Params
    ) -> dict[str, tuple[protocol.RankReport, ...]]:
        """Run a sequence under the model's lock; every failure but a drain that gave up
        (DrainTimeout: still RUNNING, nothing touched) ends in FAILED."""
        async with self._lock:
            try:
                return await self.runner.run(run, sequence, params)
            except PhaseFailed as failed:
                if isinstance(failed.error, DrainTimeout):
                    raise self._gave_up(run, failed.error) from None
                raise self.runner.fail(run, failed) from failed.error
            except asyncio.CancelledError:
                err = EngineError("cancelled at shutdown: the engine is in an unknown state")
                self.runner.fail(run, PhaseFailed(self.record.phase or run.kind, "cancelled", err))
                raise
            except TransitionConflict:
                raise
            except Exception as exc:  # a bug must not leave the model SUSPENDING forever
                err = EngineError(f"internal error: {type(exc).__name__}: {exc}")
                phase = self.record.phase or run.kind
                raise self.runner.fail(run, PhaseFailed(phase, "internal", err)) from exc

    # ---- probe and pass-through ----------------------------------------------------------

    async def probe(self) -> ModelSnapshot:
        """Start-up: ask the engine what it is doing; -> RUNNING, SUSPENDED or FAILED."""
        async with self._lock:
            run = self.runner.begin("start")
            try:
                reports = await self.runner.run(run, steps.PROBE, protocol.Params())
            except PhaseFailed as failed:
                self.runner.fail(run, failed)
                return self.record.snapshot
            info = [r for r in reports[protocol.INFO.phase] if isinstance(r, protocol.InfoReport)]
            level = protocol.suspended_level(info)
            if self.record.state is State.STARTING:
                # A managed engine just booted: it serves (nothing of it can be suspended yet).
                self.runner.finish(run, Event.STARTED, State.RUNNING, verified=True, level=None)
            elif level is not None:
                self.runner.finish(
                    run, Event.PROBED_SUSPENDED, State.SUSPENDED, verified=False, level=level
                )
            else:
                self.runner.finish(
                    run, Event.PROBED_RUNNING, State.RUNNING, verified=True, level=None
                )
            return self.record.snapshot

    def mark_starting(self) -> None:
        """Managed engine: its process is being (re)started; `probe` then makes it RUNNING."""
        self.runner.apply(Event.START, verified=False, level=None)

    def mark_failed(self, reason: str) -> None:
        """Managed engine: its process died, or it is restarted after a FAILED transition."""
        if self.record.state is not State.FAILED:
            self.runner.apply(Event.FAIL, verified=False, last_error=reason)

    async def check_recovered(self) -> bool:
        """Attached engine in FAILED: probe it afresh once it is safe to, i.e. when it failed
        before ever being reached, or after it was seen down (restarted, so its RPC reply
        queues are fresh). An engine that stayed up after a failed RPC is never called again:
        its replies may be out of step. Returns True when a new probe ran."""
        rec = self.record
        if rec.state is not State.FAILED or self._lock.locked():
            return False
        try:
            up = await self.engine.health(timeout_s=self.timeouts.probe_s)
        except EngineError:
            up = False
        if not up:
            rec.seen_down_since_failure = True
            return False
        last = rec.snapshot.last_transition
        never_reached = last is not None and last.kind == "start" and last.failed_phase == "health"
        if not (never_reached or rec.seen_down_since_failure):
            return False
        log.info(
            "%s: engine answers again after a failure; probing it afresh",
            self.name,
            extra={"model": self.name, "phase": "probe", "rank": None},
        )
        rec.seen_down_since_failure = False
        await self.probe()
        return True

    async def _passthrough(
        self, step: protocol.Step, params: protocol.Params
    ) -> list[dict[str, Any]]:
        """An RPC outside a transition; a failure is FAILED too (the queues may be out of step)."""
        if self.record.state not in (
            State.RUNNING,
            State.SUSPENDED,
            State.SUSPENDING,
            State.RESUMING,
        ):
            raise TransitionConflict(
                f"cannot call {step.method} on {self.name} in state {self.record.state.value}",
                model=self.name,
            )
        async with self._lock:
            run = self.runner.begin(step.method)
            try:
                reports = await self.runner.step(run, step, params)
            except PhaseFailed as failed:
                raise self.runner.fail(run, failed) from failed.error
            return [dict(r.raw) for r in reports]

    async def audit(self, level: int) -> list[dict[str, Any]]:
        return await self._passthrough(protocol.AUDIT, protocol.Params(level=level))

    async def info(self) -> list[dict[str, Any]]:
        return await self._passthrough(_INFO_PASSTHROUGH, protocol.Params())


# Outside a transition, an info call is recorded under its method's name, as audit is.
_INFO_PASSTHROUGH = protocol.Step(
    "hotswap_info", "hotswap_info", lambda p: (), report=protocol.InfoReport
)


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
        self._models: dict[str, ModelManager] = {
            m.name: ModelManager(
                self.fleet[m.name],
                settings.timeouts,
                engine_factory(m, settings.timeouts),
                metrics,
                self.tasks,
                clock=clock,
                monotonic=monotonic,
            )
            for m in settings.models
        }
        for name in self._models:
            metrics.register_model(name)
        if not metrics.bound:
            metrics.read_from(self.snapshots)
        self._watcher: asyncio.Task[None] | None = None

    def get(self, name: str) -> ModelManager:
        try:
            return self._models[name]
        except KeyError:
            raise ModelNotFound(f"no model named {name!r}", model=name) from None

    def snapshots(self) -> dict[str, ModelSnapshot]:
        return self.fleet.snapshots()

    async def start(self) -> None:
        """Probe every engine at once; an unreachable one is FAILED, not fatal to the sidecar.
        Managed engines are left UNKNOWN: the supervisor starts and probes them. Attached
        engines that are FAILED are then re-probed every `reprobe_interval_s` until they
        come back (`check_recovered`): the engine is another process, read back on a timer."""
        attached = [m for m in self._models.values() if not m.settings.managed]
        await asyncio.gather(*(m.probe() for m in attached))
        if attached:
            self._watcher = self.tasks.spawn(self._watch(attached), name="watch-attached")

    async def _watch(self, models: list[ModelManager]) -> None:
        interval = self.settings.timeouts.reprobe_interval_s
        while True:
            # Nothing to re-probe until one of them is FAILED: wait for that, not a tick.
            await self.fleet.wait_for(lambda: any(m.record.state is State.FAILED for m in models))
            await asyncio.sleep(interval)
            await asyncio.gather(*(m.check_recovered() for m in models), return_exceptions=True)

    async def stop(self) -> None:
        """Wait up to timeouts.shutdown_s for transitions in flight, cancel the rest, close."""
        await self.tasks.cancel(self._watcher)
        running = [t for m in self._models.values() if (t := m.task) is not None]
        if running:
            log.info(
                "waiting up to %g s for %d transitions",
                self.settings.timeouts.shutdown_s,
                len(running),
            )
            _, pending = await asyncio.wait(running, timeout=self.settings.timeouts.shutdown_s)
            await self.tasks.cancel(*pending)
        await asyncio.gather(
            *(m.engine.aclose() for m in self._models.values()), return_exceptions=True
        )
