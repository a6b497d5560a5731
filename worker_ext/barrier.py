"""Quiesce: device synchronize, then a gloo barrier with a timeout that names late ranks.

The barrier is `torch.distributed.monitored_barrier(..., wait_all_ranks=True)` on vLLM's
world gloo CPU group: rank 0 collects one message from every other rank within the timeout
and, when some do not arrive, raises an error that lists all of them. It is gloo-only,
which is what `GroupCoordinator.cpu_group` is in vLLM 0.26 and 0.32 (a plain
`new_group(backend="gloo")`, not a stateless group). A non-zero rank that gives up only
learns that rank 0 did not answer; a rank that is itself past the timeout before reaching
the barrier names itself and stays out, so the others time out naming it.

A timed-out barrier leaves messages and collective counters out of step between ranks,
so the group is never used again: every later quiesce answers "poisoned".

`Quiescer.agree` is the fused sleep's agreement before its first release: each rank's
prepare outcome, one all-reduce on the same gloo group bounded by the last quiesce's
timeout (gloo's per-call timeout), so a prepare that failed on one rank releases nothing
on any. A timed-out agreement poisons the group like a timed-out barrier.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

POISONED = "barrier group poisoned; restart the engine"
AGREE_TIMEOUT_S = 60.0  # the agreement's bound when no quiesce has set one
_RANKS = re.compile(r"Ranks? ([\d,\s]+?) failed to pass monitoredBarrier")


def device_synchronize() -> None:
    """Wait for all queued device work (a no-op on CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        return
    acc = getattr(torch, "accelerator", None)
    if acc is not None and acc.is_available():
        acc.synchronize()


def late_from_error(message: str, group_ranks: list[int]) -> list[int]:
    """Global ranks named in a monitored_barrier error (group ranks mapped through `ranks`)."""
    m = _RANKS.search(message)
    if not m:
        return []
    late = []
    for part in m.group(1).replace(" ", "").split(","):
        if part.isdigit():
            i = int(part)
            late.append(group_ranks[i] if i < len(group_ranks) else i)
    return sorted(late)


def _world(world: Any) -> Any:
    if world is None:
        from vllm.distributed.parallel_state import get_world_group

        world = get_world_group()
    return world


class Quiescer:
    def __init__(self, world: Any = None) -> None:
        self.poisoned = False
        self.timeout_s = AGREE_TIMEOUT_S  # the last quiesce's, bounds the agreement
        self.world = world  # None: vLLM's world group (tests give a fake)

    def agree(self, ok: bool, world: Any = None) -> dict[str, Any]:
        """Every rank's `ok`, known to all: {"ok": every rank's ok, "failed_ranks":
        [global ranks whose ok was false], "error"}. With one rank (or outside a vLLM
        worker, where there is no world group: one rank), no collective."""
        me = bool(ok)
        try:
            world = _world(world or self.world)
        except Exception:  # no distributed state: this process is the only rank
            return {"ok": me, "failed_ranks": [], "error": None}
        if world.world_size <= 1:
            return {"ok": me, "failed_ranks": [], "error": None}
        if self.poisoned:
            return {"ok": False, "failed_ranks": [], "error": POISONED}
        flags = torch.zeros(world.world_size, dtype=torch.int64)
        flags[world.rank_in_group] = 0 if me else 1
        opts = torch.distributed.AllreduceOptions()
        opts.reduceOp = torch.distributed.ReduceOp.SUM
        opts.timeout = timedelta(seconds=self.timeout_s)
        try:
            world.cpu_group.allreduce([flags], opts).wait()
        except RuntimeError as e:
            self.poisoned = True
            return {
                "ok": False,
                "failed_ranks": [],
                "error": f"the ranks' agreement timed out after {self.timeout_s}s: {e}",
            }
        ranks = list(world.ranks)
        failed = [ranks[i] for i, f in enumerate(flags.tolist()) if f]
        return {"ok": not failed, "failed_ranks": failed, "error": None}

    def run(
        self,
        timeout_s: float,
        rank: int,
        before_barrier: Callable[[], None] | None = None,
        world: Any = None,
    ) -> dict[str, Any]:
        if self.poisoned:
            return {"ok": False, "error": POISONED, "barrier_s": 0.0, "late_ranks": []}
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be positive, got {timeout_s}")
        self.timeout_s = float(timeout_s)
        t0 = time.monotonic()
        device_synchronize()
        if before_barrier is not None:
            before_barrier()
        world = _world(world or self.world)
        if world.world_size <= 1:
            return {"ok": True, "barrier_s": time.monotonic() - t0, "late_ranks": []}
        left = timeout_s - (time.monotonic() - t0)
        if left <= 0:
            # Too late to meet the others in time: stay out so they name this rank.
            self.poisoned = True
            return {
                "ok": False,
                "error": f"rank {rank} reached the barrier after the {timeout_s}s timeout",
                "barrier_s": time.monotonic() - t0,
                "late_ranks": [rank],
            }
        t1 = time.monotonic()
        try:
            torch.distributed.monitored_barrier(
                group=world.cpu_group, timeout=timedelta(seconds=left), wait_all_ranks=True
            )
        except RuntimeError as e:
            self.poisoned = True
            late = late_from_error(str(e), list(world.ranks))
            who = f"ranks {late}" if late else "rank 0 did not answer (see its result)"
            return {
                "ok": False,
                "error": f"barrier timed out after {timeout_s}s: {who}",
                "barrier_s": time.monotonic() - t1,
                "late_ranks": late,
            }
        return {"ok": True, "barrier_s": time.monotonic() - t1, "late_ranks": []}
