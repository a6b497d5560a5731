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
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch

POISONED = "barrier group poisoned; restart the engine"
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


class Quiescer:
    def __init__(self) -> None:
        self.poisoned = False

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
        t0 = time.monotonic()
        device_synchronize()
        if before_barrier is not None:
            before_barrier()
        if world is None:
            from vllm.distributed.parallel_state import get_world_group

            world = get_world_group()
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
