"""What the policy plans with, read from the ranks' own reports: a model's awake footprint
(the pools `hotswap_info` lists, or the bytes a sleep's suspend freed) and a device's
measured byte budget (CUDA's free memory with every model asleep). Pure, like policy.py."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

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
    """Awake footprint from a finished sleep: the bytes its suspend freed, summed over ranks."""
    if transition is None or transition.kind != "sleep" or transition.result != "ok":
        return None
    total = 0
    for phase in transition.phases:
        total += sum(_int_values(r.get("freed_bytes")) for r in phase.ranks)
    return total if total > 0 else None


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
