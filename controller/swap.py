"""Wakes with the swap policy, and sleeps that drain the gateway's traffic first.

`SwapCoordinator` is the one place that decides "wake X, putting Y to sleep first": it
builds the policy's view from the manager's snapshots, its own use times and measured
footprints, runs `policy.plan_wake` under one lock per device (plans never race), logs the
decision with its reason, and runs the evictions and the wake through the manager.

`Traffic` counts the gateway's requests in flight per model and closes a model's admission
while it is being put to sleep, so a drain=wait sleep waits for them and nothing new slips
in between (the gateway holds those for the next wake).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from controller.errors import DrainTimeout, HotswapError, WakeRefused
from controller.manager import DrainMode, Manager, Outcome
from controller.policy import (
    Budget,
    Decision,
    ModelView,
    WakePlan,
    footprint_from_info,
    footprint_from_sleep,
    plan_wake,
)
from controller.settings import Settings
from controller.state import State
from controller.swapmetrics import SwapMetrics

log = logging.getLogger("hotswap.swap")

Clock = Callable[[], float]
# Other models' transitions (a manual sleep, a boot) must settle before a plan is made.
SETTLE_POLL_S = 0.02


@dataclass
class Lane:
    """One model's gateway traffic: requests in flight, and whether admission is closed."""

    in_flight: int = 0
    closed: bool = False
    idle: asyncio.Event = field(default_factory=asyncio.Event)
    # Held requests; a finished wake admits them all at once, before anyone can evict again.
    waiters: list[asyncio.Future[None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.idle.set()


class Traffic:
    """In-flight counts and admission per model, shared by the gateway and the coordinator."""

    def __init__(self) -> None:
        self._lanes: dict[str, Lane] = {}

    def lane(self, name: str) -> Lane:
        return self._lanes.setdefault(name, Lane())

    def enter(self, name: str) -> None:
        lane = self.lane(name)
        lane.in_flight += 1
        lane.idle.clear()

    def leave(self, name: str) -> None:
        lane = self.lane(name)
        lane.in_flight = max(0, lane.in_flight - 1)
        if lane.in_flight == 0:
            lane.idle.set()

    def wait(self, name: str) -> asyncio.Future[None]:
        """A held request's ticket: resolved when `hand_over` admits it (already counted)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.lane(name).waiters.append(fut)
        return fut

    def forget(self, name: str, fut: asyncio.Future[None]) -> bool:
        """Withdraw a ticket; True if it had been admitted meanwhile (the caller must leave)."""
        lane = self.lane(name)
        if fut in lane.waiters:
            lane.waiters.remove(fut)
        if fut.done() and not fut.cancelled():
            return True
        fut.cancel()
        return False

    def hand_over(self, name: str) -> int:
        """Admit every held request of a model that is RUNNING with admission open."""
        lane = self.lane(name)
        if lane.closed:
            return 0
        admitted = 0
        for fut in lane.waiters:
            if not fut.done():
                fut.set_result(None)
                admitted += 1
        lane.waiters.clear()
        if admitted:
            lane.in_flight += admitted
            lane.idle.clear()
        return admitted

    def in_flight(self, name: str) -> int:
        return self.lane(name).in_flight

    def is_closed(self, name: str) -> bool:
        return self.lane(name).closed


@dataclass(frozen=True)
class SwapResult:
    """What a policy wake did: the plan (decision and reason), the wake, and timings."""

    plan: WakePlan
    outcome: Outcome | None
    evicted: tuple[str, ...] = ()
    evict_s: float = 0.0
    wake_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "policy": self.plan.to_dict(),
            "evicted": list(self.evicted),
            "evict_s": self.evict_s,
            "wake_s": self.wake_s,
            "swap_s": self.evict_s + self.wake_s,
        }


class SwapCoordinator:
    """Policy wakes and traffic-draining sleeps over the manager's models."""

    def __init__(
        self,
        manager: Manager,
        settings: Settings,
        metrics: SwapMetrics,
        *,
        traffic: Traffic | None = None,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
    ) -> None:
        self.manager = manager
        self.settings = settings
        self.metrics = metrics
        self.traffic = traffic if traffic is not None else Traffic()
        self._clock = clock  # the manager's clock: snapshots' `since` is on it
        self._mono = monotonic
        self._models = {m.name: m for m in settings.models}
        self._footprints: dict[str, int] = {
            m.name: m.footprint_bytes for m in settings.models if m.footprint_bytes is not None
        }
        self._configured = set(self._footprints)
        self._last_used: dict[str, float] = {}
        self._measured_budget: dict[str, int] = {}
        self._locks: dict[str, asyncio.Lock] = {}
        self._pending: dict[str, asyncio.Task[SwapResult]] = {}
        for m in settings.models:
            metrics.register_model(m.name)

    # ---- what the policy sees ------------------------------------------------------------

    def device(self, name: str) -> str:
        m = self._models.get(name)
        return m.device if m is not None else "0"

    def budget(self, device: str) -> Budget:
        cfg = self.settings.swap
        measured = self._measured_budget.get(device)
        return Budget(
            bytes=cfg.budget_bytes if cfg.budget_bytes is not None else measured,
            max_awake=cfg.max_awake,
            min_awake_s=cfg.min_awake_s,
        )

    def set_measured_budget(self, device: str, n: int | None) -> None:
        if n is not None:
            self._measured_budget[device] = n
            log.info("measured budget of device %s: %d bytes", device, n)

    def touch(self, name: str) -> None:
        """A request for `name` arrived: it is the most recently used now."""
        self._last_used[name] = self._clock()

    def footprint(self, name: str) -> int | None:
        return self._footprints.get(name)

    def learn_footprint(self, name: str, n: int | None, source: str) -> None:
        """Record a measured awake footprint (a configured one is never overwritten)."""
        if n is None or name in self._configured:
            return
        if self._footprints.get(name) != n:
            log.info("%s: awake footprint %d bytes (%s)", name, n, source, extra={"model": name})
        self._footprints[name] = n

    def learn_from_info(self, name: str, ranks: list[dict[str, Any]]) -> None:
        self.learn_footprint(name, footprint_from_info(ranks), "hotswap_info pools")

    def views(self) -> list[ModelView]:
        out = []
        for name, snap in self.manager.snapshots().items():
            cfg = self._models.get(name)
            out.append(
                ModelView(
                    name=name,
                    state=snap.state,
                    footprint_bytes=self._footprints.get(name),
                    last_used=self._last_used.get(name, 0.0),
                    awake_since=snap.since if snap.state is State.RUNNING else None,
                    pinned=cfg.pinned if cfg is not None else False,
                    device=cfg.device if cfg is not None else "0",
                )
            )
        return out

    def plan(self, name: str, *, allow_evict: bool = True) -> WakePlan:
        device = self.device(name)
        return plan_wake(
            name, self.views(), self.budget(device), self._clock(), allow_evict=allow_evict
        )

    def _lock(self, device: str) -> asyncio.Lock:
        return self._locks.setdefault(device, asyncio.Lock())

    # ---- wake ----------------------------------------------------------------------------

    async def wake(self, name: str, *, evict: bool = True) -> SwapResult:
        """Wake `name` within the budget; evicts LRU models first unless `evict` is False.

        Raises WakeRefused (409) when the policy says no, the manager's errors otherwise.
        Concurrent evicting wakes of one model share one run.
        """
        mm = self.manager.get(name)
        snap = mm.snapshot()
        if snap.state is State.RUNNING:
            return SwapResult(WakePlan(name, Decision.NOOP, "already RUNNING"), None)
        if not evict:
            return await self._wake(name, evict=False)
        task = self._pending.get(name)
        if task is None or task.done():
            task = asyncio.create_task(self._wake(name, evict=True), name=f"hotswap-swap-{name}")
            task.add_done_callback(self._swap_done)
            self._pending[name] = task
        # shield: one caller giving up (a client gone) does not stop the swap for the others.
        return await asyncio.shield(task)

    def _swap_done(self, task: asyncio.Task[SwapResult]) -> None:
        if not task.cancelled():
            task.exception()  # retrieved here; the callers got it already

    async def _wake(self, name: str, *, evict: bool) -> SwapResult:
        mm = self.manager.get(name)
        device = self.device(name)
        async with self._lock(device):
            await self._settle(device, name)
            plan = self.plan(name, allow_evict=evict)
            fields = {"model": name, "phase": "policy"}
            log.info(
                "%s: wake plan %s: %s",
                name,
                plan.decision.value,
                plan.reason,
                extra=fields,
            )
            if plan.decision is Decision.NOOP:
                outcome = await mm.wake() if mm.snapshot().state is State.RESUMING else None
                if mm.snapshot().state is State.RUNNING:
                    self.traffic.hand_over(name)
                return SwapResult(plan, outcome)
            if plan.decision is Decision.REFUSE:
                self.metrics.swap(name, "refused")
                raise WakeRefused(
                    f"cannot wake {name}: {plan.reason}",
                    plan=plan.to_dict(),
                    retry_after_s=plan.retry_after_s,
                    model=name,
                )
            t0 = self._mono()
            evicted: list[str] = []
            try:
                for victim in plan.evict:
                    await self.sleep(victim, drain="wait", reason="evict")
                    evicted.append(victim)
                    self.metrics.eviction(victim, "lru")
                t1 = self._mono()
                outcome = await mm.wake()
            except HotswapError:
                self.metrics.swap(name, "failed", self._mono() - t0)
                raise
            t2 = self._mono()
            if mm.snapshot().state is State.RUNNING:
                self.traffic.hand_over(name)  # before the lock goes: no eviction overtakes them
            self.metrics.swap(name, "ok", t2 - t0)
            result = SwapResult(plan, outcome, tuple(evicted), t1 - t0, t2 - t1)
            log.info(
                "%s: swapped in after %.3f s (evicted %s in %.3f s, wake %.3f s)",
                name,
                t2 - t0,
                ", ".join(evicted) or "none",
                t1 - t0,
                t2 - t1,
                extra=fields,
            )
            return result

    def device_lock(self, name: str) -> asyncio.Lock:
        """The lock every wake plan of `name`'s device runs under (boots take it too)."""
        return self._lock(self.device(name))

    async def make_room(self, name: str) -> tuple[str, ...]:
        """Holding the device lock: put to sleep what a wake of `name` would evict, so its
        engine (re)starts with its footprint free. A refusal is logged, not raised."""
        views = [
            dataclasses.replace(v, state=State.SUSPENDED) if v.name == name else v
            for v in self.views()
        ]
        plan = plan_wake(name, views, self.budget(self.device(name)), self._clock())
        fields = {"model": name, "phase": "policy"}
        log.info("%s: start plan %s: %s", name, plan.decision.value, plan.reason, extra=fields)
        evicted = []
        if plan.decision is Decision.EVICT:
            for victim in plan.evict:
                await self.sleep(victim, drain="wait", reason="evict")
                self.metrics.eviction(victim, "restart")
                evicted.append(victim)
        return tuple(evicted)

    async def _settle(self, device: str, name: str) -> None:
        """Wait (bounded) for transitions in flight on the device, so the plan sees where
        they end. Timeouts: a drain, then an RPC, at most."""
        deadline = self._mono() + self.settings.timeouts.drain_s + self.settings.timeouts.rpc_s
        moving = (State.SUSPENDING, State.STARTING)
        while self._mono() < deadline:
            busy = [
                n
                for n, s in self.manager.snapshots().items()
                if self.device(n) == device and s.state in moving
            ]
            if not busy:
                return
            await asyncio.sleep(SETTLE_POLL_S)

    # ---- sleep ---------------------------------------------------------------------------

    async def sleep(
        self,
        name: str,
        level: int | None = None,
        drain: DrainMode = "wait",
        drain_timeout_s: float | None = None,
        *,
        reason: str = "request",
    ) -> Outcome:
        """Close the model's gateway admission, drain the gateway's requests per `drain`,
        then run the manager's sleep (which drains the engine itself)."""
        mm = self.manager.get(name)
        if mm.snapshot().state is not State.RUNNING:
            return await mm.sleep(level, drain, drain_timeout_s)  # noop, join or 409 as usual
        if drain_timeout_s is None:
            if reason == "evict":
                grace = self.settings.swap.evict_drain_timeout_s
            else:
                grace = self.settings.timeouts.drain_s if drain == "wait" else 0.0
        else:
            grace = drain_timeout_s
        lane = self.traffic.lane(name)
        lane.closed = True
        fields = {"model": name, "phase": "drain"}
        try:
            t0 = self._mono()
            if lane.in_flight:
                log.info(
                    "%s: waiting up to %g s for %d gateway request(s) in flight (drain=%s)",
                    name,
                    grace,
                    lane.in_flight,
                    drain,
                    extra=fields,
                )
                try:
                    await asyncio.wait_for(lane.idle.wait(), grace)
                except TimeoutError:
                    if drain == "wait":
                        raise DrainTimeout(
                            f"drain=wait: {lane.in_flight} gateway request(s) still in flight "
                            f"after {grace:g} s; {name} stays RUNNING",
                            model=name,
                            phase="drain",
                        ) from None
                    # drain=abort: the engine's /pause?mode=abort ends them; they see "abort".
            left = max(0.0, grace - (self._mono() - t0))
            outcome = await mm.sleep(level, drain, left)
        finally:
            lane.closed = False
            if mm.snapshot().state is State.RUNNING:
                self.traffic.hand_over(name)  # the sleep gave up: serve what was held
        self.learn_footprint(name, footprint_from_sleep(outcome.transition), "bytes freed at sleep")
        return outcome
