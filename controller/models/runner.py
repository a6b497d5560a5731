"""The one runner of a model's steps: it times each, records it, and maps its errors.

A transition is a tuple of steps: the RPC steps of `controller.protocol` and the
engine-level steps of `controller.models.steps` (drain, /resume, warm-up, /health). `Runner.run`
runs them in order; each becomes one `PhaseRecord` (duration, per-rank reports, detail)
and one phase-duration observation. A failed step raises `PhaseFailed` once, carrying the
phase, the method and the error already translated (late ranks -> BarrierTimeout,
mismatched tensors -> VerificationFailed); `fail` turns it into FAILED with the reason kept.
`apply` is the one place a model's state changes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from controller import protocol
from controller.config.settings import TimeoutSettings
from controller.engines.engine import EngineClient, RankError
from controller.errors import (
    BarrierTimeout,
    EngineTimeout,
    EngineUnavailable,
    HotswapError,
    VerificationFailed,
)
from controller.models.record import ModelRecord
from controller.observe.metrics import Metrics
from controller.reports import (
    RankReport,
    ResumeReport,
    SuspendReport,
    late_ranks,
    mismatched,
    resident_bytes,
    sum_by_pool,
)
from controller.state import Event, ModelSnapshot, PhaseRecord, State, TransitionRecord, next_state

log = logging.getLogger("hotswap.manager")

Clock = Callable[[], float]


@dataclass(frozen=True)
class EngineStep:
    """A step that is not an extension RPC (a /pause, a /resume, a warm-up, a /health):
    `call` does it through the engine adapter and returns the phase's detail."""

    phase: str
    method: str  # the rpc-errors metric's label, e.g. "/pause"
    call: Callable[[Runner], Awaitable[Mapping[str, Any]]]


AnyStep = protocol.Step | EngineStep


class PhaseFailed(Exception):
    """A step failed; carries what the transition record and the metrics need."""

    def __init__(self, phase: str, method: str, error: HotswapError) -> None:
        super().__init__(str(error))
        self.phase = phase
        self.method = method
        self.error = error


@dataclass
class Run:
    """Bookkeeping of one transition in flight: its phases, in order."""

    kind: str
    from_state: State
    level: int | None
    started_at: float
    mono_start: float
    phases: list[PhaseRecord] = field(default_factory=list)
    reports: dict[str, tuple[RankReport, ...]] = field(default_factory=dict)
    # The params the next steps are built from: `run` sets them; an engine step that
    # decides from an earlier step's reports may replace them (the kv decision).
    params: protocol.Params | None = None
    # Requests an engine step sent ahead for a later step, by that step's phase (the
    # warm-up, sent with /resume); the later step awaits its own, `run` cancels the rest.
    ahead: dict[str, asyncio.Task[Any]] = field(default_factory=dict)

    def send_ahead(self, phase: str, request: Callable[[], Awaitable[Any]]) -> None:
        """Start `request()` now for the step `phase` (which takes it with `taken`)."""
        if phase not in self.ahead:
            self.ahead[phase] = asyncio.ensure_future(request())

    def taken(self, phase: str) -> asyncio.Task[Any] | None:
        return self.ahead.pop(phase, None)

    def cancel_ahead(self) -> None:
        """Cancel what was sent ahead and not taken (the step it was for never ran)."""
        for task in self.ahead.values():
            task.cancel()
            # read the outcome so that an error there is not reported as never retrieved
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        self.ahead.clear()


def _reason(exc: HotswapError) -> str:
    """The `reason` label of hotswap_engine_rpc_errors_total."""
    if isinstance(exc, BarrierTimeout):
        return "barrier_timeout"
    if isinstance(exc, EngineTimeout):
        return "timeout"
    if isinstance(exc, EngineUnavailable):
        return "unavailable"
    if isinstance(exc, RankError):
        return "rank_failed"
    return "error"


def _summary(reports: Sequence[RankReport]) -> dict[str, Any]:
    """The detail a phase record keeps: bytes by pool, summed over ranks."""
    freed = [r.freed_bytes for r in reports if isinstance(r, SuspendReport)]
    restored = [r.restored_bytes for r in reports if isinstance(r, ResumeReport)]
    if freed:
        return {
            "freed_bytes": sum_by_pool(freed),
            "resident_bytes": resident_bytes(reports),
        }
    if restored:
        return {"restored_bytes": sum_by_pool(restored)}
    return {}


class Runner:
    """Runs one model's steps against its engine, writing the outcome into its record."""

    def __init__(
        self,
        record: ModelRecord,
        engine: EngineClient,
        timeouts: TimeoutSettings,
        metrics: Metrics,
        *,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
    ) -> None:
        self.record = record
        self.name = record.name
        self.engine = engine
        self.timeouts = timeouts
        self.metrics = metrics
        self.clock = clock
        self.mono = monotonic
        self.current: Run | None = None  # the run whose steps `run` is running

    # ---- state ---------------------------------------------------------------------------

    def apply(self, event: Event, phase: str | None = None, **changes: Any) -> ModelSnapshot:
        """The one place a state changes."""
        snap = self.record.snapshot
        new = next_state(snap.state, event)
        self.record.update(
            state=new, since=self.clock() if new is not snap.state else snap.since, **changes
        )
        log.info(
            "%s: %s -> %s (%s)",
            self.name,
            snap.state.value,
            new.value,
            event.value,
            extra={"model": self.name, "phase": phase, "rank": None},
        )
        return self.record.snapshot

    def _set_phase(self, phase: str | None) -> None:
        self.record.update(phase=phase)

    # ---- steps ---------------------------------------------------------------------------

    def begin(self, kind: str, level: int | None = None, from_state: State | None = None) -> Run:
        state = self.record.state if from_state is None else from_state
        return Run(kind, state, level, self.clock(), self.mono())

    async def run(
        self, run: Run, steps: Sequence[AnyStep], params: protocol.Params
    ) -> dict[str, tuple[RankReport, ...]]:
        """Run `steps` in order; their reports by phase (also kept in `run.reports`). An
        engine step may change `run.params` for the steps after it."""
        run.params = params
        self.current = run
        try:
            for step in steps:
                run.reports[step.phase] = await self.step(run, step, run.params)
        finally:
            run.cancel_ahead()
            self.current = None
        return run.reports

    async def step(
        self, run: Run, step: AnyStep, params: protocol.Params
    ) -> tuple[RankReport, ...]:
        """Run one step: time it, record it with the per-rank reports, translate failures."""
        self._set_phase(step.phase)
        fields = {"model": self.name, "phase": step.phase, "rank": None}
        log.debug("%s: %s %s", self.name, run.kind, step.phase, extra=fields)
        t0 = self.mono()
        reports: tuple[RankReport, ...] = ()
        try:
            if isinstance(step, protocol.Step):
                reports = await self._rpc(step, params)
                detail = _summary(reports)
            else:
                detail = dict(await step.call(self))
        except HotswapError as exc:
            seconds = self.mono() - t0
            ranks = tuple(exc.ranks) if isinstance(exc, RankError) else ()
            for r in ranks:
                if r.get("ok") is not True:
                    log.error(
                        "%s: %s rank %s: %s",
                        self.name,
                        step.phase,
                        r.get("rank"),
                        r.get("error"),
                        extra={**fields, "rank": r.get("rank")},
                    )
            error = self._translate(step, params, exc)
            run.phases.append(
                PhaseRecord(
                    step.phase, seconds, ok=False, ranks=ranks, detail={"error": error.message}
                )
            )
            self.metrics.phase(self.name, run.kind, step.phase, seconds)
            raise PhaseFailed(step.phase, step.method, error) from exc
        seconds = self.mono() - t0
        run.phases.append(
            PhaseRecord(step.phase, seconds, ranks=tuple(r.raw for r in reports), detail=detail)
        )
        self.metrics.phase(self.name, run.kind, step.phase, seconds)
        log.info("%s: %s %s took %.3f s", self.name, run.kind, step.phase, seconds, extra=fields)
        return reports

    async def _rpc(self, step: protocol.Step, params: protocol.Params) -> tuple[RankReport, ...]:
        ranks = await self.engine.rpc(
            step.method, *step.call_args(params), timeout_s=step.timeout(self.timeouts)
        )
        return step.parse(ranks)

    def _translate(self, step: AnyStep, params: protocol.Params, exc: HotswapError) -> HotswapError:
        """What a step's failure means, by the step's `fault`; anything else as raised."""
        if not isinstance(step, protocol.Step) or step.fault == "rank":
            return exc
        if isinstance(exc, RankError):
            reports = step.parse(exc.ranks)
            if step.fault == "barrier" and (late := late_ranks(reports)):
                return BarrierTimeout(
                    f"{step.phase}: ranks {late} missed the barrier "
                    f"within {params.quiesce_timeout_s:g} s",
                    late_ranks=late,
                    model=self.name,
                )
            if step.fault == "verify" and (names := mismatched(reports)):
                return VerificationFailed(
                    f"{step.phase}: {len(names)} tensors differ after the wake: "
                    + ", ".join(names),
                    tensors=names,
                    model=self.name,
                    phase=step.phase,
                )
        if step.fault == "barrier" and isinstance(exc, EngineTimeout):
            return EngineTimeout(f"{step.phase}: no answer, ranks unknown ({exc.message})")
        return exc

    # ---- outcome -------------------------------------------------------------------------

    def _transition(self, run: Run, to_state: State, result: str, **kw: Any) -> TransitionRecord:
        rec = TransitionRecord(
            kind=run.kind,
            from_state=run.from_state,
            to_state=to_state,
            result=result,
            started_at=run.started_at,
            ended_at=run.started_at + (self.mono() - run.mono_start),
            level=run.level,
            phases=tuple(run.phases),
            **kw,
        )
        self.metrics.transition(
            self.name, run.kind, run.from_state.value, to_state.value, result, rec.duration_s
        )
        return rec

    def count_bytes(self, run: Run) -> None:
        """A transition that succeeded: the bytes its ranks freed or brought back, by pool."""
        reports = [r for rs in run.reports.values() for r in rs]
        freed = [r.freed_bytes for r in reports if isinstance(r, SuspendReport)]
        restored = [r.restored_bytes for r in reports if isinstance(r, ResumeReport)]
        for direction, per_rank in (("released", freed), ("restored", restored)):
            for pool, n in sum_by_pool(per_rank).items():
                self.metrics.bytes(self.name, direction, pool, n)

    def finish(
        self,
        run: Run,
        event: Event,
        to_state: State,
        result: str = "ok",
        *,
        error: str | None = None,
        failed_phase: str | None = None,
        **changes: Any,
    ) -> TransitionRecord:
        """End a transition that did not fail: record it and apply `event`."""
        rec = self._transition(run, to_state, result, error=error, failed_phase=failed_phase)
        self._set_phase(None)
        self.apply(event, phase=failed_phase, last_transition=rec, **changes)
        return rec

    def finish_same(
        self, run: Run, *, error: str | None = None, **changes: Any
    ) -> TransitionRecord:
        """Record a run that left the state as it was (a start-up probe of a known state)."""
        state = self.record.state
        rec = self._transition(run, state, "ok", error=error)
        self._set_phase(None)
        self.record.update(last_transition=rec, **changes)
        return rec

    def discard(self) -> None:
        """End a run that changed nothing (a reconciliation that found the cache right):
        no transition is recorded, only the phase shown is cleared."""
        if self.record.snapshot.phase is not None:
            self._set_phase(None)

    def fail(self, run: Run, failed: PhaseFailed) -> HotswapError:
        """FAILED with the phase and reason kept; returns the error to raise."""
        exc = failed.error
        exc.model = exc.model or self.name
        exc.phase = exc.phase or failed.phase
        if isinstance(exc, VerificationFailed):
            self.metrics.verification_failure(self.name)
        else:
            self.metrics.rpc_error(self.name, failed.method, _reason(exc))
        said = exc.message.startswith(f"{failed.phase}: ")  # e.g. the barrier's own message
        reason = exc.message if said else f"{failed.phase}: {exc.message}"
        rec = self._transition(run, State.FAILED, "failed", error=reason, failed_phase=failed.phase)
        self._set_phase(None)
        self.apply(
            Event.FAIL, phase=failed.phase, verified=False, last_error=reason, last_transition=rec
        )
        log.error(
            "%s: %s failed in %s: %s",
            self.name,
            run.kind,
            failed.phase,
            exc.message,
            extra={"model": self.name, "phase": failed.phase, "rank": None},
        )
        return exc
