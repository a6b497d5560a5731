"""The host-memory policy: level-1 sleepers hold their weights in host RAM, awake models
may keep a backup there; a host budget bounds both. Pure, like policy.py.

`plan_host` keeps a sleep (or the fleet as it is) within the budget: awake models drop
their kept backup first (least recently used first), then level-1 sleepers are demoted to
level 2 (LRU first); if that is not enough, the model being put to sleep sleeps at level 2
itself. Pinned models keep their host memory. Every plan carries its reason, and hands back
the views it chose (each with the caller's object for its model, as policy.py's plans do).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Generic

from controller.fleet.policy import M, ModelView, mib, view_of
from controller.state import State


@dataclass(frozen=True)
class HostBudget:
    """Host RAM the models may hold (level-1 sleepers' weights, awake models' backups)."""

    bytes: int | None = None


@dataclass(frozen=True)
class HostPlan(Generic[M]):
    """How a sleep of `model` (its name; None: the fleet as it is) stays within the host
    budget: the level it sleeps at, the views of awake models whose backup goes first and of
    LRU level-1 sleepers demoted to level 2. `reason` says why, with the figures."""

    model: str | None
    level: int | None
    reason: str
    drop_backup: tuple[ModelView[M], ...] = ()
    demote: tuple[ModelView[M], ...] = ()
    need_bytes: int = 0  # host bytes the sleep adds
    used_bytes: int = 0  # host bytes held now (every model)
    budget_bytes: int | None = None

    @property
    def changed(self) -> bool:
        return bool(self.drop_backup or self.demote)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "level": self.level,
            "reason": self.reason,
            "drop_backup": [v.name for v in self.drop_backup],
            "demote": [v.name for v in self.demote],
            "need_bytes": self.need_bytes,
            "used_bytes": self.used_bytes,
            "budget_bytes": self.budget_bytes,
        }


def host_need(view: ModelView[Any]) -> int:
    """Host bytes a level-1 sleep of `view` holds: its weights (else its awake footprint)."""
    if view.host_weights_bytes is not None:
        return view.host_weights_bytes
    return view.footprint_bytes or 0


def plan_host(
    target: M | None,
    level: int | None,
    models: Sequence[ModelView[M]],
    budget: HostBudget,
) -> HostPlan[M]:
    """Keep host memory within `budget` for a sleep of `target` (a view's `model`) at `level`
    (None: just enforce it for the fleet as it is). Room is made in this order: awake models
    drop their kept backup (least recently used first), then level-1 sleepers are demoted to
    level 2 (LRU first); if that is not enough the target sleeps at level 2 itself. Pinned models
    keep their host memory."""
    t = view_of(target, models) if target is not None else None
    name = t.name if t is not None else None
    used = sum(m.host_bytes for m in models)
    need = 0
    if t is not None and level == 1:
        need = max(0, host_need(t) - t.host_bytes)  # a kept backup becomes its host copy

    def plan(
        lvl: int | None, why: str, drop: list[ModelView[M]], demote: list[ModelView[M]]
    ) -> HostPlan[M]:
        return HostPlan(name, lvl, why, tuple(drop), tuple(demote), need, used, budget.bytes)

    if budget.bytes is None:
        return plan(level, "no host budget", [], [])
    cap = budget.bytes
    if used + need <= cap:
        return plan(level, f"host fits: {mib(used)} + {mib(need)} <= {mib(cap)}", [], [])
    others = [m for m in models if m is not t and not m.pinned and m.host_bytes > 0]
    lru = sorted(others, key=lambda m: (m.last_used, m.name))
    backups = [m for m in lru if m.state is State.RUNNING]
    sleepers = [m for m in lru if m.state is State.SUSPENDED and m.level == 1 and m.demotable]
    over = f"host over budget ({mib(used)} held + {mib(need)} > {mib(cap)})"

    def free_until(total: int, pool: list[ModelView[M]], into: list[ModelView[M]]) -> int:
        for m in pool:
            if total <= cap:
                break
            into.append(m)
            total -= m.host_bytes
        return total

    def names(views: list[ModelView[M]]) -> str:
        return ", ".join(m.name for m in views)

    drop: list[ModelView[M]] = []
    demote: list[ModelView[M]] = []
    total = free_until(used + need, backups, drop)
    total = free_until(total, sleepers, demote)
    if total <= cap:
        parts = []
        if drop:
            parts.append(f"dropping the backup of {names(drop)}")
        if demote:
            parts.append(f"demoting LRU {names(demote)} to level 2")
        return plan(level, f"{over}: {'; '.join(parts)}", drop, demote)
    if t is not None and level == 1:
        # Not enough even so: the target sleeps at level 2, and frees only what that needs.
        drop, demote = [], []
        total = free_until(used - t.host_bytes, backups, drop)
        total = free_until(total, sleepers, demote)
        why = f"{over} and not enough to release: sleeping at level 2"
        if drop or demote:
            why += f" (and releasing {names(drop + demote)})"
        if total > cap:
            why += f"; still {mib(total)} held > {mib(cap)} (pinned or not demotable)"
        return HostPlan(name, 2, why, tuple(drop), tuple(demote), 0, used, cap)
    why = f"{over}: releasing {names(drop + demote) or 'nothing'}"
    if total > cap:
        why += f"; still {mib(total)} held > {mib(cap)} (pinned or not demotable)"
    return plan(level, why, drop, demote)


def host_budget_bytes(value: int | float | None, total_ram: int) -> int | None:
    """The host budget in bytes: an int is bytes, a float in (0, 1] a fraction of RAM."""
    if value is None:
        return None
    if isinstance(value, float):
        return int(value * total_ram)
    return int(value)
