"""The host budget's actions: before a sleep, the level it may sleep at within the host
budget, demoting least recently used level-1 sleepers to level 2 first (the plan is
`controller.hostpolicy`'s, pure); after it, the host bytes the model now holds.

`HostMemory` belongs to the `SwapCoordinator` (controller.swap), which takes its lock around
a budgeted sleep so that host plans and the sleeps they admit never race.
"""

from __future__ import annotations

import asyncio
import logging
import os

from controller.errors import EngineError, HotswapError
from controller.hostpolicy import HostBudget, host_budget_bytes, plan_host
from controller.manager import Manager
from controller.modelmanager import Outcome
from controller.swapview import SwapView

log = logging.getLogger("hotswap.swap")


class HostMemory:
    """Host RAM within `swap.host_budget`, over the swap view's records."""

    def __init__(self, view: SwapView, manager: Manager) -> None:
        self.view = view
        self.fleet = view.fleet
        self.settings = view.settings
        self.metrics = view.metrics
        self.manager = manager
        self.lock = asyncio.Lock()
        self._ram = _machine_ram()

    def budget(self) -> HostBudget:
        return HostBudget(host_budget_bytes(self.settings.swap.host_budget, self._ram))

    async def room(self, name: str, level: int | None) -> int | None:
        """Holding the host lock, before a sleep of `name`: the level it may sleep at within
        the host budget, demoting LRU level-1 sleepers first (controller.hostpolicy)."""
        budget = self.budget()
        if budget.bytes is None:
            return level
        asked = level if level is not None else self.fleet[name].settings.default_level
        fields = {"model": name, "phase": "host"}
        for _ in range(len(self.fleet) + 1):  # a demotion refused: plan again without it
            plan = plan_host(name, asked, self.view.views(), budget)
            log.info("%s: host plan (level %s): %s", name, plan.level, plan.reason, extra=fields)
            done = [await self.demote(victim) for victim in plan.demote]
            if all(done):
                break
        for awake in plan.drop_backup:
            # No RPC drops an awake engine's kept backup yet: said, not done.
            log.warning("%s: its kept host backup cannot be dropped here", awake, extra=fields)
        return plan.level

    async def demote(self, name: str) -> bool:
        """Demote a level-1 sleeper to level 2 (its host copy released); False, logged, when
        it cannot be (a wake came first, or its backend cannot: then never asked again)."""
        rec = self.fleet[name]
        fields = {"model": name, "phase": "demote"}
        try:
            await self.manager.get(name).demote()
        except EngineError as exc:
            if not exc.may_desync:
                rec.demotable = False  # every rank answered no: its backend cannot
            log.warning("%s: not demoted: %s", name, exc, extra=fields)
            return False
        except HotswapError as exc:
            log.info("%s: not demoted: %s", name, exc, extra=fields)
            return False
        freed, rec.host_bytes = rec.host_bytes, 0
        self.metrics.demotion(name, "host_budget")
        log.info("%s: demoted to level 2 (%d host bytes released)", name, freed, extra=fields)
        return True

    def slept(self, name: str, outcome: Outcome) -> None:
        """After a sleep: the host bytes it holds (and, at level 1, its weights' share)."""
        rec = self.fleet[name]
        rec.host_bytes = _host_held(outcome)
        if outcome.snapshot.level == 1 and rec.host_bytes:
            rec.host_weights = rec.host_bytes  # what its next level-1 sleep holds


def _machine_ram() -> int:
    """The machine's RAM in bytes (what a fractional host budget is a fraction of)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError):
        return 0


def _host_held(outcome: Outcome) -> int:
    """Host bytes a finished sleep holds: what its suspends offloaded (level 1's weights,
    a kept KV cache), summed over ranks; 0 at level 2."""
    t = outcome.transition
    if t is None or t.kind != "sleep" or t.result != "ok":
        return 0
    total = 0
    for phase in t.phases:
        for r in phase.ranks:
            off = r.get("offloaded_bytes")
            if isinstance(off, dict):
                total += sum(int(v) for v in off.values() if isinstance(v, int | float))
    return total
