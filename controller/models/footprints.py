"""What the policy plans with, read from the ranks' own reports: a model's awake footprint
(the pools `hotswap_info` lists, or the bytes a sleep's suspend freed) and a device's
measured byte budget (CUDA's free memory with every model asleep). Pure, like policy.py."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from controller import protocol
from controller.reports import RankReport, SuspendReport, sum_by_pool
from controller.state import TransitionRecord


def _int_values(d: object) -> int:
    if not isinstance(d, Mapping):
        return 0
    return sum(int(v) for v in d.values() if isinstance(v, int | float) and v > 0)


def footprint_from_info(ranks: Sequence[Mapping[str, Any]]) -> int | None:
    """Awake footprint from `hotswap_info`: the bytes of every pool, summed over ranks."""
    total = sum(_int_values(r.get("pools")) for r in ranks)
    return total if total > 0 else None


def footprint_from_sleep(transition: TransitionRecord | None) -> int | None:
    """Awake footprint from a finished sleep: the bytes its suspend freed, summed over ranks;
    a sleep through vLLM's own /sleep reports none (docs/contracts.md §2.3): then the pools
    its ranks list in the `info` read after it."""
    if transition is None or transition.kind != "sleep" or transition.result != "ok":
        return None
    total = 0
    for phase in transition.phases:
        total += sum(_int_values(r.get("freed_bytes")) for r in phase.ranks)
    if total > 0:
        return total
    info = [r for p in transition.phases if p.name == protocol.INFO.phase for r in p.ranks]
    return footprint_from_info(info)


def budget_from_info(ranks: Sequence[Mapping[str, Any]]) -> int | None:
    """A measured byte budget: the device memory free on the tightest rank (CUDA reports it;
    CPU reports only RSS, so None there)."""
    free = [
        int(mem["free"])
        for r in ranks
        if r.get("platform") == "cuda"
        and isinstance(mem := r.get("device_memory"), Mapping)
        and isinstance(mem.get("free"), int)
    ]
    return min(free) if free else None


def freed_by_pool(reports: Iterable[RankReport]) -> dict[str, int]:
    """The bytes a sleep's suspends freed, by pool, summed over ranks (and over the two
    suspends of a sleep split by pool)."""
    return sum_by_pool(r.freed_bytes for r in reports if isinstance(r, SuspendReport))


def copied_weights(reports: Iterable[RankReport]) -> int:
    """The weights bytes a sleep copied off the device: freed and offloaded on each rank
    (the host backend offloads in place and frees nothing; level 2 discards)."""
    total = 0
    for r in reports:
        if isinstance(r, SuspendReport):
            off = r.raw.get("offloaded_bytes")
            moved = off.get("weights", 0) if isinstance(off, dict) else 0
            freed = r.freed_bytes.get("weights", 0)
            total += min(int(moved), int(freed)) if isinstance(moved, int | float) else 0
    return total


def pools_from_info(transition: TransitionRecord | None) -> dict[str, int]:
    """The pools' bytes a start probe's `hotswap_info` reported, summed over ranks."""
    if transition is None:
        return {}
    for phase in transition.phases:
        if phase.name == protocol.INFO.phase:
            pools = [
                {str(k): int(v) for k, v in p.items() if isinstance(v, int) and v > 0}
                for r in phase.ranks
                if isinstance(p := r.get("pools"), dict)
            ]
            return sum_by_pool(pools)
    return {}
