"""Wakes with the swap policy, and sleeps that drain the gateway's traffic first.

`SwapCoordinator` is the one place that decides "wake X, putting Y to sleep first": it
reads the policy's view from the fleet's records (`controller.fleet.swapview`), runs
`policy.plan_wake` under one lock per device (plans never race), logs the decision with
its reason, and runs the evictions and the wake through the manager.

A sleep through the coordinator closes the model's admission lane first (its record's
`lane`), so a drain=wait sleep waits for the gateway's requests in flight and nothing new
slips in between (the gateway holds those for the next wake).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from controller.config.settings import Settings
from controller.errors import (
    DeepSleepRefused,
    DrainTimeout,
    HotswapError,
    TransitionConflict,
    WakeRefused,
)
from controller.fleet.hostswap import HostMemory
from controller.fleet.overlap import Overlap, plan_overlap
from controller.fleet.policy import Decision, WakePlan, estimate, plan_wake
from controller.fleet.swapsteps import OverlappedSwap, evict_side_by_side, restore_ahead
from controller.fleet.swapview import SwapView
from controller.models.footprints import footprint_from_sleep
from controller.models.manager import Manager
from controller.models.modelmanager import ModelManager, Outcome
from controller.models.record import ModelRecord
from controller.models.steps import DrainMode
from controller.observe.swapmetrics import SwapMetrics
from controller.state import Action, Request, State, decide

log = logging.getLogger("hotswap.swap")

Clock = Callable[[], float]


@dataclass(frozen=True)
class SwapResult:
    """What a wake did: the policy's plan (decision and reason; None: no policy, a sidecar
    without hot swap), the wake, and timings."""

    plan: WakePlan[ModelManager] | None
    outcome: Outcome | None
    evicted: tuple[str, ...] = ()
    evict_s: float = 0.0
    wake_s: float = 0.0  # overlapped: from the evicted model's KV release to the end
    overlapped: bool = False  # the evicted model's offload ran beside this wake's load
    total_s: float | None = None  # first eviction's start to the wake's end

    def to_dict(self) -> dict[str, Any]:
        swap = self.total_s if self.total_s is not None else self.evict_s + self.wake_s
        return {
            "policy": self.plan.to_dict() if self.plan is not None else None,
            "evicted": list(self.evicted),
            "evict_s": self.evict_s,
            "wake_s": self.wake_s,
            "overlapped": self.overlapped,
            "swap_s": swap,
        }


class SwapCoordinator(SwapView):
    """Policy wakes and traffic-draining sleeps over the manager's models; what the policy
    sees of them (views, budgets, footprints, device locks) is the `SwapView` below."""

    def __init__(
        self,
        manager: Manager,
        settings: Settings,
        metrics: SwapMetrics,
        *,
        clock: Clock = time.time,
        monotonic: Clock = time.monotonic,
    ) -> None:
        self.manager = manager
        self._mono = monotonic
        super().__init__(manager.fleet, manager.models(), settings, metrics, clock=clock)
        self.host = HostMemory(self)
        self._ckpt_locks: dict[str, asyncio.Lock] = {}

    # ---- wake ----------------------------------------------------------------------------

    def begin_wake(self, mm: ModelManager, *, evict: bool = True) -> Outcome:
        """?wait=false: what will happen (a wake the state forbids is refused now, 409, and so
        is one that finds no room when it may not evict), the wake itself in a task of the
        sidecar's."""
        now = _decide_now(mm, Request.WAKE)
        if not evict and now.action is Action.BEGIN:
            plan = self.plan(mm, allow_evict=False)  # no room and no eviction: say so now
            if plan.decision is Decision.REFUSE:
                raise _refused(mm.name, plan)
        self.manager.tasks.spawn(self.wake(mm, evict=evict), name=f"hotswap-api-wake-{mm.name}")
        return now

    async def wake(self, mm: ModelManager, *, evict: bool = True) -> SwapResult:
        """Wake the model within the budget; evicts the least used models first unless `evict`
        is False.

        Raises WakeRefused (409) when the policy says no, the manager's errors otherwise.
        Concurrent evicting wakes of one model share one run.
        """
        if mm.snapshot().state is State.RUNNING:
            return SwapResult(WakePlan(mm.name, Decision.NOOP, "already RUNNING"), None)
        if not evict:
            return await self._wake(mm, evict=False)
        swapping = mm.record.swapping
        task = swapping.in_flight()
        if task is None:
            task = self.manager.tasks.spawn(self._wake(mm, evict=True), f"hotswap-swap-{mm.name}")
            swapping.swapping(task)
        # shield: one caller giving up (a client gone) does not stop the swap for the others.
        result: SwapResult = await asyncio.shield(task)
        return result

    async def _wake(self, mm: ModelManager, *, evict: bool) -> SwapResult:
        name, rec = mm.name, mm.record
        async with contextlib.AsyncExitStack() as lock:
            await lock.enter_async_context(self._device_locks(rec))
            await _settle(self, rec)
            plan = await self._deepened_plan(mm, evict)
            fields = {"model": name, "phase": "policy"}
            held = plan.decision is Decision.REFUSE and plan.retry_after_s is not None
            if held:  # a refusal that passes (min_awake_s): its caller asks again then
                wait = plan.retry_after_s or 0.0
                log.info("%s: wake held %.1f s: %s", name, wait, plan.reason, extra=fields)
            else:
                log.info(
                    "%s: wake plan %s: %s", name, plan.decision.value, plan.reason, extra=fields
                )
            if plan.decision is Decision.NOOP:
                outcome = await mm.wake() if mm.snapshot().state is State.RESUMING else None
                if mm.snapshot().state is State.RUNNING:
                    rec.lane.hand_over()
                return SwapResult(plan, outcome)
            if plan.decision is Decision.REFUSE:
                self.metrics.swap(name, "held" if held else "refused")
                raise _refused(name, plan)
            overlap = self.overlap(mm, plan)
            if plan.decision is Decision.EVICT:
                log.info(
                    "%s: swap %s: %s",
                    name,
                    "overlapped" if overlap.ok else "one after the other",
                    overlap.reason,
                    extra=fields,
                )
            t0 = self._mono()
            victims = [v.model for v in plan.evict]
            try:
                outcome, evicted, t1, evict_s = await self._evict_and_wake(
                    mm, plan, overlap, lock, t0
                )
            except HotswapError:
                self.metrics.swap(name, "failed", self._mono() - t0)
                raise
            finally:
                _deepen_later(self, victims)
            t2 = self._mono()
            # Awake: its host copy is back on the device; what it keeps there (a CUDA
            # engine's pinned backup) is what its resumes said.
            rec.holdings.release_host()
            if mm.snapshot().state is State.RUNNING:
                rec.lane.hand_over()  # before the lock goes, or while held: none evicts it
                _host_after_wake(self, mm, outcome)
            self.metrics.swap(name, "ok", t2 - t0)
            result = SwapResult(
                plan,
                outcome,
                tuple(evicted),
                evict_s,
                t2 - t1,
                overlapped=overlap.ok,
                total_s=t2 - t0,
            )
            log.info(
                "%s: swapped in after %.3f s (evicted %s in %.3f s, wake %.3f s%s)",
                name,
                t2 - t0,
                ", ".join(evicted) or "none",
                evict_s,
                t2 - t1,
                ", overlapped" if overlap.ok else "",
                extra=fields,
            )
            return result

    async def _evict_and_wake(
        self,
        mm: ModelManager,
        plan: WakePlan[ModelManager],
        overlap: Overlap,
        lock: contextlib.AsyncExitStack,
        t0: float,
    ) -> tuple[Outcome, list[str], float, float]:
        """The plan's evictions and the wake (overlapped, or once the victims are asleep),
        a deep target restored beside the evictions where that fits: its wake begins (and
        the device's lock goes) with the restore still ending under it. The wake's outcome,
        the models evicted, when the wake started and how long the evictions took."""
        victims = [v.model for v in plan.evict]
        early = overlap.ok and overlap.early  # its wake (and restore) starts at once
        ahead = None if early else restore_ahead(self, mm, plan)
        try:
            if overlap.ok:
                swap = OverlappedSwap(self, mm, victims[0], overlap)
                outcome, t1, evict_s = await swap.run(lock)
                return outcome, [victims[0].name], t1, evict_s
            evicted = await evict_side_by_side(self, victims)
            t1 = self._mono()
            return await _wake_beside(self, mm, lock), evicted, t1, t1 - t0
        except BaseException:
            if ahead is not None:  # an eviction failed: it stays asleep, restored or FAILED
                await asyncio.wait({ahead})  # before the lock goes
            raise

    async def _deepened_plan(self, mm: ModelManager, evict: bool) -> WakePlan[ModelManager]:
        """`_deep_plan`; a refusal that may pass while peers wake beside it (RESUMING, not
        evictable) is planned again once they are awake (bounded), as when their wakes held
        the device's lock."""
        plan = await self._deep_plan(mm, evict)
        passes = plan.decision is Decision.REFUSE and plan.retry_after_s is not None
        if passes:
            fields = {"model": mm.name, "phase": "policy"}
            log.info(
                "%s: wake planned again once its peers settle: %s",
                mm.name,
                plan.reason,
                extra=fields,
            )
        if passes and await _settle(self, mm.record, waking=True):
            plan = await self._deep_plan(mm, evict)
        return plan

    async def _deep_plan(self, mm: ModelManager, evict: bool) -> WakePlan[ModelManager]:
        """The wake's plan once the sleepers it takes deep are deep (the third tier: before
        anything awake is evicted). A sleeper that did not go deep is marked unable, with
        its reason, and the wake is planned again without it."""
        plan = self.plan(mm, allow_evict=evict)
        for _ in range(3):
            if not plan.deepen:
                return plan
            log.info("%s: wake plan %s: %s", mm.name, plan.decision.value, plan.reason)
            await asyncio.gather(*(_take_deep(view.model) for view in plan.deepen))
            plan = self.plan(mm, allow_evict=evict)
        return plan

    def checkpoint_lock(self, device: str) -> asyncio.Lock:
        """Held by an evicted model's checkpoint after its swap: one at a time per device."""
        return self._ckpt_locks.setdefault(device, asyncio.Lock())

    def overlap(self, mm: ModelManager, plan: WakePlan[ModelManager]) -> Overlap:
        """Whether this evicting wake may overlap the evicted model's offload with the
        target's load (controller.fleet.overlap.plan_overlap over the records' measured pools)."""
        if plan.decision is not Decision.EVICT or len(plan.evict) != 1:
            return Overlap(False, "not a one-model eviction")
        mode = self.settings.swap.overlap
        if mode == "never":
            return Overlap(False, "swap.overlap is never")
        evicted = plan.evict[0].model.record
        if any(r.settings.sleep_driver == "vllm" for r in (evicted, mm.record)):
            return Overlap(False, "vLLM's own sleep (sleep_driver vllm) is never split by pool")
        held = evicted.holdings
        if mode == "auto" and not held.copied_bytes:
            why = "not seen to copy" if held.copied_bytes is None else "copies"
            return Overlap(
                False,
                f"{evicted.name}'s sleep {why} no weights off the device: nothing to overlap",
            )
        views = self.views()
        victim = next(v for v in views if v.model is plan.evict[0].model)
        peers = [v for v in views if set(v.placement) & set(victim.placement)]
        counted = estimate(victim, peers, self.budget(victim.device))
        scratch = held.codec_scratch  # its encode, beside the wake's
        ov = plan_overlap(plan, held.pools, mm.record.holdings.pools, counted, scratch)
        if ov.early and evicted.lane.in_flight:
            # Its drain may give up and leave it RUNNING: the target then starts once the
            # victim's KV cache is gone, not before (its weights would come in for nothing
            # and its wake fail in wait_room, in place of the drain's own answer).
            ov = dataclasses.replace(ov, early=False)
        return ov

    async def make_room(self, mm: ModelManager) -> tuple[str, ...]:
        """Holding the device lock: put to sleep what a wake of the model would evict, so its
        engine (re)starts with its footprint free. A refusal is logged, not raised."""
        name = mm.name
        # A boot maps no host copy back: no wake scratch.
        views = [
            dataclasses.replace(v, state=State.SUSPENDED, wake_scratch_bytes=0)
            if v.model is mm
            else v
            for v in self.views()
        ]
        # planned once: no refusal that waits for the device's wakes to end
        plan = plan_wake(mm, views, self.budgets(mm.record), self._clock(), wait_for_wakes=False)
        fields = {"model": name, "phase": "policy"}
        log.info("%s: start plan %s: %s", name, plan.decision.value, plan.reason, extra=fields)
        evicted = []
        if plan.decision is Decision.EVICT:
            for view in plan.evict:
                await self.sleep(view.model, drain="wait", reason="evict")
                self.metrics.eviction(view.name, "restart")
                evicted.append(view.name)
        return tuple(evicted)

    # ---- sleep ---------------------------------------------------------------------------

    def begin_sleep(
        self,
        mm: ModelManager,
        level: int | None = None,
        drain: DrainMode = "wait",
        drain_timeout_s: float | None = None,
        *,
        keep_prefix_cache: bool | None = None,
        deep: bool | None = None,
    ) -> Outcome:
        """?wait=false: what will happen (a sleep the state forbids is refused now, 409), the
        draining sleep itself in a task of the sidecar's."""
        now = _decide_now(mm, Request.SLEEP)
        kept = keep_prefix_cache
        sleep = self.sleep(mm, level, drain, drain_timeout_s, keep_prefix_cache=kept, deep=deep)
        self.manager.tasks.spawn(sleep, name=f"hotswap-api-sleep-{mm.name}")
        return now

    async def sleep(
        self,
        mm: ModelManager,
        level: int | None = None,
        drain: DrainMode = "wait",
        drain_timeout_s: float | None = None,
        *,
        reason: str = "request",
        kv_released: Callable[[], None] | None = None,
        keep_prefix_cache: bool | None = None,
        deep: bool | None = None,
    ) -> Outcome:
        """Close the model's gateway admission, drain the gateway's requests per `drain`,
        then run the manager's sleep (which drains the engine itself); `kv_released`: the
        sleep split by pool, called once its KV cache is off the device. `deep`: the
        driver's checkpoint after it (None: the model's setting)."""
        name, rec = mm.name, mm.record
        if mm.snapshot().state is not State.RUNNING:
            # noop, join or 409 as usual (deep asked of a sleeper deepens it)
            return await mm.sleep(
                level, drain, drain_timeout_s, keep_prefix_cache=keep_prefix_cache, deep=deep
            )
        if drain_timeout_s is None:
            if reason == "evict":
                grace = self.settings.swap.evict_drain_timeout_s
            else:
                grace = self.settings.timeouts.drain_s if drain == "wait" else 0.0
        else:
            grace = drain_timeout_s
        lane = rec.lane
        lane.close()
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
                idle = await rec.wait_for(lambda r: r.lane.in_flight == 0, grace)
                if not idle and drain == "wait":
                    raise DrainTimeout(
                        f"drain=wait: {lane.in_flight} gateway request(s) still in flight "
                        f"after {grace:g} s; {name} stays RUNNING",
                        model=name,
                        phase="drain",
                    ) from None
                    # drain=abort: the engine's /pause?mode=abort ends them; they see "abort".
            left = max(0.0, grace - (self._mono() - t0))
            # With a host budget, host plans and the sleeps they admit never race.
            budgeted = self.settings.swap.host_budget is not None
            async with self.host.lock if budgeted else contextlib.nullcontext():
                level = await self.host.room(mm, level)
                outcome = await mm.sleep(
                    level,
                    drain,
                    left,
                    kv_released=kv_released,
                    keep_prefix_cache=keep_prefix_cache,
                    deep=deep,
                )
                self.host.slept(rec, outcome)
        finally:
            lane.close(False)
            if mm.snapshot().state is State.RUNNING:
                lane.hand_over()  # the sleep gave up: serve what was held
        self.learn_footprint(rec, footprint_from_sleep(outcome.transition), "bytes freed at sleep")
        if outcome.transition is not None and outcome.transition.result == "ok":
            self.metrics.slept(name, reason)
        if outcome.snapshot.resident_bytes is not None and not outcome.snapshot.deep:
            # (a deep sleeper's figure is NVML's after its checkpoint: not what it holds awake)
            rec.holdings.left_on_device(outcome.snapshot.resident_bytes)
        return outcome

    def host_budget_bytes(self) -> int | None:
        return self.host.budget().bytes


async def _settle(coord: SwapCoordinator, rec: ModelRecord, waking: bool = False) -> bool:
    """Wait (bounded) for transitions in flight on the model's devices, so the plan sees
    where they end (whether any was); `waking`: wakes too, up to their held requests'
    hand-over. Timeouts: a drain, then an RPC, at most."""
    # Not STARTING: a boot may take many minutes, and the policy counts it as holding.
    mine = set(rec.settings.placement)
    on_device = [r for r in coord.fleet.values() if mine & set(r.settings.placement)]

    def moving() -> bool:
        return any(
            r.state is State.SUSPENDING
            or (
                waking and (r.state is State.RESUMING or (r.lane.held and r.state is State.RUNNING))
            )
            for r in on_device
        )

    if not moving():
        return False
    await coord.fleet.wait_for(
        lambda: not moving(), coord.settings.timeouts.drain_s + coord.settings.timeouts.rpc_s
    )
    return True


async def _take_deep(sleeper: ModelManager) -> None:
    """One sleeper of a wake's plan taken deep, beside the plan's others (their checkpoints
    side by side, docs/contracts.md §2.2); one that did not go deep is marked unable, with
    its reason."""
    try:
        snap = await sleeper.deepen()
    except (DeepSleepRefused, TransitionConflict) as exc:
        snap = sleeper.record.snapshot
        sleeper.record.ckpt.unable(exc.message)
    if not snap.deep:
        sleeper.record.ckpt.unable(sleeper.record.ckpt.refused or snap.deep_error)
        log.warning("%s: not deep: %s", sleeper.name, sleeper.record.ckpt.refused)


def _host_after_wake(coord: SwapCoordinator, mm: ModelManager, outcome: Outcome) -> None:
    """The host bytes a woken model keeps, and (in a named task: the wake's answer does
    not wait) the host budget enforced over the fleet if they put it over."""
    if coord.host.woke(mm.record, outcome):
        task = coord.manager.tasks.spawn(coord.host.enforce(), f"hotswap-host-{mm.name}")
        mm.record.swapping.enforcing_host(task)


async def _wake_beside(
    coord: SwapCoordinator, mm: ModelManager, lock: contextlib.AsyncExitStack
) -> Outcome:
    """A wake that evicts nothing, or whose victims are asleep: the device's lock goes once
    the model is RESUMING (every later plan counts it at its footprint), so its restore,
    copies and verify run beside the next plans (docs/contracts.md, SwapCoordinator)."""
    task = coord.manager.tasks.spawn(mm.wake(), f"hotswap-wake-{mm.name}")
    rpc_s = coord.settings.timeouts.rpc_s
    begun = asyncio.ensure_future(
        mm.record.wait_for(lambda r: r.state is not State.SUSPENDED, rpc_s)
    )
    try:
        await asyncio.wait({task, begun}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        begun.cancel()
    await lock.aclose()
    return await task


def _deepen_later(coord: SwapCoordinator, evicted: list[ModelManager]) -> None:
    """The checkpoint of every evicted model whose `deep_sleep` is "always", each in a task
    of its own after the swap (docs/contracts.md §2.2): the woken model does not wait for the
    driver's copy. One with gateway requests held for it is about to be woken: it stays at
    level 1 (its checkpoint and restore would be on their path)."""
    for mm in evicted:
        if mm.record.settings.deep_sleep != "always":
            continue
        if not _held(mm):
            coord.manager.tasks.spawn(_deepen(coord, mm), f"hotswap-deepen-{mm.name}")


def _held(mm: ModelManager) -> bool:
    if mm.record.lane.held:
        log.info(
            "%s: not taken deep after its eviction: %d request(s) held for it",
            mm.name,
            mm.record.lane.held,
        )
    return bool(mm.record.lane.held)


async def _deepen(coord: SwapCoordinator, mm: ModelManager) -> None:
    """One checkpoint after a swap at a time per device, each once no wake on the device
    is in flight (or `swap.deepen_wait_s` passed): the driver's copies share the link and
    the driver with a woken model's restore and slow it (docs/contracts.md §2.2). Until its
    turn the model is a level-1 sleeper like any (a wake of it goes ahead, and then it is
    not taken deep); from its turn on it counts as busy until its checkpoint ends."""
    rec = mm.record
    async with contextlib.AsyncExitStack() as stack:
        for d in sorted(rec.settings.placement):
            await stack.enter_async_context(coord.checkpoint_lock(d))
        mine = set(rec.settings.placement)
        peers = [r for r in coord.fleet.values() if mine & set(r.settings.placement)]

        def waking() -> bool:
            return any(r.state is State.RESUMING or r.snapshot.phase == "restore" for r in peers)

        if waking():
            await coord.fleet.wait_for(lambda: not waking(), coord.settings.swap.deepen_wait_s)
        if rec.state is not State.SUSPENDED or rec.snapshot.deep or rec.in_flight_task():
            log.info("%s: not taken deep after its eviction: %s", mm.name, rec.state.value)
            return
        if _held(mm):  # about to be woken
            return
        task = asyncio.current_task()
        if task is not None:
            rec.swapping.deepening(task)
        await _checkpoint(mm)


async def _checkpoint(mm: ModelManager) -> None:
    try:
        await mm.deepen()
    except (DeepSleepRefused, TransitionConflict) as exc:
        # refused (marked unable), or woken or failed meanwhile: it stays as it is
        log.info("%s: not taken deep after its eviction: %s", mm.name, exc.message)
    except HotswapError as exc:  # the runner has recorded what happened to it
        log.warning("%s: its checkpoint after its eviction failed: %s", mm.name, exc)


def _refused(name: str, plan: WakePlan[ModelManager]) -> WakeRefused:
    return WakeRefused(
        f"cannot wake {name}: {plan.reason}",
        plan=plan.to_dict(),
        retry_after_s=plan.retry_after_s,
        model=name,
    )


def _decide_now(mm: ModelManager, req: Request) -> Outcome:
    """?wait=false: a request the state forbids is answered 409 now, in the reply, not only
    in the background task's log line; else what will happen."""
    snap = mm.snapshot()
    action = decide(snap.state, req)
    if action is Action.CONFLICT:
        if snap.state is State.FAILED:
            why = f"the model is FAILED ({snap.last_error}); restart its engine"
        else:
            why = f"the model is {snap.state.value}"
        raise TransitionConflict(f"cannot {req.value} {mm.name}: {why}", model=mm.name)
    return Outcome(action, snap)
