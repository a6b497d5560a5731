"""Reads one engine back and applies the one reconciliation (`controller.models.reconcile`) to its
model: the I/O half of it. The caller holds the model's lock.

What is read, in order, and only as far as the verdict needs: `/health` (a recorded phase),
`/is_paused` and the API server's start time on `/metrics` (no RPC), then, when the cache
cannot be trusted and the queues are in step, every rank's `hotswap_info` (a recorded
phase). The verdict's state is applied through the runner; its action (resume the engine,
or finish a wake) runs as steps of a `reconcile` transition. A transition record is kept
only when something changed or ran, or for a start-up probe, so a periodic pass that finds
the cache right leaves the last transition as it was.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from controller import protocol
from controller.config.settings import TimeoutSettings
from controller.engines.engine import EngineClient, RankError
from controller.errors import EngineError
from controller.models import steps
from controller.models.deepsleep import DeepSleep
from controller.models.reconcile import Do, Memory, Observation, Verdict, reconcile
from controller.models.record import ModelRecord
from controller.models.runner import AnyStep, PhaseFailed, Run, Runner
from controller.reports import ranks_from_info
from controller.state import Event, State

log = logging.getLogger("hotswap.reconcile")

# The event that moves a model from any resting state to the verdict's state.
_EVENT = {
    State.RUNNING: Event.PROBED_RUNNING,
    State.SUSPENDED: Event.PROBED_SUSPENDED,
    State.RESUMING: Event.PROBED_UNFINISHED,
    State.FAILED: Event.FAIL,
}

# Where a FAILED verdict's reason is said to come from (the transition's failed phase).
_FAILED_PHASE = {"unreachable": "health", "dead": "health", "info-failed": "info"}


def finish_steps(verdict: Verdict) -> tuple[AnyStep, ...]:
    """What a verdict's action runs: the tail of a wake."""
    if verdict.do is Do.RESUME_ENGINE:
        return (steps.RESUME_ENGINE, steps.WARMUP)
    if verdict.do is Do.FINISH_WAKE:
        reload = (protocol.RELOAD,) if verdict.level == 2 else ()
        return (*reload, protocol.VERIFY, steps.RESUME_ENGINE, steps.WARMUP)
    return ()


class Reconciler:
    def __init__(
        self,
        record: ModelRecord,
        engine: EngineClient,
        runner: Runner,
        timeouts: TimeoutSettings,
        deep: DeepSleep | None = None,
    ) -> None:
        self.deep = deep
        self.record = record
        self.engine = engine
        self.runner = runner
        self.timeouts = timeouts
        self.name = record.name

    def memory(self, fresh: bool = False) -> Memory:
        rec = self.record
        return rec.facts.memory(
            rec.state,
            rec.snapshot.verified,
            fresh,
            accept_unverified=rec.settings.accept_unverified_wake,
            unverified=rec.snapshot.unverified_wake,
        )

    async def run(
        self,
        why: str,
        *,
        kind: str = "reconcile",
        fresh: bool = False,
        failure: str | None = None,
    ) -> Verdict:
        """Observe, decide, apply, act. `kind` names the transition record ("start" for a
        start-up probe, which is always recorded). `failure`: the reason of the step that
        just failed; a FAILED verdict keeps that step's record, any other keeps its reason
        in `last_error`."""
        run = self.runner.begin(kind)
        mem = self.memory(fresh)
        asks = self.record.snapshot.deep or (kind == "start" and not fresh)
        if self.deep is not None and asks and not self.record.facts.desynced:
            # A checkpointed rank answers no RPC: the driver is asked first (§2.2).
            said = await self.deep.read()
            if said in ("deep", "mixed") or (said is None and self.record.snapshot.deep):
                return self._deep_verdict(run, said, why, kind)
            if said == "awake" and self.record.snapshot.deep:
                self.record.update(deep=False)
        obs = await self._observe(run)
        verdict = reconcile(obs, mem)
        if verdict.do is Do.PROBE:
            obs = await self._probe(run, obs)
            verdict = reconcile(obs, mem)
        if self.record.state is not mem.state:
            # A request began meanwhile (it waits for the lock): its sequence goes next.
            self.runner.discard()
            return verdict
        self._remember(verdict)
        await self._apply(run, verdict, why, always=kind == "start", failure=failure)
        return verdict

    def _deep_verdict(self, run: Run, said: str | None, why: str, kind: str) -> Verdict:
        """The driver says the engine is checkpointed (SUSPENDED, deep, nothing sent), its
        processes disagree, or, for a model known deep, nothing can be read (FAILED)."""
        snap = self.record.snapshot
        if said == "deep":
            v = Verdict("deep", State.SUSPENDED, Do.NONE, "checkpointed", level=snap.level)
            if snap.state is State.SUSPENDED and snap.deep and kind != "start":
                self.runner.discard()
                return v
            log.info("%s: reconciled (%s): deep asleep (driver state)", self.name, why)
            changes: dict[str, Any] = {"deep": True, "level": snap.level, "verified": False}
            if snap.state is State.SUSPENDED:
                self.runner.finish_same(run, **changes)
            else:
                self.runner.finish(run, Event.PROBED_SUSPENDED, State.SUSPENDED, **changes)
            return v
        reason = (
            "the engine's CUDA processes disagree (some checkpointed, some not)"
            if said == "mixed"
            else "a deep sleeper's processes cannot be read back by the driver"
        )
        self.runner.finish(
            run, Event.FAIL, State.FAILED, "failed", error=f"reconcile: {reason}",
            failed_phase="reconcile", verified=False, last_error=f"reconcile: {reason}",
        )  # fmt: skip
        return Verdict("deep-" + (said or "unread"), State.FAILED, Do.NONE, reason)

    # ---- reading -------------------------------------------------------------------------

    async def _observe(self, run: Run) -> Observation:
        """What can be read without an RPC (no phase is recorded for it)."""
        try:
            alive = await self.engine.health(timeout_s=self.timeouts.probe_s)
        except EngineError as exc:
            return Observation(reachable=False, detail=exc.message)
        if not alive:
            return Observation(reachable=True, alive=False)
        try:
            paused = await self.engine.is_paused()
        except EngineError as exc:
            return Observation(reachable=False, detail=f"/is_paused: {exc.message}")
        try:
            sleeping: bool | None = await self.engine.is_sleeping()
        except EngineError:
            sleeping = None  # an engine without the endpoint: the ranks still tell
        try:
            sign = await self.engine.process_start()
        except EngineError:
            sign = None
        return Observation(reachable=True, paused=paused, sleeping=sleeping, process=sign)

    async def _probe(self, run: Run, obs: Observation) -> Observation:
        try:
            reports = await self.runner.step(run, protocol.INFO, protocol.Params())
        except PhaseFailed as failed:
            err = failed.error
            if isinstance(err, RankError):
                return dataclasses.replace(obs, ranks=ranks_from_info(err.ranks))
            return dataclasses.replace(obs, info_error=err.message, info_may_desync=err.may_desync)
        run.reports[protocol.INFO.phase] = reports  # read by a resume_engine that follows
        ranks = ranks_from_info([r.raw for r in reports])
        try:  # which names the API server serves: the engine's identity (no RPC)
            served: tuple[str, ...] | None = await self.engine.served_models()
        except EngineError:
            served = None
        return dataclasses.replace(obs, ranks=ranks, served=served)

    def _remember(self, v: Verdict) -> None:
        rec = self.record
        if v.new_process:
            log.warning(
                "%s: the engine is a new process (restarted); judged afresh",
                self.name,
                extra={"model": self.name, "phase": "reconcile", "rank": None},
            )
        rec.facts.remember(v)
        if v.rule == "suspended":  # read from the ranks (a cache-fits verdict says nothing)
            rec.holdings.learn_wake_scratch(v.wake_scratch_bytes)  # what its wake decodes through
        if v.rule in ("suspended", "running") and v.host_backup_bytes:
            # pinned host copies the ranks keep (CUDA pins its backup at start): the host
            # budget counts them; 0 says nothing (the host backend keeps weights in place)
            rec.holdings.hold_host(v.host_backup_bytes)

    # ---- applying ------------------------------------------------------------------------

    async def _apply(
        self, run: Run, v: Verdict, why: str, *, always: bool, failure: str | None
    ) -> None:
        rec = self.record
        snap = rec.snapshot
        target = v.state
        if target is None or v.rule == "cache-fits":
            self.runner.discard()
            return
        if failure is not None and v.do is Do.FINISH_WAKE:
            # Finishing would send the very RPC that just failed: never resend.
            self.runner.discard()
            return
        if failure is not None and target is State.FAILED and snap.state is State.FAILED:
            self.runner.discard()  # the failed step's own record says more
            return
        where = _FAILED_PHASE.get(v.rule, "reconcile")
        reason = f"{where}: {v.reason}"
        same = target is snap.state and (
            (target is State.RUNNING and snap.ready and snap.unverified_wake == v.unverified)
            or (target is State.SUSPENDED and snap.level == (v.level or snap.level))
            or (target is State.FAILED and snap.last_error == reason)
        )
        if same and not always:
            self.runner.discard()
            return
        log.info(
            "%s: reconciled (%s): %s -> %s [%s] %s",
            self.name,
            why,
            snap.state.value,
            target.value,
            v.rule,
            v.reason,
            extra={"model": self.name, "phase": "reconcile", "rank": None},
        )
        if target is State.FAILED:
            self.runner.finish(
                run,
                Event.FAIL,
                State.FAILED,
                "failed",
                error=reason,
                failed_phase=where,
                verified=False,
                last_error=reason,
            )
            return
        if target in (State.RUNNING, State.SUSPENDED):
            self._settle(run, v, target, failure)
            return
        await self._finish_resuming(run, v, failure)

    def _settle(self, run: Run, v: Verdict, target: State, failure: str | None) -> None:
        """RUNNING or SUSPENDED: record what the ranks hold, with the event from the state
        before (none when it stands)."""
        snap = self.record.snapshot
        running = target is State.RUNNING
        kept: dict[str, Any] = {"error": failure, "last_error": failure}
        if running:
            kept |= {"verified": not v.unverified, "unverified_wake": v.unverified}
            kept |= {"level": None, "resident_bytes": None}
        else:  # what the ranks say they hold asleep, when they say it
            held = v.resident_bytes if v.resident_bytes is not None else snap.resident_bytes
            # a plain vLLM sleep's level is not in the ranks: the one this sidecar knows
            level = v.level if v.level is not None or snap.state is not target else snap.level
            kept |= {"level": level, "resident_bytes": held}
        if snap.state is target:  # e.g. a start-up probe of what was known
            self.runner.finish_same(run, **kept)
            return
        if running:
            event = Event.STARTED if snap.state is State.STARTING else Event.PROBED_RUNNING
        else:
            event, kept["verified"] = Event.PROBED_SUSPENDED, False
        self.runner.finish(run, event, target, **kept)

    async def _finish_resuming(self, run: Run, v: Verdict, failure: str | None) -> None:
        """RESUMING: finish what a sleep or a wake left undone, then RUNNING."""
        self.runner.apply(_EVENT[State.RESUMING], phase="reconcile", verified=False)
        params = protocol.Params(level=v.level or 1, quiesce_timeout_s=self.timeouts.quiesce_s)
        try:
            await self.runner.run(run, finish_steps(v), params)
        except PhaseFailed as failed:
            self.note_failure(failed)
            self.runner.fail(run, failed)
            return
        self.runner.finish(
            run,
            Event.WAKE_DONE,
            State.RUNNING,
            error=failure,
            verified=not v.unverified,
            unverified_wake=v.unverified,
            level=None,
            last_error=failure,
        )

    def note_failure(self, failed: PhaseFailed) -> None:
        """A failed step: an RPC that may have left the reply queues out of step marks the
        process; nothing is sent to it again until a new process answers."""
        if failed.method.startswith("hotswap_") and failed.error.may_desync:
            self.record.facts.desync()
