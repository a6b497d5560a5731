"""One model's deep sleep (docs/contracts.md §2.2): its engine's processes checkpointed by
the CUDA driver after a sleep, restored before a wake, read back by their driver state.

The driver is reached through `controller.engines.checkpoint.Checkpointer` (a helper process
per call). Which processes: a managed engine's keeper's process group, an attached engine's
socket peer's; of those, the ones the driver says hold a CUDA context. A refusal (no process
in reach, no driver or API, no CUDA process, fewer than the ranks) is a `DeepSleepRefused`
before anything changes; a lock or checkpoint that fails leaves the model asleep, not deep;
a failed rollback, a helper that overran, or a failed restore is FAILED, and after a failed
restore nothing is sent to that process again (the engine is restarted).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from controller import protocol
from controller.engines.checkpoint import Checkpointer, CkptResult, group_pids, peer_group
from controller.errors import DeepSleepRefused, EngineError, TransitionConflict
from controller.models.record import ModelRecord
from controller.models.runner import EngineStep, PhaseFailed, Run, Runner
from controller.observe.metrics import Metrics
from controller.state import ModelSnapshot, State

log = logging.getLogger("hotswap.deep")

# A checkpoint that failed but was rolled back: the model sleeps on, not deep.
ROLLED_BACK = frozenset({"lock", "checkpoint", "no-cuda", "no-pids", "no-driver", "no-api"})


class NotDeep(EngineError):
    """The lock or checkpoint failed and every process was left as it was (asleep)."""


class DeepSleep:
    def __init__(
        self,
        record: ModelRecord,
        checkpointer: Checkpointer | None,
        metrics: Metrics,
        runner: Runner,
        lock: asyncio.Lock,
    ) -> None:
        """`runner` and `lock`: the model's (its ModelManager's): phases are recorded and
        transitions serialised with the rest of its sequences."""
        self.runner = runner
        self.lock = lock
        self.record = record
        self.name = record.name
        self.ckpt = checkpointer
        self.metrics = metrics

    # ---- which processes -----------------------------------------------------------------

    def group(self) -> int | None:
        """The engine's process group: its keeper's (managed), or its socket peer's."""
        eng = self.record.process.engine
        pid = getattr(eng, "pid", None) if eng is not None else None
        if isinstance(pid, int):
            return pid
        uds = self.record.settings.uds
        return peer_group(Path(uds)) if uds is not None else None

    async def pids(self) -> tuple[int, tuple[int, ...]]:
        group = await asyncio.to_thread(self.group)
        return (group or 0), await asyncio.to_thread(group_pids, group)

    def _refuse(self, why: str) -> DeepSleepRefused:
        self.record.ckpt.unable(why)
        self.metrics.deep_sleep(self.name, "refused")
        log.warning("%s: no deep sleep: %s", self.name, why, extra={"model": self.name})
        return DeepSleepRefused(f"cannot deep-sleep {self.name}: {why}", model=self.name)

    async def check(self) -> tuple[int, ...]:
        """The engine's CUDA processes, every one running; else DeepSleepRefused. A positive
        answer is kept for the engine's process group (one probe per engine process)."""
        rec = self.record
        if rec.settings.sleep_driver == "vllm":
            raise self._refuse(
                "its sleeps are vLLM's own (sleep_driver vllm): the checkpoint follows the "
                "extension's sleep (docs/contracts.md §2.3)"
            )
        if self.ckpt is None:
            raise self._refuse("this sidecar has no checkpoint helper")
        group, pids = await self.pids()
        if not pids:
            raise self._refuse(
                "no process of the engine can be reached (an attached engine needs a Unix "
                "socket and a shared process namespace)"
            )
        if rec.ckpt.knows(group, pids):
            return rec.ckpt.cuda_pids
        res = await self.ckpt.call("probe", pids)
        if not res.ok:
            raise self._refuse(res.error or f"the driver's probe failed ({res.code})")
        cuda = res.cuda_pids
        if not cuda:
            raise self._refuse("no process of the engine holds a CUDA context (a CPU engine)")
        ranks = max(1, len(rec.settings.placement))
        if len(cuda) < ranks:
            few = f"{len(cuda)} process(es) hold a CUDA context, fewer than its {ranks} ranks"
            raise self._refuse(few)
        if res.states != {"running"}:
            raise self._refuse(f"its CUDA processes are {sorted(res.states)}, not all running")
        rec.ckpt.capable(cuda, group)
        return cuda

    async def wanted(self, deep: bool | None) -> bool:
        """Whether a sleep asked with `deep` (None: the model's `deep_sleep`) is deep; for a
        model that would sleep or deepen now, DeepSleepRefused where it cannot be."""
        want = self.record.settings.deep_sleep == "always" if deep is None else deep
        snap = self.record.snapshot
        now = snap.state is State.RUNNING or (snap.state is State.SUSPENDED and not snap.deep)
        if want and now:
            await self.check()
        return want

    # ---- the phases ----------------------------------------------------------------------

    async def after_sleep(self, run: Run, params: protocol.Params) -> dict[str, Any]:
        """The deep sleep's checkpoint under the model's lock; the snapshot's changes. A
        checkpoint that left the processes' state unknown is FAILED, and nothing is sent."""
        async with self.lock:
            try:
                return await self.checkpoint(self.runner, run, params)
            except PhaseFailed as failed:
                self.record.facts.desync()
                raise self.runner.fail(run, failed) from failed.error

    async def deepen(self) -> ModelSnapshot:
        """Asleep, not deep: checkpoint its engine now (after `check`); it stays SUSPENDED,
        deep or not with `deep_error`. 409 in any other state."""
        async with self.lock:
            snap = self.record.snapshot
            if snap.state is not State.SUSPENDED or snap.deep or self.record.in_flight_task():
                raise TransitionConflict(
                    f"cannot deepen {self.name}: {snap.state.value}"
                    + (", deep already" if snap.deep else ""),
                    model=self.name,
                )
            run = self.runner.begin("deepen", snap.level, State.SUSPENDED)
            try:
                changes = await self.checkpoint(
                    self.runner, run, protocol.Params(level=snap.level or 1)
                )
            except PhaseFailed as failed:
                self.record.facts.desync()
                raise self.runner.fail(run, failed) from failed.error
            self.runner.finish_same(run, error=changes.get("deep_error"), **changes)
            return self.record.snapshot

    async def restore_ahead(self) -> ModelSnapshot:
        """Deep, SUSPENDED at a known level: restore its engine now (transition `restore`,
        phase `restore`), ahead of a wake that waits for its swap's evictions; it stays
        SUSPENDED, a level-1 or level-2 sleeper no longer deep, counted at what it left
        beside its pools before its checkpoint. A failed restore is FAILED (restarted).
        409 in any other state."""
        async with self.lock:
            snap = self.record.snapshot
            if (
                snap.state is not State.SUSPENDED
                or not snap.deep
                or snap.level is None
                or self.record.in_flight_task()
            ):
                raise TransitionConflict(
                    f"cannot restore {self.name} ahead: {snap.state.value}"
                    + ("" if snap.deep else ", not deep"),
                    model=self.name,
                )
            run = self.runner.begin("restore", snap.level, State.SUSPENDED)
            try:
                await self.runner.run(
                    run, (self.restore_step(),), protocol.Params(level=snap.level)
                )
            except PhaseFailed as failed:
                raise self.runner.fail(run, failed) from failed.error
            # what it holds now: what its sleep left beside its pools (holdings), not NVML's
            # figure after the checkpoint
            self.runner.finish_same(run, deep=False, resident_bytes=None)
            return self.record.snapshot

    async def checkpoint(self, runner: Runner, run: Run, params: protocol.Params) -> dict[str, Any]:
        """Phase `checkpoint`, after the sleep's RPCs; the snapshot's changes. Raises
        PhaseFailed only when the processes' state is not known (FAILED)."""
        pids = self.record.ckpt.cuda_pids

        async def call(r: Runner) -> Mapping[str, Any]:
            res = await self._call("checkpoint", pids)
            if not res.ok:
                cls = NotDeep if res.code in ROLLED_BACK else EngineError
                raise cls(f"{res.code}: {res.error}")
            return {
                "pids": list(pids),
                "driver_s": res.elapsed_s,
                "device_bytes": res.device_bytes,
                **res.by_pid(),
            }

        step = EngineStep("checkpoint", "cuCheckpointProcessCheckpoint", call)
        try:
            await runner.run(run, (step,), params)
        except PhaseFailed as failed:
            if not isinstance(failed.error, NotDeep):
                self.metrics.deep_sleep(self.name, "failed")
                raise
            self.metrics.deep_sleep(self.name, "failed")
            log.warning("%s: asleep, not deep: %s", self.name, failed.error.message)
            return {"deep": False, "deep_error": failed.error.message}
        self.metrics.deep_sleep(self.name, "ok")
        held = run.phases[-1].detail.get("device_bytes")
        changes: dict[str, Any] = {"deep": True, "deep_error": None}
        if held is not None:
            changes["resident_bytes"] = int(held)
        return changes

    def restore_step(self) -> EngineStep:
        """Phase `restore`, before a deep sleeper's wake; a failure marks the process as
        sent nothing more (FAILED, restarted), never restored twice."""

        async def call(r: Runner) -> Mapping[str, Any]:
            pids = self.record.ckpt.cuda_pids
            res = await self._call("restore", pids)
            if not res.ok:
                self.record.facts.desync()  # no RPC to it again: restart
                raise EngineError(f"restore failed, the engine is restarted: {res.error}")
            r.record.update(deep=False)
            return {"pids": list(pids), "driver_s": res.elapsed_s, **res.by_pid()}

        return EngineStep("restore", "cuCheckpointProcessRestore", call)

    async def _call(self, op: str, pids: tuple[int, ...]) -> CkptResult:
        assert self.ckpt is not None
        res = await self.ckpt.call(op, pids)
        self.metrics.checkpoint(self.name, op, res.elapsed_s)
        return res

    # ---- reading back --------------------------------------------------------------------

    async def read(self) -> str | None:
        """The driver's word on the engine's processes: "deep" (every CUDA process
        checkpointed or locked), "awake" (every one running), "mixed"; None: nothing to
        read (no helper, no process in reach, no driver, no CUDA process)."""
        if self.ckpt is None:
            return None
        group, pids = await self.pids()
        if not pids:
            return None
        res = await self.ckpt.call("state", pids)
        if not res.ok or not res.cuda_pids:
            return None
        self.record.ckpt.found(res.cuda_pids, group)
        states = res.states
        if states <= {"checkpointed", "locked"}:
            return "deep"
        return "awake" if states == {"running"} else "mixed"
