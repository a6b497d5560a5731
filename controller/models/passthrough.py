"""One model's RPCs outside a transition: the read-only pass-through ones (audit, info) and
the two that release a host copy without a transition (demote, drop_backup). Each runs
under the model's lock and never changes the model's state, unless the call may have left
the reply queues out of step (then FAILED)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from controller import protocol
from controller.errors import TransitionConflict
from controller.models.reconciler import Reconciler
from controller.models.record import ModelRecord
from controller.models.runner import PhaseFailed, Runner
from controller.reports import InfoReport
from controller.state import ModelSnapshot, State


class PassThrough:
    """One model's RPCs outside a transition (its `ModelManager` delegates to it, sharing
    the model's lock)."""

    def __init__(
        self, record: ModelRecord, runner: Runner, reconciler: Reconciler, lock: asyncio.Lock
    ) -> None:
        self.name = record.name
        self.record = record
        self.runner = runner
        self.reconciler = reconciler
        self._lock = lock

    async def call(
        self,
        step: protocol.Step,
        params: protocol.Params,
        done: Callable[[], None] | None = None,
    ) -> list[dict[str, Any]]:
        """A read-only RPC outside a transition. It never changes the model's state, except
        that a call which may have left the reply queues out of step (a timeout, a broken
        connection, a 5xx) makes it FAILED: nothing can be sent to that process again."""
        if self._lock.locked() and self.record.in_flight_task() is None:
            async with self._lock:  # a reconciliation of the sidecar's own: wait it out
                pass
        rec = self.record
        if rec.facts.desynced:
            raise TransitionConflict(
                f"cannot call {step.method} on {self.name}: an earlier RPC may have left its "
                "reply queues out of step; nothing is sent until a new process answers",
                model=self.name,
            )
        if rec.snapshot.deep:  # a checkpointed rank answers nothing
            raise TransitionConflict(
                f"cannot call {step.method} on {self.name}: it sleeps deep (its processes are "
                "checkpointed by the driver); wake it first",
                model=self.name,
            )
        busy = self._lock.locked() or rec.in_flight_task() is not None
        if busy or rec.state not in (State.RUNNING, State.SUSPENDED):
            raise TransitionConflict(
                f"cannot call {step.method} on {self.name} now: state {rec.state.value}"
                + (", a transition or reconciliation in flight" if busy else ""),
                model=self.name,
            )
        async with self._lock:
            run = self.runner.begin(step.method)
            try:
                reports = await self.runner.step(run, step, params)
            except PhaseFailed as failed:
                if failed.error.may_desync:
                    self.reconciler.note_failure(failed)
                    raise self.runner.fail(run, failed) from failed.error
                self.runner.discard()
                raise failed.error from None
            self.runner.discard()
            if done is not None:
                done()
            return [dict(r.raw) for r in reports]

    async def demote(self) -> ModelSnapshot:
        """Asleep at level 1: release the host copy (`hotswap_demote`); the model stays
        SUSPENDED, now at level 2 (its next wake reloads). Refused (409) in any other
        state or level; a failure leaves it as it was unless the call may have left the
        queues out of step (then FAILED), like info and audit."""
        snap = self.record.snapshot
        if snap.state is not State.SUSPENDED or snap.level != 1:
            raise TransitionConflict(
                f"cannot demote {self.name}: {snap.state.value} at level {snap.level}",
                model=self.name,
            )
        rec = self.record

        def demoted() -> None:  # under the lock: a wake waiting for it reads level 2
            rec.update(level=2)

        await self.call(protocol.DEMOTE, protocol.Params(level=2), done=demoted)
        return rec.snapshot

    async def drop_backup(self) -> list[dict[str, Any]]:
        """Awake: release the host copies its ranks keep for the next sleep
        (`hotswap_drop_backup`); the model stays RUNNING. Refused (409) in any other state;
        a failure leaves it as it was unless the queues may be out of step (then FAILED)."""
        snap = self.record.snapshot
        if snap.state is not State.RUNNING:
            raise TransitionConflict(
                f"cannot drop the host backup of {self.name}: {snap.state.value}",
                model=self.name,
            )
        return await self.call(protocol.DROP_BACKUP, protocol.Params())

    async def audit(self, level: int) -> list[dict[str, Any]]:
        return await self.call(protocol.AUDIT, protocol.Params(level=level))

    async def info(self) -> list[dict[str, Any]]:
        return await self.call(_INFO_PASSTHROUGH, protocol.Params())


# Outside a transition, an info call is recorded under its method's name, as audit is.
_INFO_PASSTHROUGH = protocol.Step("hotswap_info", "hotswap_info", lambda p: (), report=InfoReport)
