"""The host budget's actions: before a sleep, the level it may sleep at within the host
budget, dropping awake models' kept backups and then demoting least recently used level-1
sleepers to level 2 first (the plan is `controller.fleet.hostpolicy`'s, pure); after a sleep or a
wake, the host bytes the model now holds (a wake that keeps a backup may put the fleet over
the budget: then the same plan for the fleet as it is, and its drops and demotions).

`HostMemory` belongs to the `SwapCoordinator` (controller.fleet.swap), which takes its lock around
a budgeted sleep so that host plans and the sleeps they admit never race.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from controller import protocol
from controller.errors import EngineError, HotswapError
from controller.fleet.hostpolicy import HostBudget, HostPlan, host_budget_bytes, plan_host
from controller.fleet.policy import ModelView
from controller.fleet.swapview import SwapView
from controller.models.modelmanager import ModelManager, Outcome
from controller.models.record import ModelRecord
from controller.observe import hostmem

log = logging.getLogger("hotswap.swap")


class HostMemory:
    """Host RAM within `swap.host_budget`, over the swap view's records."""

    def __init__(self, view: SwapView) -> None:
        self.view = view
        self.fleet = view.fleet
        self.settings = view.settings
        self.metrics = view.metrics
        self.lock = asyncio.Lock()
        ram = hostmem.read()
        self._ram = ram.total
        if self.settings.swap.host_budget is not None:
            log.info(
                "host budget %s of %d bytes (%s)",
                self.settings.swap.host_budget,
                ram.total,
                ram.source,
                extra={"model": "-", "phase": "host"},
            )

    def budget(self) -> HostBudget:
        return HostBudget(host_budget_bytes(self.settings.swap.host_budget, self._ram))

    async def room(self, mm: ModelManager, level: int | None) -> int | None:
        """Holding the host lock, before a sleep of the model: the level it may sleep at within
        the host budget, dropping awake models' backups and then demoting LRU level-1
        sleepers first (controller.fleet.hostpolicy)."""
        budget = self.budget()
        if budget.bytes is None:
            return level
        asked = level if level is not None else mm.settings.default_level
        plan = await self._enforce(mm, asked, budget)
        return plan.level

    async def _enforce(
        self, mm: ModelManager | None, level: int | None, budget: HostBudget
    ) -> HostPlan[ModelManager]:
        """Plan host memory (for a sleep of `mm`, or the fleet as it is) and do what the
        plan says: backups dropped first, then demotions; a step refused is planned again
        without that model."""
        name = mm.name if mm is not None else None
        fields = {"model": name or "-", "phase": "host"}
        refused: set[ModelManager] = set()
        plan = plan_host(mm, level, self._views(refused), budget)
        for _ in range(len(self.fleet) + 1):
            what = f"{name}: host plan (level {plan.level})" if name else "host plan (fleet)"
            log.info("%s: %s", what, plan.reason, extra=fields)
            done = [await self.drop_backup(awake.model) for awake in plan.drop_backup]
            done += [await self.demote(victim.model) for victim in plan.demote]
            if all(done):
                break
            asked = (*plan.drop_backup, *plan.demote)
            refused |= {v.model for v, ok in zip(asked, done, strict=True) if not ok}
            plan = plan_host(mm, level, self._views(refused), budget)
        return plan

    def _views(self, refused: set[ModelManager]) -> list[ModelView[ModelManager]]:
        """The policy's views, with models whose drop or demotion was just refused kept as
        they are (counted, never chosen again in this plan)."""
        views = self.view.views()
        return [dataclasses.replace(v, pinned=True) if v.model in refused else v for v in views]

    def woke(self, rec: ModelRecord, outcome: Outcome) -> bool:
        """After a wake: the host bytes it keeps (its backup, as its resumes said); True when
        the fleet is now over the host budget (then `enforce()`; within it, nothing to plan)."""
        held = rec.holdings
        held.hold_host(_backup_held(outcome))
        cap = self.budget().bytes
        if cap is None or held.host_bytes == 0:
            return False
        return sum(r.holdings.host_bytes for r in self.fleet.values()) > cap

    async def enforce(self) -> HostPlan[ModelManager] | None:
        """Holding the host lock: the fleet as it is within the host budget (backups
        dropped, then demotions); None without a budget."""
        budget = self.budget()
        if budget.bytes is None:
            return None
        async with self.lock:
            return await self._enforce(None, None, budget)

    async def drop_backup(self, mm: ModelManager) -> bool:
        """Release an awake model's kept host backup; False, logged, when it could not be
        (it is no longer RUNNING, or its engine answered no)."""
        name, held = mm.name, mm.record.holdings
        fields = {"model": name, "phase": protocol.DROP_BACKUP.phase}
        try:
            reports = await mm.drop_backup()
        except HotswapError as exc:
            log.warning("%s: kept host backup not dropped: %s", name, exc, extra=fields)
            return False
        freed = held.release_host()
        said = sum(
            int(v)
            for r in reports
            if isinstance(f := r.get("freed_host_bytes"), dict)
            for v in f.values()
            if isinstance(v, int | float)
        )
        self.metrics.backup_dropped(name)
        log.info(
            "%s: kept host backup dropped (%d host bytes released, %d counted)",
            name,
            said,
            freed,
            extra=fields,
        )
        return True

    async def demote(self, mm: ModelManager) -> bool:
        """Demote a level-1 sleeper to level 2 (its host copy released); False, logged, when
        it cannot be (a wake came first, or every rank refused: then not asked again until
        a sleep's prepare says it can)."""
        name, held = mm.name, mm.record.holdings
        fields = {"model": name, "phase": "demote"}
        try:
            await mm.demote()
        except EngineError as exc:
            if not exc.may_desync:
                held.set_demotable(False)  # every rank answered no: not until the next sleep
            log.warning("%s: not demoted: %s", name, exc, extra=fields)
            return False
        except HotswapError as exc:
            log.info("%s: not demoted: %s", name, exc, extra=fields)
            return False
        freed = held.release_host()
        self.metrics.demotion(name, "host_budget")
        log.info("%s: demoted to level 2 (%d host bytes released)", name, freed, extra=fields)
        return True

    def slept(self, rec: ModelRecord, outcome: Outcome) -> None:
        """After a sleep: the host bytes it holds (and, at level 1, its weights' share), and
        whether a demotion may follow it (its prepare's `demotable`, every rank)."""
        held = rec.holdings
        held.hold_host(_host_held(outcome))
        said = _demotable(outcome)
        if said is not None:
            held.set_demotable(said)
        if outcome.snapshot.level == 1 and held.host_bytes:
            held.hold_host_weights(held.host_bytes)  # what its next level-1 sleep holds


def _backup_held(outcome: Outcome) -> int:
    """Host bytes a finished wake keeps for the next sleep: its last resume's
    `host_backup_bytes` (the fused hotswap_wake's too), summed over ranks (0 on CPU, where none
    is kept)."""
    t = outcome.transition
    if t is None or t.kind != "wake" or t.result != "ok":
        return 0
    resumes = (
        protocol.RESUME_WEIGHTS.phase,
        protocol.RESUME_KV.phase,
        protocol.RESUME_VERIFY.phase,
    )
    held = 0
    for phase in t.phases:
        if phase.name in resumes and phase.ranks:
            held = sum(
                int(v)
                for r in phase.ranks
                if isinstance(v := r.get("host_backup_bytes"), int | float)
                and not isinstance(v, bool)
            )
    return held


def _demotable(outcome: Outcome) -> bool | None:
    """A finished sleep's prepare: True when every rank can be demoted after it (a rank
    that does not say counts as yes), False when one cannot (CUDA with HOTSWAP_DEMOTABLE=0,
    a kept KV cache); None without a finished sleep's prepare."""
    t = outcome.transition
    if t is None or t.kind != "sleep" or t.result != "ok":
        return None
    for phase in t.phases:
        if phase.name in (protocol.PREPARE.phase, protocol.PREPARE_SUSPEND.phase) and phase.ranks:
            return all(r.get("demotable", True) is not False for r in phase.ranks)
    return None


def _host_held(outcome: Outcome) -> int:
    """Host bytes a finished sleep holds, summed over ranks: the pinned buffers its last
    suspend's ranks say they keep (CUDA: a coded copy is smaller than the weights, and a
    level-2 sleeper may keep an earlier one), else what its suspends offloaded in place
    (the host backend: level 1's weights, a kept KV cache; 0 at level 2)."""
    t = outcome.transition
    if t is None or t.kind != "sleep" or t.result != "ok":
        return 0
    offloaded, pinned = 0, 0
    for phase in t.phases:
        suspends = [r for r in phase.ranks if isinstance(r.get("offloaded_bytes"), dict)]
        for r in suspends:
            off = r["offloaded_bytes"]
            offloaded += sum(int(v) for v in off.values() if isinstance(v, int | float))
        if suspends:
            pinned = sum(
                int(v)
                for r in suspends
                if isinstance(v := r.get("host_backup_bytes"), int | float)
                and not isinstance(v, bool)
            )
    return pinned or offloaded
