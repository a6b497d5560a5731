"""Per-model orchestration of the sleep and wake sequences, and the fleet of models.

Every state change goes through `ModelManager._apply` (state.next_state, `since`, a log
line). Transitions run in one named background task per model, under one lock, so a
cancelled HTTP request never stops an engine sequence halfway and two sequences never
interleave. Any failure after the drain is FAILED: the engine must be restarted, nothing
is retried or resent.

Drain, as measured on vLLM 0.32 (docs/contracts.md, "Measured: pause semantics"):
a `/pause?mode=wait` whose HTTP call times out leaves the engine paused, a `/resume`
unpauses it at once even with the wait pending, and a second `/pause?mode=abort` while a
wait is pending aborts what is left and ends both pauses. A "paused" answer is not proof
(a concurrent /resume wins), so every drain ends by asking `/is_paused`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable, Coroutine, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from controller.engine import EngineClient, RankError
from controller.errors import (
    BarrierTimeout,
    DrainTimeout,
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    HotswapError,
    ModelNotFound,
    TransitionConflict,
    VerificationFailed,
)
from controller.metrics import Metrics
from controller.settings import ModelSettings, Settings, TimeoutSettings
from controller.state import (
    Action,
    Event,
    ModelSnapshot,
    PhaseRecord,
    Request,
    State,
    TransitionRecord,
    decide,
    next_state,
)

log = logging.getLogger("hotswap.manager")

DrainMode = Literal["wait", "abort"]
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


class _PhaseFailed(Exception):
    """Internal: a phase failed; carries what the transition record needs."""

    def __init__(self, phase: str, method: str, error: HotswapError) -> None:
        super().__init__(str(error))
        self.phase = phase
        self.method = method
        self.error = error


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


def _sum_by_pool(ranks: list[dict[str, Any]], key: str) -> dict[str, int]:
    """Per-pool bytes summed over ranks, e.g. every rank's `freed_bytes`."""
    out: dict[str, int] = {}
    for r in ranks:
        per_pool = r.get(key)
        if isinstance(per_pool, dict):
            for pool, n in per_pool.items():
                if isinstance(n, int | float):
                    out[str(pool)] = out.get(str(pool), 0) + int(n)
    return out


class _Run:
    """Bookkeeping of one transition in flight: its phases, in order."""

    def __init__(
        self, kind: str, from_state: State, level: int | None, started_at: float, mono: float
    ) -> None:
        self.mono_start = mono
        self.kind = kind
        self.from_state = from_state
        self.level = level
        self.started_at = started_at
        self.phases: list[PhaseRecord] = []


class ModelManager:
    """One model: its snapshot, its engine adapter and its one transition at a time."""

    def __init__(
        self,
        settings: ModelSettings,
        timeouts: TimeoutSettings,
        engine: EngineClient,
        metrics: Metrics,
        *,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
    ) -> None:
        self.name = settings.name
        self.settings = settings
        self.timeouts = timeouts
        self.engine = engine
        self.metrics = metrics
        self._clock = clock
        self._mono = monotonic
        self._snap = ModelSnapshot(
            name=settings.name, state=State.UNKNOWN, since=clock(), gate=settings.gate
        )
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[Outcome] | None = None
        self._task_kind: Request | None = None
        self._served_model = settings.served_model_name
        # Set once the engine is seen unreachable after a failure: the process was restarted,
        # so its RPC queues are fresh and a new probe is safe.
        self._seen_down_since_failure = False

    # ---- state -------------------------------------------------------------------------

    def snapshot(self) -> ModelSnapshot:
        return self._snap

    @property
    def task(self) -> asyncio.Task[Outcome] | None:
        """The transition in flight, if any."""
        return self._task if self._task is not None and not self._task.done() else None

    def _apply(self, event: Event, phase: str | None = None, **changes: Any) -> ModelSnapshot:
        """The one place a state changes."""
        old = self._snap.state
        new = next_state(old, event)
        self._snap = dataclasses.replace(
            self._snap,
            state=new,
            since=self._clock() if new is not old else self._snap.since,
            **changes,
        )
        log.info(
            "%s: %s -> %s (%s)",
            self.name,
            old.value,
            new.value,
            event.value,
            extra={"model": self.name, "phase": phase, "rank": None},
        )
        return self._snap

    def _set_phase(self, phase: str | None) -> None:
        """Which phase is running now, for GET /models while a transition is in flight."""
        extra = dict(self._snap.extra)
        if phase is None:
            extra.pop("phase", None)
        else:
            extra["phase"] = phase
        self._snap = dataclasses.replace(self._snap, extra=extra)

    def _refuse(self, req: Request) -> TransitionConflict:
        state = self._snap.state
        if state is State.FAILED:
            why = f"the model is FAILED ({self._snap.last_error}); restart its engine"
        elif state in (State.UNKNOWN, State.STARTING):
            why = f"the model is {state.value}: not probed or not started yet"
        elif state is State.STOPPED:
            why = "the model's engine is stopped"
        else:
            other = "wake" if req is Request.SLEEP else "sleep"
            why = f"a {other} is in flight (state {state.value})"
        return TransitionConflict(f"cannot {req.value} {self.name}: {why}", model=self.name)

    # ---- requests ----------------------------------------------------------------------

    def _begin(
        self, req: Request, make: Callable[[], Coroutine[Any, Any, Outcome]]
    ) -> tuple[Action, asyncio.Task[Outcome] | None]:
        """Decide, and for BEGIN change state and start the task; no await in between."""
        action = decide(self._snap.state, req)
        if action is Action.CONFLICT:
            raise self._refuse(req)
        if action is Action.NOOP:
            return action, None
        if action is Action.JOIN:
            if self._task is None or self._task_kind is not req:
                raise self._refuse(req)  # a transition not started by this manager: refuse
            return action, self._task
        self._apply(Event.SLEEP if req is Request.SLEEP else Event.WAKE, verified=False)
        task = asyncio.create_task(make(), name=f"hotswap-{req.value}-{self.name}")
        task.add_done_callback(self._task_died)
        self._task, self._task_kind = task, req
        return action, task

    def _task_died(self, task: asyncio.Task[Outcome]) -> None:
        """Every transition task logs its own end (and retrieves its exception)."""
        fields = {"model": self.name, "phase": None, "rank": None}
        if task.cancelled():
            log.warning("%s: task %s cancelled", self.name, task.get_name(), extra=fields)
            return
        exc = task.exception()
        if exc is None:
            log.debug("%s: task %s finished", self.name, task.get_name(), extra=fields)
        else:
            log.warning("%s: task %s ended: %s", self.name, task.get_name(), exc, extra=fields)

    async def _await(self, action: Action, task: asyncio.Task[Outcome] | None) -> Outcome:
        if task is None:
            return Outcome(action, self._snap, None)
        # shield: a caller that goes away does not cancel the engine sequence.
        outcome = await asyncio.shield(task)
        return Outcome(action, self._snap, outcome.transition)

    def begin_sleep(
        self,
        level: int | None = None,
        drain: DrainMode = "wait",
        drain_timeout_s: float | None = None,
    ) -> Outcome:
        """Start a sleep in the background and return at once (the API's ?wait=false)."""
        action, _ = self._sleep_task(level, drain, drain_timeout_s)
        return Outcome(action, self._snap, None)

    def begin_wake(self) -> Outcome:
        action, _ = self._begin(Request.WAKE, self._wake)
        return Outcome(action, self._snap, None)

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

    # ---- phases ------------------------------------------------------------------------

    async def _phase(
        self,
        run: _Run,
        name: str,
        method: str,
        call: Callable[[], Coroutine[Any, Any, list[dict[str, Any]] | None]],
        detail: Callable[[list[dict[str, Any]]], Mapping[str, Any]] | None = None,
    ) -> list[dict[str, Any]]:
        """Run one phase: time it, record it with the per-rank reports, translate failures."""
        self._set_phase(name)
        fields = {"model": self.name, "phase": name, "rank": None}
        log.debug("%s: %s %s", self.name, run.kind, name, extra=fields)
        t0 = self._mono()
        try:
            ranks = await call() or []
        except HotswapError as raised:
            seconds = self._mono() - t0
            reports = raised.ranks if isinstance(raised, RankError) else []
            exc = raised.translated if isinstance(raised, _Late) else raised
            for r in reports:
                if r.get("ok") is not True:
                    log.error(
                        "%s: %s rank %s: %s",
                        self.name,
                        name,
                        r.get("rank"),
                        r.get("error"),
                        extra={**fields, "rank": r.get("rank")},
                    )
            run.phases.append(
                PhaseRecord(
                    name, seconds, ok=False, ranks=tuple(reports), detail={"error": exc.message}
                )
            )
            self.metrics.phase(self.name, run.kind, name, seconds)
            raise _PhaseFailed(name, method, exc) from exc
        seconds = self._mono() - t0
        run.phases.append(
            PhaseRecord(
                name, seconds, ranks=tuple(ranks), detail=dict(detail(ranks)) if detail else {}
            )
        )
        self.metrics.phase(self.name, run.kind, name, seconds)
        log.info("%s: %s %s took %.3f s", self.name, run.kind, name, seconds, extra=fields)
        return ranks

    def _record(self, run: _Run, to_state: State, result: str, **kw: Any) -> TransitionRecord:
        rec = TransitionRecord(
            kind=run.kind,
            from_state=run.from_state,
            to_state=to_state,
            result=result,
            started_at=run.started_at,
            ended_at=run.started_at + (self._mono() - run.mono_start),
            level=run.level,
            phases=tuple(run.phases),
            **kw,
        )
        self.metrics.transition(
            self.name, run.kind, run.from_state.value, to_state.value, result, rec.duration_s
        )
        return rec

    def _fail(self, run: _Run, failed: _PhaseFailed) -> HotswapError:
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
        rec = self._record(run, State.FAILED, "failed", error=reason, failed_phase=failed.phase)
        self._set_phase(None)
        self._apply(
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

    async def _guarded(
        self, run: _Run, body: Callable[[], Coroutine[Any, Any, Outcome]]
    ) -> Outcome:
        """Run a sequence under the model's lock; every failure ends in FAILED."""
        async with self._lock:
            try:
                return await body()
            except _PhaseFailed as failed:
                raise self._fail(run, failed) from failed.error
            except asyncio.CancelledError:
                err = EngineError("cancelled at shutdown: the engine is in an unknown state")
                phase = str(self._snap.extra.get("phase", run.kind))
                self._fail(run, _PhaseFailed(phase, "cancelled", err))
                raise
            except (DrainTimeout, TransitionConflict):
                raise
            except Exception as exc:  # a bug must not leave the model SUSPENDING forever
                err = EngineError(f"internal error: {type(exc).__name__}: {exc}")
                phase = str(self._snap.extra.get("phase", run.kind))
                raise self._fail(run, _PhaseFailed(phase, "internal", err)) from exc

    # ---- sleep -------------------------------------------------------------------------

    async def _sleep(self, level: int, drain: DrainMode, grace: float) -> Outcome:
        run = _Run("sleep", State.RUNNING, level, self._clock(), self._mono())
        return await self._guarded(run, lambda: self._sleep_body(run, level, drain, grace))

    async def _sleep_body(self, run: _Run, level: int, drain: DrainMode, grace: float) -> Outcome:
        if drain == "wait":
            drained = await self._phase(run, "drain", "/pause", lambda: self._drain_wait(grace))
        else:
            drained = await self._phase(run, "drain", "/pause", lambda: self._drain_abort(grace))
        if drained and drained[0].get("gave_up"):
            return self._gave_up(run, grace)
        await self._phase(run, "quiesce", "hotswap_quiesce", self._quiesce)
        await self._phase(
            run,
            "prepare",
            "hotswap_prepare",
            lambda: self.engine.rpc("hotswap_prepare", level, timeout_s=self.timeouts.rpc_s),
        )
        ranks = await self._phase(
            run,
            "suspend",
            "hotswap_suspend",
            lambda: self.engine.rpc("hotswap_suspend", level, timeout_s=self.timeouts.rpc_s),
            detail=lambda rs: {"freed_bytes": _sum_by_pool(rs, "freed_bytes")},
        )
        for pool, n in _sum_by_pool(ranks, "freed_bytes").items():
            self.metrics.bytes(self.name, "released", pool, n)
        rec = self._record(run, State.SUSPENDED, "ok")
        self._set_phase(None)
        self._apply(Event.SLEEP_DONE, level=level, last_transition=rec, last_error=None)
        return Outcome(Action.BEGIN, self._snap, rec)

    async def _drain_wait(self, grace: float) -> list[dict[str, Any]]:
        """Pause once in-flight requests finished; if they outlast `grace`, give up resumed."""
        try:
            await self.engine.pause("wait", clear_cache=True, timeout_s=grace)
        except EngineTimeout:
            # Measured: the engine stays paused after the HTTP timeout; undo that and check.
            await self.engine.resume()
            if await self.engine.is_paused():
                raise EngineError(
                    "drain gave up, but the engine is still paused after /resume"
                ) from None
            return [{"gave_up": True}]
        await self._ensure_paused()
        return [{"mode": "wait"}]

    async def _drain_abort(self, grace: float) -> list[dict[str, Any]]:
        """Give in-flight requests `grace` seconds, then abort the rest."""
        waited = False
        if grace > 0:
            try:
                # New requests queue from now on; those in flight may finish within the grace.
                await self.engine.pause("wait", clear_cache=True, timeout_s=grace)
                waited = True
            except EngineTimeout:
                pass  # measured: a second /pause?mode=abort ends the pending wait
        if not waited:
            await self.engine.pause("abort", clear_cache=True)
        await self._ensure_paused()
        return [{"mode": "abort", "aborted": not waited}]

    async def _ensure_paused(self) -> None:
        # A "paused" answer is not proof: a /resume sent meanwhile unpauses at once (measured).
        if not await self.engine.is_paused():
            raise EngineError(
                "the engine answered /pause but is not paused (resumed by someone else?)"
            )

    def _gave_up(self, run: _Run, grace: float) -> Outcome:
        msg = f"drain=wait: in-flight requests did not finish within {grace:g} s; engine resumed"
        rec = self._record(run, State.RUNNING, "gave_up", error=msg, failed_phase="drain")
        self._set_phase(None)
        # Nothing was touched: the model is as verified as before the sleep was asked for.
        self._apply(Event.SLEEP_GAVE_UP, phase="drain", verified=True, last_transition=rec)
        raise DrainTimeout(msg, model=self.name, phase="drain")

    async def _quiesce(self) -> list[dict[str, Any]]:
        # The barrier timeout is an argument to the ranks; the HTTP timeout must outlast it.
        http_s = max(self.timeouts.rpc_s, self.timeouts.quiesce_s + self.timeouts.control_s)
        try:
            ranks = await self.engine.rpc(
                "hotswap_quiesce", self.timeouts.quiesce_s, timeout_s=http_s
            )
        except RankError as exc:
            late = sorted({int(n) for r in exc.ranks for n in r.get("late_ranks") or []})
            if late:
                err = BarrierTimeout(
                    f"quiesce: ranks {late} missed the barrier "
                    f"within {self.timeouts.quiesce_s:g} s",
                    late_ranks=late,
                    model=self.name,
                )
                raise _Late(err, exc.ranks) from exc
            raise
        except EngineTimeout as exc:
            raise EngineTimeout(f"quiesce: no answer, ranks unknown ({exc.message})") from exc
        return ranks

    # ---- wake --------------------------------------------------------------------------

    async def _wake(self) -> Outcome:
        level = self._snap.level or 1
        run = _Run("wake", State.SUSPENDED, level, self._clock(), self._mono())
        return await self._guarded(run, lambda: self._wake_body(run, level))

    async def _wake_body(self, run: _Run, level: int) -> Outcome:
        restored: dict[str, int] = {}

        def resumed(rs: list[dict[str, Any]]) -> Mapping[str, Any]:
            got = _sum_by_pool(rs, "restored_bytes")
            for pool, n in got.items():
                restored[pool] = restored.get(pool, 0) + n
            return {"restored_bytes": got}

        rpc_s = self.timeouts.rpc_s
        await self._phase(
            run,
            "resume_weights",
            "hotswap_resume",
            lambda: self.engine.rpc("hotswap_resume", ["weights"], timeout_s=rpc_s),
            detail=resumed,
        )
        if level == 2:
            await self._phase(
                run,
                "reload",
                "hotswap_reload",
                lambda: self.engine.rpc("hotswap_reload", timeout_s=self.timeouts.reload_s),
            )
        await self._phase(
            run,
            "resume_kv_cache",
            "hotswap_resume",
            lambda: self.engine.rpc("hotswap_resume", ["kv_cache"], timeout_s=rpc_s),
            detail=resumed,
        )
        await self._phase(run, "restore_and_verify", "hotswap_restore_and_verify", self._verify)
        await self._phase(run, "resume_engine", "/resume", self._resume_engine)
        await self._phase(run, "warmup", "/v1/completions", self._warmup)
        for pool, n in restored.items():
            self.metrics.bytes(self.name, "restored", pool, n)
        rec = self._record(run, State.RUNNING, "ok")
        self._set_phase(None)
        self._apply(
            Event.WAKE_DONE, verified=True, level=None, last_transition=rec, last_error=None
        )
        return Outcome(Action.BEGIN, self._snap, rec)

    async def _verify(self) -> list[dict[str, Any]]:
        try:
            return await self.engine.rpc(
                "hotswap_restore_and_verify", timeout_s=self.timeouts.rpc_s
            )
        except RankError as exc:
            names = sorted({str(n) for r in exc.ranks for n in r.get("mismatched") or []})
            if names:
                err = VerificationFailed(
                    f"restore_and_verify: {len(names)} tensors differ after the wake: "
                    + ", ".join(names),
                    tensors=names,
                    model=self.name,
                )
                raise _Late(err, exc.ranks) from exc
            raise

    async def _resume_engine(self) -> list[dict[str, Any]]:
        await self.engine.resume()
        if await self.engine.is_paused():
            raise EngineError("the engine is still paused after /resume")
        return []

    async def _warmup(self) -> list[dict[str, Any]]:
        if self._served_model is None:
            self._served_model = await self.engine.served_model()
        seconds = await self.engine.warmup(self._served_model)
        return [{"warmup_s": seconds}]

    # ---- probe and pass-through ---------------------------------------------------------

    async def probe(self) -> ModelSnapshot:
        """Start-up: ask the engine what it is doing; -> RUNNING, SUSPENDED or FAILED."""
        async with self._lock:
            run = _Run("start", self._snap.state, None, self._clock(), self._mono())
            try:
                ranks = await self._phase(run, "health", "/health", self._probe_health)
                ranks = await self._phase(
                    run,
                    "info",
                    "hotswap_info",
                    lambda: self.engine.rpc("hotswap_info", timeout_s=self.timeouts.rpc_s),
                )
            except _PhaseFailed as failed:
                self._fail(run, failed)
                return self._snap
            suspended = [r for r in ranks if r.get("suspended")]
            self._set_phase(None)
            if self._snap.state is State.STARTING:
                # A managed engine just booted: it serves (nothing of it can be suspended yet).
                rec = self._record(run, State.RUNNING, "ok")
                self._apply(Event.STARTED, verified=True, level=None, last_transition=rec)
            elif suspended:
                level = next(
                    (r["level"] for r in suspended if isinstance(r.get("level"), int)), None
                )
                if level is None:
                    kinds = {v for r in suspended for v in dict(r["suspended"]).values()}
                    level = 2 if "discarded" in kinds and len(kinds) == 1 else 1
                rec = self._record(run, State.SUSPENDED, "ok")
                self._apply(
                    Event.PROBED_SUSPENDED, verified=False, level=level, last_transition=rec
                )
            else:
                rec = self._record(run, State.RUNNING, "ok")
                self._apply(Event.PROBED_RUNNING, verified=True, level=None, last_transition=rec)
            return self._snap

    def mark_starting(self) -> None:
        """Managed engine: its process is being (re)started; `probe` then makes it RUNNING."""
        self._apply(Event.START, verified=False, level=None)

    def mark_failed(self, reason: str) -> None:
        """Managed engine: its process died, or it is restarted after a FAILED transition."""
        if self._snap.state is not State.FAILED:
            self._apply(Event.FAIL, verified=False, last_error=reason)

    async def check_recovered(self) -> bool:
        """Attached engine in FAILED: probe it afresh once it is safe to, i.e. when it failed
        before ever being reached, or after it was seen down (restarted, so its RPC reply
        queues are fresh). An engine that stayed up after a failed RPC is never called again:
        its replies may be out of step. Returns True when a new probe ran."""
        if self._snap.state is not State.FAILED or self._lock.locked():
            return False
        try:
            up = await self.engine.health(timeout_s=self.timeouts.probe_s)
        except EngineError:
            up = False
        if not up:
            self._seen_down_since_failure = True
            return False
        last = self._snap.last_transition
        never_reached = last is not None and last.kind == "start" and last.failed_phase == "health"
        if not (never_reached or self._seen_down_since_failure):
            return False
        log.info(
            "%s: engine answers again after a failure; probing it afresh",
            self.name,
            extra={"model": self.name, "phase": "probe", "rank": None},
        )
        self._seen_down_since_failure = False
        await self.probe()
        return True

    async def _probe_health(self) -> list[dict[str, Any]]:
        if not await self.engine.health(timeout_s=self.timeouts.probe_s):
            raise EngineError("/health answered 503: the engine is dead")
        return []

    async def _passthrough(self, method: str, *args: Any) -> list[dict[str, Any]]:
        """An RPC outside a transition; a failure is FAILED too (the queues may be out of step)."""
        if self._snap.state not in (
            State.RUNNING,
            State.SUSPENDED,
            State.SUSPENDING,
            State.RESUMING,
        ):
            raise TransitionConflict(
                f"cannot call {method} on {self.name} in state {self._snap.state.value}",
                model=self.name,
            )
        async with self._lock:
            run = _Run(method, self._snap.state, None, self._clock(), self._mono())
            try:
                return await self._phase(
                    run,
                    method,
                    method,
                    lambda: self.engine.rpc(method, *args, timeout_s=self.timeouts.rpc_s),
                )
            except _PhaseFailed as failed:
                raise self._fail(run, failed) from failed.error

    async def audit(self, level: int, detail: bool = True) -> list[dict[str, Any]]:
        return await self._passthrough("hotswap_audit", level, detail)

    async def info(self) -> list[dict[str, Any]]:
        return await self._passthrough("hotswap_info")


def _log_task_end(task: asyncio.Task[None]) -> None:
    """A background task of the fleet logs its own death at once."""
    if task.cancelled():
        log.debug("task %s cancelled", task.get_name())
    elif (exc := task.exception()) is not None:
        log.error("task %s died: %r", task.get_name(), exc, exc_info=exc)


class _Late(RankError):
    """A rank-level failure already translated (late ranks, mismatched tensors)."""

    def __init__(self, err: HotswapError, ranks: list[dict[str, Any]]) -> None:
        super().__init__(err.message, method="", ranks=ranks)
        self.translated = err


class Manager:
    """The fleet: one ModelManager per configured model."""

    def __init__(
        self,
        settings: Settings,
        metrics: Metrics,
        engine_factory: EngineFactory = default_engine_factory,
        clock: Clock = time.time,
        *,
        monotonic: Clock = time.monotonic,
    ) -> None:
        self.settings = settings
        self.metrics = metrics
        self._models: dict[str, ModelManager] = {
            m.name: ModelManager(
                m,
                settings.timeouts,
                engine_factory(m, settings.timeouts),
                metrics,
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

    def __iter__(self) -> Any:
        return iter(self._models.values())

    def snapshots(self) -> dict[str, ModelSnapshot]:
        return {name: m.snapshot() for name, m in self._models.items()}

    async def start(self) -> None:
        """Probe every engine at once; an unreachable one is FAILED, not fatal to the sidecar.
        Managed engines are left UNKNOWN: the supervisor starts and probes them. Attached
        engines that are FAILED are then watched until they come back (`check_recovered`)."""
        attached = [m for m in self._models.values() if not m.settings.managed]
        await asyncio.gather(*(m.probe() for m in attached))
        if attached:
            self._watcher = asyncio.create_task(self._watch(attached), name="watch-attached")
            self._watcher.add_done_callback(_log_task_end)

    async def _watch(self, models: list[ModelManager]) -> None:
        interval = self.settings.timeouts.reprobe_interval_s
        while True:
            await asyncio.sleep(interval)
            await asyncio.gather(*(m.check_recovered() for m in models), return_exceptions=True)

    async def stop(self) -> None:
        """Wait up to timeouts.shutdown_s for transitions in flight, cancel the rest, close."""
        if self._watcher is not None:
            self._watcher.cancel()
            await asyncio.gather(self._watcher, return_exceptions=True)
        tasks = [t for m in self._models.values() if (t := m.task) is not None]
        if tasks:
            log.info(
                "waiting up to %g s for %d transitions",
                self.settings.timeouts.shutdown_s,
                len(tasks),
            )
            _, pending = await asyncio.wait(tasks, timeout=self.settings.timeouts.shutdown_s)
            for t in pending:
                t.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.gather(
            *(m.engine.aclose() for m in self._models.values()), return_exceptions=True
        )
