"""Whether an evicting wake may overlap the evicted model's offload with the woken model's
load (`plan_overlap`). Pure, like policy.py: the coordinator (controller.fleet.swap) runs the
overlapped swap when the plan says so, else one sleep after the other."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controller.fleet.policy import Decision, WakePlan, mib


@dataclass(frozen=True)
class Overlap:
    """Whether an evicting wake may map the target's weights while the evicted model's
    weights are still leaving the device (its KV cache already gone), and why."""

    ok: bool
    reason: str
    peak_bytes: int | None = None  # what the device holds at most while both move
    # The target's weights may come in from the swap's start (the victim still awake whole).
    early: bool = False
    # The target's KV cache may come in once the victim's is gone (its weights still there).
    kv_early: bool = False


def plan_overlap(
    plan: WakePlan[Any],
    victim_pools: Mapping[str, int],
    target_pools: Mapping[str, int],
    victim_counted: int,
    victim_scratch: int = 0,
) -> Overlap:
    """One evicted model on one device, a byte budget, and both models' pools measured:
    the overlap holds, at its peak, the other models' bytes plus both models' weights (the
    target's KV cache waits until the victim's weights are gone); `early` and `kv_early`
    where the earlier starts' own peaks fit as well (docs/contracts.md, the coordinator).
    `victim_counted`: the bytes `plan.used_bytes` counted for the victim (`estimate`);
    `victim_scratch`: what its sleep's coder holds while it encodes (the wake's own is
    `plan.scratch_bytes`). Anything unknown: the swap runs one sleep after the other."""
    if plan.decision is not Decision.EVICT or len(plan.evict) != 1:
        return Overlap(False, "not a one-model eviction")
    if len(plan.devices) > 1:
        return Overlap(False, "tensor parallel over several devices: one after the other")
    if plan.budget_bytes is None:
        return Overlap(False, "no byte budget to check the overlap against")
    vw, tw = victim_pools.get("weights"), target_pools.get("weights")
    if not vw or not tw:
        return Overlap(False, "pool sizes not measured yet")
    others = max(0, plan.used_bytes - victim_counted)
    scratch = plan.scratch_bytes + max(0, victim_scratch)  # both coders' staging at once
    peak = others + vw + tw + scratch
    both = f"both weights {mib(vw)} + {mib(tw)}"
    if scratch:
        both += f" + both coders' scratch {mib(scratch)}"
    if peak > plan.budget_bytes:
        return Overlap(False, f"{mib(others)} held + {both} > {mib(plan.budget_bytes)}", peak)
    why = f"{mib(others)} held + {both} <= {mib(plan.budget_bytes)}"
    # Earlier starts, each where its own peak fits too: the target's weights beside the
    # victim awake whole (early), the target whole beside the victim's weights (kv_early).
    early_peak = others + max(0, victim_counted) + tw + scratch
    kv_peak = others + vw + max(0, victim_scratch) + plan.need_bytes
    early = early_peak <= plan.budget_bytes
    kv_early = plan.need_bytes > 0 and kv_peak <= plan.budget_bytes
    if early:
        why += f"; early: + the victim whole {mib(early_peak)} fits"
    if kv_early:
        why += f"; the KV cache early: {mib(kv_peak)} fits"
    return Overlap(
        True,
        why,
        max(peak, early_peak if early else 0, kv_peak if kv_early else 0),
        early=early,
        kv_early=kv_early,
    )
