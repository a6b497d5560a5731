"""One model's requests and sequences, run by its `Runner`.

A `ModelManager` decides what a sleep or wake request does (state.decide: begin, join, no-op
or refuse), and runs the sequence it begins through its `Runner`, which times, records and
maps errors: a sleep is `steps.sleep_sequence` (drain + the protocol's RPCs), a wake is
`steps.wake_sequence` (the protocol's RPCs + /resume + warm-up). Each transition runs in one
named task of the sidecar's task group, under one lock per model, so a cancelled HTTP
request never stops an engine sequence halfway and two sequences never interleave. Any
failure after the drain is FAILED: the engine must be restarted, nothing is retried or
resent. Reading the engine back (start-up, after a failed step, periodically) is the
`Reconciler`'s; the read-only pass-through RPCs (audit, info) run under the same lock.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from controller import protocol
from controller.config.settings import TimeoutSettings
from controller.engines.checkpoint import Checkpointer
from controller.engines.engine import EngineClient
from controller.errors import DrainTimeout, EngineError, TransitionConflict
from controller.models import steps, vllmsleep
from controller.models.deepsleep import DeepSleep
from controller.models.footprints import copied_weights, freed_by_pool, pools_from_info
from controller.models.passthrough import PassThrough
from controller.models.reconciler import Reconciler
from controller.models.record import ModelRecord
from controller.models.runner import AnyStep, PhaseFailed, Run, Runner
from controller.models.steps import DrainMode
from controller.observe.metrics import Metrics
from controller.reports import RankReport, resident_bytes, wake_scratch_bytes
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
from controller.tasks import Tasks

log = logging.getLogger("hotswap.manager")

Clock = Callable[[], float]


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
        checkpointer: Checkpointer | None = None,
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
        self.deep = DeepSleep(record, checkpointer, metrics, self.runner, self._lock)
        self.reconciler = Reconciler(record, engine, self.runner, timeouts, self.deep)
        self.passthrough = PassThrough(record, self.runner, self.reconciler, self._lock)

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
        rec.begin(task, req)
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
        *,
        keep_prefix_cache: bool | None = None,
        deep: bool = False,
    ) -> Outcome:
        """Start a sleep in the background and return at once (the API's ?wait=false); a
        deep one only after `check_deep` said yes."""
        action, _ = self._sleep_task(
            level, drain, drain_timeout_s, keep_prefix_cache=keep_prefix_cache, deep=deep
        )
        return Outcome(action, self.record.snapshot, None)

    def begin_wake(self) -> Outcome:
        action, _ = self._begin(Request.WAKE, self._wake)
        return Outcome(action, self.record.snapshot, None)

    async def sleep(
        self,
        level: int | None = None,
        drain: DrainMode = "wait",
        drain_timeout_s: float | None = None,
        *,
        kv_released: Callable[[], None] | None = None,
        keep_prefix_cache: bool | None = None,
        deep: bool | None = None,
    ) -> Outcome:
        """`kv_released`: suspend the KV cache alone first and call it then, before the
        weights are suspended (an overlapped swap, controller.fleet.swap). `keep_prefix_cache`
        None: the model's setting (docs/contracts.md §1.3); `deep` None: its `deep_sleep`
        (§2.2); deep asked of a model asleep, not deep, deepens it."""
        want = await self.check_deep(deep)
        if want and self.record.state is State.SUSPENDED and not self.snapshot().deep:
            return Outcome(Action.BEGIN, await self.deepen(), self.record.snapshot.last_transition)
        action, task = self._sleep_task(
            level, drain, drain_timeout_s, kv_released, keep_prefix_cache, want
        )
        return await self._await(action, task)

    async def check_deep(self, deep: bool | None) -> bool:
        """Whether a sleep asked with `deep` is deep (DeepSleep.wanted: 422 where it cannot)."""
        return await self.deep.wanted(deep)

    async def wake(self, *, room: Callable[[], Awaitable[None]] | None = None) -> Outcome:
        """`room`: awaited after the weights are back and before the KV cache is mapped
        (an overlapped swap: the evicted model's weights are still leaving the device)."""
        action, task = self._begin(Request.WAKE, lambda: self._wake(room))
        return await self._await(action, task)

    def _sleep_task(
        self,
        level: int | None,
        drain: DrainMode,
        drain_timeout_s: float | None,
        kv_released: Callable[[], None] | None = None,
        keep_prefix_cache: bool | None = None,
        deep: bool = False,
    ) -> tuple[Action, asyncio.Task[Outcome] | None]:
        lvl = self.settings.default_level if level is None else level
        if lvl not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {lvl}")
        if keep_prefix_cache and lvl != 1:
            raise ValueError(f"keep_prefix_cache applies to level 1 only ({steps.LEVEL2_KV})")
        keep = self.settings.keep_prefix_cache if keep_prefix_cache is None else keep_prefix_cache
        if drain not in ("wait", "abort"):
            raise ValueError(f"drain must be 'wait' or 'abort', not {drain!r}")
        if drain_timeout_s is None:
            grace = self.timeouts.drain_s if drain == "wait" else 0.0
        else:
            grace = drain_timeout_s
        if grace < 0:
            raise ValueError("drain_timeout_s must be >= 0")
        return self._begin(
            Request.SLEEP, lambda: self._sleep(lvl, drain, grace, kv_released, keep, deep)
        )

    # ---- the sequences -------------------------------------------------------------------

    async def _sleep(
        self,
        level: int,
        drain: DrainMode,
        grace: float,
        kv_released: Callable[[], None] | None = None,
        keep_kv: bool = False,
        deep: bool = False,
    ) -> Outcome:
        run = self.runner.begin("sleep", level, State.RUNNING)
        if self.settings.sleep_driver == "vllm":  # vLLM's own /sleep (§2.3)
            return await self._sleep_vllm(run, level, drain, grace, kv_released)
        params = protocol.Params(
            level=level, quiesce_timeout_s=self.timeouts.quiesce_s, keep_kv=keep_kv and level == 1
        )
        sequence = steps.sleep_sequence(
            level, drain, grace, kv_released, keep_kv=keep_kv, fused=self.settings.fused_sleep
        )
        reports = await self._guarded(run, sequence, params)
        self.runner.count_bytes(run)
        sent = [r for rs in run.reports.values() for r in rs]
        self._learn_pools(freed_by_pool(sent), "bytes freed at sleep")
        self.record.facts.all_pools_moved()  # every pool the level releases
        # what the last suspend's ranks say they left on their devices
        last = next(  # the sequence's last suspend (the fused sleep's one RPC, or the weights')
            s for s in reversed(sequence) if isinstance(s, protocol.Step) and s.suspends
        )
        scratch = wake_scratch_bytes(reports.get(last.phase, ()))
        self.record.holdings.slept(copied_weights(sent), scratch)
        changes: dict[str, Any] = {
            "resident_bytes": resident_bytes(reports.get(last.phase, ())),
            "deep": False,
            "deep_error": None,
        }
        if deep:
            if changes["resident_bytes"] is not None:  # what it holds beside its pools awake
                self.record.holdings.left_on_device(changes["resident_bytes"])
            changes |= await self.deep.after_sleep(run, params)
        rec = self.runner.finish(
            run, Event.SLEEP_DONE, State.SUSPENDED, level=level, last_error=None, **changes
        )
        return Outcome(Action.BEGIN, self.record.snapshot, rec)

    async def _sleep_vllm(
        self,
        run: Run,
        level: int,
        drain: DrainMode,
        grace: float,
        kv_released: Callable[[], None] | None,
    ) -> Outcome:
        sequence = vllmsleep.sleep_sequence(level, drain, grace)
        reports = await self._guarded(run, sequence, protocol.Params(level=level))
        if kv_released is not None:  # never split (no overlap beside it): all is released
            kv_released()
        self.record.facts.all_pools_moved()
        self.record.holdings.slept(0, 0)
        held = vllmsleep.resident(reports.get(protocol.INFO.phase, ()))
        rec = self.runner.finish(
            run, Event.SLEEP_DONE, State.SUSPENDED, level=level, last_error=None,
            resident_bytes=held, deep=False, deep_error=None,
        )  # fmt: skip
        return Outcome(Action.BEGIN, self.record.snapshot, rec)

    def _gave_up(self, run: Run, exc: DrainTimeout) -> DrainTimeout:
        # Nothing was touched: the model is as verified as before the sleep was asked for.
        self.runner.finish(
            run, Event.SLEEP_GAVE_UP, State.RUNNING, "gave_up", error=exc.message,
            failed_phase="drain", verified=True,
        )  # fmt: skip
        return exc

    async def deepen(self) -> ModelSnapshot:
        """Asleep, not deep: checkpoint its engine now (DeepSleep.deepen)."""
        await self.deep.check()
        return await self.deep.deepen()

    async def restore_ahead(self) -> ModelSnapshot:
        """Deep and asleep: restore its engine now, before its wake (DeepSleep.restore_ahead)."""
        return await self.deep.restore_ahead()

    async def _wake(self, room: Callable[[], Awaitable[None]] | None = None) -> Outcome:
        async with self._lock:
            # The level, the pools asleep and whether it is deep are read under the lock: a
            # demotion, a deepening or a restore ahead in flight (each holds the lock) ends
            # first. One that failed left the model FAILED: nothing more is sent (never a
            # second restore on the same process).
            if self.record.state is not State.RESUMING:
                snap = self.record.snapshot
                raise TransitionConflict(
                    f"cannot wake {self.name}: {snap.state.value} ({snap.last_error})",
                    model=self.name,
                )
            level = self.record.snapshot.level
            run = self.runner.begin("wake", level or 1, State.SUSPENDED)
            if self.record.snapshot.deep:
                await self._run_guarded(run, (self.deep.restore_step(),), protocol.Params())
                if level is None:  # found deep by a restarted sidecar: the ranks say
                    info = await self._run_guarded(run, (protocol.INFO,), protocol.Params())
                    told = [getattr(r, "level", None) for r in info[protocol.INFO.phase]]
                    level = max((lv for lv in told if lv), default=1)
            kind = self.record.facts.vllm_asleep
            if kind is not None and self.settings.sleep_driver == "vllm":
                sequence = vllmsleep.wake_sequence(level, kind)  # vLLM's own /wake_up (§2.3)
            else:
                sequence = steps.wake_sequence(
                    level or 1, self.record.facts.asleep, room, fused=self.settings.fused_wake
                )
            params = protocol.Params(level=level or 1, quiesce_timeout_s=self.timeouts.quiesce_s)
            await self._run_guarded(run, sequence, params)
        unverified = kind == vllmsleep.PLAIN and self.settings.sleep_driver == "vllm"
        if unverified:
            self.metrics.unverified_wake(self.name)
            log.warning(
                "%s: woken through vLLM's own /wake_up, which nothing verified: served "
                "unverified because accept_unverified_wake is set",
                self.name,
                extra={"model": self.name},
            )
        self.record.facts.all_pools_moved()
        self.record.holdings.woke(self.record.leftover_bytes)
        self.runner.count_bytes(run)
        rec = self.runner.finish(
            run,
            Event.WAKE_DONE,
            State.RUNNING,
            verified=not unverified,
            unverified_wake=unverified,
            level=None,
            last_error=None,
            resident_bytes=None,
        )
        return Outcome(Action.BEGIN, self.record.snapshot, rec)

    async def _guarded(
        self, run: Run, sequence: tuple[AnyStep, ...], params: protocol.Params
    ) -> dict[str, tuple[RankReport, ...]]:
        """Run a sequence under the model's lock; every failure but a drain that gave up
        (DrainTimeout: still RUNNING, nothing touched) ends in FAILED."""
        async with self._lock:
            return await self._run_guarded(run, sequence, params)

    async def _run_guarded(
        self, run: Run, sequence: tuple[AnyStep, ...], params: protocol.Params
    ) -> dict[str, tuple[RankReport, ...]]:
        """`_guarded`'s body, for a caller that holds the model's lock."""
        try:
            return await self.runner.run(run, sequence, params)
        except PhaseFailed as failed:
            if isinstance(failed.error, DrainTimeout):
                raise self._gave_up(run, failed.error) from None
            self.reconciler.note_failure(failed)
            err = self.runner.fail(run, failed)
            # The ranks say what the failed step left: read it back (never an RPC to an
            # engine whose queues may be out of step).
            await self.reconciler.run(
                "after a failed step", failure=self.record.snapshot.last_error
            )
            raise err from failed.error
        except asyncio.CancelledError:
            err = EngineError("cancelled at shutdown: the engine is in an unknown state")
            phase = self.record.snapshot.phase or run.kind
            self.runner.fail(run, PhaseFailed(phase, "cancelled", err))
            raise
        except TransitionConflict:
            raise
        except Exception as exc:  # a bug must not leave the model SUSPENDING forever
            err = EngineError(f"internal error: {type(exc).__name__}: {exc}")
            phase = self.record.snapshot.phase or run.kind
            raise self.runner.fail(run, PhaseFailed(phase, "internal", err)) from exc

    def _learn_pools(self, pools: dict[str, int], source: str) -> None:
        """Record the pools' measured bytes (nothing measured: kept as they were)."""
        known = self.record.holdings.learn_pools(pools)
        if known is not None:
            log.info("%s: pools %s (%s)", self.name, known, source, extra={"model": self.name})

    # ---- probe and pass-through ----------------------------------------------------------

    async def probe(self) -> ModelSnapshot:
        """Start-up (and a managed engine once it answers): read the engine back and
        reconcile; -> RUNNING, SUSPENDED, FAILED, or a finished interrupted sequence."""
        async with self._lock:
            fresh = self.record.state is State.STARTING
            await self.reconciler.run("start-up", kind="start", fresh=fresh)
            pools = pools_from_info(self.record.snapshot.last_transition)
            self._learn_pools(pools, "hotswap_info pools")
            _footprint_at_start(self.record, sum(pools.values()))
            return self.record.snapshot

    def mark_starting(self) -> None:
        """Managed engine: its process is being (re)started; `probe` then makes it RUNNING.
        The sidecar starts that process itself: whatever an RPC to the old one left out of
        step does not concern it."""
        self.record.facts.new_process()
        self.runner.apply(Event.START, verified=False, level=None)

    async def settled(self) -> ModelSnapshot:
        """Wait until no transition and no reconciliation is in flight (a failed step's
        reconciliation runs inside its transition, under the model's lock), then the model
        as the reconciliation left it: what the supervisor judges a restart by."""
        while (task := self.record.in_flight_task()) is not None or self._lock.locked():
            if task is not None:
                await asyncio.wait({task})
            else:
                async with self._lock:
                    pass
        return self.record.snapshot

    def mark_failed(self, reason: str) -> None:
        """Managed engine: its process died, or it is restarted after a FAILED transition."""
        if self.record.state is not State.FAILED:
            self.runner.apply(Event.FAIL, verified=False, last_error=reason)

    async def check_recovered(self) -> bool:
        """Attached engine, every `reprobe_interval_s`, in every state but a transition in
        flight: read it back and reconcile (a new process is judged afresh; one whose
        queues may be out of step is sent nothing). True when the state changed or an
        action (resume, finish a wake) ran."""
        rec = self.record
        resting = (State.RUNNING, State.SUSPENDED, State.FAILED, State.UNKNOWN)
        if self._lock.locked() or rec.in_flight_task() is not None or rec.state not in resting:
            return False
        async with self._lock:
            if rec.in_flight_task() is not None or rec.state not in resting:
                return False  # a request began meanwhile: its own sequence goes next
            before = (rec.state, rec.snapshot.verified)
            verdict = await self.reconciler.run("periodic")
            return verdict.sends_rpc or (rec.state, rec.snapshot.verified) != before

    async def demote(self) -> ModelSnapshot:
        return await self.passthrough.demote()

    async def drop_backup(self) -> list[dict[str, Any]]:
        return await self.passthrough.drop_backup()

    async def audit(self, level: int) -> list[dict[str, Any]]:
        return await self.passthrough.audit(level)

    async def info(self) -> list[dict[str, Any]]:
        return await self.passthrough.info()


def _footprint_at_start(rec: ModelRecord, n: int) -> None:
    """The awake footprint from the start probe's pools, where none is known yet (an
    attached engine found asleep is counted at it, not as the largest model known, until
    its first sleep through the sidecar measures what it frees)."""
    held = rec.holdings
    if n > 0 and held.footprint is None and held.learn_footprint(n):
        fields = {"model": rec.name}
        log.info(
            "%s: awake footprint %d bytes (hotswap_info pools at start)", rec.name, n, extra=fields
        )
