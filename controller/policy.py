"""The swap policy: may a model wake, and which models must sleep first. Pure, like state.py.

A device has a memory budget (bytes, and optionally a count of awake models). Every model
has an awake footprint, measured from the engine's own reports (the pools `hotswap_info`
lists, or the bytes a suspend freed). A wake that does not fit puts the least recently used
unpinned models to sleep first; pinned models are never evicted, and a model awake for less
than the minimum awake time is not evicted either (no thrash). A FAILED or UNKNOWN model
counts at its footprint until its engine process is known to be gone. Every plan carries its
reason.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from controller.state import State, TransitionRecord

# States whose engine holds its awake footprint (SUSPENDING until its suspend has finished).
HOLDING = frozenset({State.RUNNING, State.RESUMING, State.SUSPENDING, State.STARTING})
# States that say nothing of the engine's memory: counted at the footprint while it may live.
UNSURE = frozenset({State.FAILED, State.UNKNOWN})


class Decision(enum.StrEnum):
    NOOP = "noop"  # already awake or waking: nothing to do
    WAKE = "wake"  # fits as things are
    EVICT = "evict"  # fits once `evict` are asleep
    REFUSE = "refuse"  # does not fit (or may not evict); `reason` says why


@dataclass(frozen=True)
class ModelView:
    """What the policy knows about one model; built from a snapshot plus the gateway's use."""

    name: str
    state: State
    footprint_bytes: int | None = None  # awake footprint; None = not measured yet
    last_used: float = 0.0  # seconds (any clock, the same as `now`) of the last request
    awake_since: float | None = None  # when it last became RUNNING
    pinned: bool = False
    device: str = "0"
    process_gone: bool = False  # its engine process is known to be gone (none was started)

    @property
    def holds(self) -> bool:
        """Whether its engine may hold its awake footprint now: a FAILED or UNKNOWN model
        counts until its process is gone (a failed step may have freed nothing)."""
        return self.state in HOLDING or (self.state in UNSURE and not self.process_gone)


@dataclass(frozen=True)
class Budget:
    """Per device. None = no limit of that kind."""

    bytes: int | None = None
    max_awake: int | None = None
    min_awake_s: float = 0.0


@dataclass(frozen=True)
class WakePlan:
    model: str
    decision: Decision
    reason: str
    evict: tuple[str, ...] = ()
    need_bytes: int = 0  # the target's footprint as the plan counted it
    used_bytes: int = 0  # what the other awake models on the device hold now
    budget_bytes: int | None = None
    retry_after_s: float | None = None  # a refusal that goes away by itself after this long

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "decision": self.decision.value,
            "reason": self.reason,
            "evict": list(self.evict),
            "need_bytes": self.need_bytes,
            "used_bytes": self.used_bytes,
            "budget_bytes": self.budget_bytes,
            "retry_after_s": self.retry_after_s,
        }


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def estimate(view: ModelView, peers: Iterable[ModelView], budget: Budget) -> int:
    """The footprint to count: measured, else the largest measured on the device, else the
    whole byte budget (an unmeasured model is assumed to need the device to itself)."""
    if view.footprint_bytes is not None:
        return view.footprint_bytes
    known = [p.footprint_bytes for p in peers if p.footprint_bytes is not None]
    if known:
        return max(known)
    return budget.bytes if budget.bytes is not None else 0


def _fits(used: int, awake: int, need: int, budget: Budget) -> bool:
    if budget.bytes is not None and used + need > budget.bytes:
        return False
    return budget.max_awake is None or awake + 1 <= budget.max_awake


def plan_wake(
    target: str,
    models: Sequence[ModelView],
    budget: Budget,
    now: float,
    *,
    allow_evict: bool = True,
) -> WakePlan:
    """Decide how `target` can wake within `budget` on its device."""
    by_name = {m.name: m for m in models}
    if target not in by_name:
        raise KeyError(target)
    t = by_name[target]
    if t.state in (State.RUNNING, State.RESUMING):
        return WakePlan(target, Decision.NOOP, f"already {t.state.value}")
    if t.state is not State.SUSPENDED:
        return WakePlan(target, Decision.REFUSE, f"cannot wake a model in state {t.state.value}")
    device = [m for m in models if m.device == t.device]
    peers = [m for m in device if m.name != target and m.holds]
    sizes = {m.name: estimate(m, device, budget) for m in device}
    need = sizes[target]
    used = sum(sizes[p.name] for p in peers)

    def plan(
        decision: Decision, why: str, evict: tuple[str, ...] = (), retry: float | None = None
    ) -> WakePlan:
        return WakePlan(target, decision, why, evict, need, used, budget.bytes, retry)

    if budget.bytes is not None and need > budget.bytes:
        why = f"needs {_mib(need)}, more than the whole budget of {_mib(budget.bytes)}"
        return plan(Decision.REFUSE, why)
    if budget.max_awake is not None and budget.max_awake < 1:
        return plan(Decision.REFUSE, "the budget allows no awake model")
    if _fits(used, len(peers), need, budget):
        return plan(Decision.WAKE, _fit_reason(used, need, len(peers), budget))

    idle = sorted(
        (p for p in peers if p.state is State.RUNNING and not p.pinned),
        key=lambda p: (p.last_used, p.name),
    )
    ready = [p for p in idle if _awake_for(p, now) >= budget.min_awake_s]
    fresh = [p for p in idle if _awake_for(p, now) < budget.min_awake_s]

    chosen: list[ModelView] = []
    free_used, free_awake = used, len(peers)
    for p in ready:
        if _fits(free_used, free_awake, need, budget):
            break
        chosen.append(p)
        free_used -= sizes[p.name]
        free_awake -= 1
    if _fits(free_used, free_awake, need, budget):
        names = tuple(p.name for p in chosen)
        lru = ", ".join(f"{p.name} (idle {max(0.0, now - p.last_used):.1f} s)" for p in chosen)
        if not allow_evict:
            why = f"does not fit without evicting {', '.join(names)}, and evict=false"
            return plan(Decision.REFUSE, why, names)
        why = f"over budget ({_over(used, len(peers), need, budget)}): evicting LRU {lru}"
        return plan(Decision.EVICT, why, names)

    # Not enough even with every evictable model asleep: would the fresh ones do, later?
    for p in sorted(fresh, key=lambda p: (budget.min_awake_s - _awake_for(p, now), p.name)):
        free_used -= sizes[p.name]
        free_awake -= 1
        if _fits(free_used, free_awake, need, budget):
            wait = budget.min_awake_s - _awake_for(p, now)
            young = ", ".join(q.name for q in fresh)
            why = (
                f"over budget ({_over(used, len(peers), need, budget)}): {young} awake for less "
                f"than min_awake_s={budget.min_awake_s:g}"
            )
            return plan(Decision.REFUSE, why, retry=max(0.0, wait))
    pinned = [p.name for p in peers if p.pinned]
    busy = [f"{p.name} ({p.state.value})" for p in peers if p.state is not State.RUNNING]
    held = "; ".join(
        part
        for part in (
            f"pinned: {', '.join(pinned)}" if pinned else "",
            f"busy: {', '.join(busy)}" if busy else "",
        )
        if part
    )
    why = f"over budget ({_over(used, len(peers), need, budget)}) and nothing evictable"
    if held:
        why += f" ({held})"
    # A busy peer settles by itself: worth retrying; pinned ones never move.
    retry = 1.0 if busy else None
    return plan(Decision.REFUSE, why, retry=retry)


def _awake_for(view: ModelView, now: float) -> float:
    return float("inf") if view.awake_since is None else now - view.awake_since


def _fit_reason(used: int, need: int, awake: int, budget: Budget) -> str:
    parts = []
    if budget.bytes is not None:
        parts.append(f"{_mib(used)} + {_mib(need)} <= {_mib(budget.bytes)}")
    if budget.max_awake is not None:
        parts.append(f"{awake + 1} awake <= {budget.max_awake}")
    return "fits: " + ", ".join(parts) if parts else "fits: no budget"


def _over(used: int, awake: int, need: int, budget: Budget) -> str:
    parts = []
    if budget.bytes is not None and used + need > budget.bytes:
        parts.append(f"{_mib(used)} held + {_mib(need)} > {_mib(budget.bytes)}")
    if budget.max_awake is not None and awake + 1 > budget.max_awake:
        parts.append(f"{awake} awake, max_awake={budget.max_awake}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- measurements


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


def restart_delay(failures: int, base_s: float, max_s: float) -> float:
    """Bounded exponential backoff: base, 2*base, 4*base, ... capped at max_s."""
    if failures <= 0:
        return 0.0
    return float(min(max_s, base_s * (2 ** min(failures - 1, 30))))
