"""The swap policy: may a model wake, and which models must sleep first. Pure, like state.py.

A device has a memory budget (bytes, and optionally a count of awake models). Every model
has an awake footprint, measured from the engine's own reports (the pools `hotswap_info`
lists, or the bytes a suspend freed). A wake that does not fit puts the least used unpinned
models to sleep first (the fewest recent requests, then the least recently used), sparing
those it turns out not to need; pinned models are never evicted, and a model awake for
less than the minimum awake time is not evicted either (no thrash). A FAILED or UNKNOWN
model counts at its footprint until its engine process is known to be gone. Every plan
carries its reason.

The policy speaks of models through their views: each `ModelView` carries the caller's own
object for its model (`model`: the coordinator's `ModelManager`, a test's name), never read
here, and a plan hands back the views it chose, so the caller acts on its objects without
looking a name up (names are resolved once, at the HTTP edge).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from controller.state import State

# States whose engine holds its awake footprint (SUSPENDING until its suspend has finished).
HOLDING = frozenset({State.RUNNING, State.RESUMING, State.SUSPENDING, State.STARTING})
# A victim asked this many times as often as the target (its recent requests, the
# target's counted as at least one) waits for a less asked peer's wake (`after_wakes`).
MORE_ASKED = 2.0
# States that say nothing of the engine's memory: counted at the footprint while it may live.
UNSURE = frozenset({State.FAILED, State.UNKNOWN})


class Decision(enum.StrEnum):
    NOOP = "noop"  # already awake or waking: nothing to do
    WAKE = "wake"  # fits as things are
    EVICT = "evict"  # fits once `evict` are asleep (and `deepen` deep)
    DEEPEN = "deepen"  # fits once `deepen` (sleepers) are deep: nothing awake is evicted
    REFUSE = "refuse"  # does not fit (or may not evict); `reason` says why


M = TypeVar("M")


@dataclass(frozen=True)
class ModelView(Generic[M]):
    """What the policy knows about one model; built from a snapshot plus the gateway's use.
    `model`: the caller's object for it, handed back in plans, never looked into."""

    name: str
    state: State
    footprint_bytes: int | None = None  # awake footprint; None = not measured yet
    last_used: float = 0.0  # seconds (any clock, the same as `now`) of the last request
    # Its gateway requests lately, each 1 decaying (controller.models.fleetparts.Lane): the
    # least used are evicted (and taken deep) first, then the least recently used.
    recent_uses: float = 0.0
    awake_since: float | None = None  # when it last became RUNNING
    pinned: bool = False
    device: str = "0"
    process_gone: bool = False  # its engine process is known to be gone (none was started)
    # Placement: every device the engine uses (tensor parallel); () = just `device`.
    devices: tuple[str, ...] = ()
    # What its engine holds on its devices besides its pools (in all, over ranks: the CUDA
    # context, graph pools, torch's own), as the worker reports it once suspended; 0 until
    # then. Held awake and asleep alike: counted while its process may live.
    asleep_bytes: int = 0
    # Device bytes its next wake takes for a while beyond its footprint (the codec's
    # staging, as its last suspend reported): added to what a wake of it needs.
    wake_scratch_bytes: int = 0
    # Host memory: what the model holds in host RAM now (a level-1 sleeper's weights, an
    # awake model's kept backup), and what a level-1 sleep would hold (its weights' bytes).
    host_bytes: int = 0
    host_weights_bytes: int | None = None
    level: int | None = None  # the sleep level while SUSPENDED
    demotable: bool = True  # its engine can drop a level-1 host copy while asleep
    # Deep sleep (docs/contracts.md §2.2): its engine is checkpointed now (`asleep_bytes` is
    # then what NVML measured), and whether the policy may take it deep while it sleeps.
    deep: bool = False
    deepable: bool = False
    # A deep sleeper: what its restore brings back to its devices (what it left beside its
    # pools before its checkpoint, in all); a wake of it needs that beside its footprint.
    restore_bytes: int = 0
    # The gateway's requests in flight and held for it, and whether a transition runs.
    in_flight: int = 0
    queued: int = 0
    busy: bool = False
    model: M = field(kw_only=True, compare=False, repr=False)

    @property
    def placement(self) -> tuple[str, ...]:
        return self.devices or (self.device,)

    @property
    def holds(self) -> bool:
        """Whether its engine may hold its awake footprint now: a FAILED or UNKNOWN model
        counts until its process is gone (a failed step may have freed nothing)."""
        return self.state in HOLDING or (self.state in UNSURE and not self.process_gone)

    @property
    def leaves(self) -> bool:
        """Whether its engine holds what it leaves besides its pools (`asleep_bytes`): while
        it holds its footprint, and asleep while its process lives."""
        return self.holds or (self.state is State.SUSPENDED and not self.process_gone)


@dataclass(frozen=True)
class Budget:
    """Per device. None = no limit of that kind."""

    bytes: int | None = None
    max_awake: int | None = None
    min_awake_s: float = 0.0


@dataclass(frozen=True)
class WakePlan(Generic[M]):
    """The wake of `model` (its name, for the report): the decision, why, and the views of
    the models it evicts (`evict`) and takes deep first (`deepen`), each with its object."""

    model: str
    decision: Decision
    reason: str
    evict: tuple[ModelView[M], ...] = ()
    need_bytes: int = 0  # the target's footprint as the plan counted it
    used_bytes: int = 0  # what the other awake models on the device hold now
    budget_bytes: int | None = None
    retry_after_s: float | None = None  # a refusal that goes away by itself after this long
    devices: tuple[str, ...] = ()  # the target's devices (the plan looked at these only)
    scratch_bytes: int = 0  # of need_bytes, what the wake holds only while it runs
    deepen: tuple[ModelView[M], ...] = ()  # sleepers taken deep first (their leftover freed)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "devices": list(self.devices),
            "decision": self.decision.value,
            "reason": self.reason,
            "evict": [v.name for v in self.evict],
            "need_bytes": self.need_bytes,
            "used_bytes": self.used_bytes,
            "budget_bytes": self.budget_bytes,
            "retry_after_s": self.retry_after_s,
            "scratch_bytes": self.scratch_bytes,
            "deepen": [v.name for v in self.deepen],
        }


def mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB"


def estimate(view: ModelView[Any], peers: Iterable[ModelView[Any]], budget: Budget) -> int:
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


def _budget_of(budget: Budget | Mapping[str, Budget], device: str) -> Budget:
    return budget if isinstance(budget, Budget) else budget.get(device, Budget())


def plan_wake(
    target: M,
    models: Sequence[ModelView[M]],
    budget: Budget | Mapping[str, Budget],
    now: float,
    *,
    allow_evict: bool = True,
    wait_for_wakes: bool = True,
) -> WakePlan[M]:
    """Decide how `target` (a view's `model`) can wake within the budget of each of its
    devices. `wait_for_wakes`: a victim asked far more than the target may wait for peers
    still waking (`_Wake.after_wakes`; off for a caller that plans only once, a boot's room).

    `budget` is one Budget for every device, or one per device. A model on several devices
    (tensor parallel) needs its share (footprint / devices) on each; only models that share a
    device with it are counted, and only those are evicted (a wake never touches another
    device). Every engine on a device counts what it holds besides its pools
    (`ModelView.asleep_bytes`, its share per device), the target's own included, awake or
    asleep; an awake one adds its footprint. The target needs its footprint plus its
    wake's scratch (`wake_scratch_bytes`)."""
    t = view_of(target, models)
    if t.state in (State.RUNNING, State.RESUMING):
        return WakePlan(t.name, Decision.NOOP, f"already {t.state.value}")
    if t.state is not State.SUSPENDED:
        return WakePlan(t.name, Decision.REFUSE, f"cannot wake a model in state {t.state.value}")
    w = _Wake.of(t, models, budget)
    w.wait_for_wakes = wait_for_wakes
    refused = w.beyond_budget()
    if refused is not None:
        return refused
    if w.fits():
        return w.plan(Decision.WAKE, _fit_reasons(w.mine, w.used_on, w.need, w.budgets))
    short = w.over_text()
    took = w.deepen_sleepers()
    if took and w.fits():
        return w.plan(Decision.DEEPEN, f"over budget ({short}): {took}")
    return w.evict_sparing_checkpoints(now, short, took, allow_evict)


def view_of(target: M, models: Sequence[ModelView[M]]) -> ModelView[M]:
    """The view whose `model` is `target` (KeyError: none)."""
    for m in models:
        if m.model == target:
            return m
    raise KeyError(target)


class _Wake(Generic[M]):
    """One wake being planned: what the target needs on each of its devices, what the
    models sharing them hold, and the sleepers taken deep so far (the plan's steps). Within
    one plan, views are told apart by name."""

    def __init__(
        self,
        t: ModelView[M],
        models: Sequence[ModelView[M]],
        budgets: dict[str, Budget],
        sizes: dict[str, int],
    ) -> None:
        self.t = t
        self.models = models
        self.by_name = {m.name: m for m in models}
        self.mine = t.placement
        self.budgets = budgets
        self.on = {d: [m for m in models if d in m.placement] for d in self.mine}
        self.sizes = sizes
        self.peers = [
            m for m in models if m.name != t.name and m.holds and set(m.placement) & set(self.mine)
        ]
        self.scratch = max(0, t.wake_scratch_bytes)
        # a deep target's restore brings back what its own leftover no longer counts
        self.restore = max(0, t.restore_bytes - t.asleep_bytes) if t.deep else 0
        self.need_total = sizes[t.name] + self.scratch + self.restore
        self.need = {d: _share(self.need_total, t) for d in self.mine}
        # Sleepers the plan takes deep: their leftover is freed (the third tier).
        self.deepened: list[str] = []
        self.wait_for_wakes = True

    @classmethod
    def of(
        cls,
        t: ModelView[M],
        models: Sequence[ModelView[M]],
        budget: Budget | Mapping[str, Budget],
    ) -> _Wake[M]:
        mine = t.placement
        budgets = {d: _budget_of(budget, d) for d in mine}
        on = {d: [m for m in models if d in m.placement] for d in mine}
        # Awake footprints are estimated per device from the models that share it.
        sizes = {
            m.name: estimate(m, on[d], budgets[d])
            for d in mine
            for m in on[d]
            if m.name == t.name or m.holds
        }
        return cls(t, models, budgets, sizes)

    def leftover(self, d: str) -> int:
        """What every live engine on `d` holds besides its pools, evicted or not (the
        target's too), but the sleepers taken deep."""
        return sum(
            _share(m.asleep_bytes, m)
            for m in self.on[d]
            if m.leaves and m.name not in self.deepened
        )

    def used_on(self, d: str, gone: Iterable[str] = ()) -> tuple[int, int]:
        out = set(gone)
        held = [p for p in self.peers if d in p.placement and p.name not in out]
        return sum(_share(self.sizes[p.name], p) for p in held) + self.leftover(d), len(held)

    def fits(self, gone: Iterable[str] = ()) -> bool:
        gone = tuple(gone)
        return all(_fits(*self.used_on(d, gone), self.need[d], self.budgets[d]) for d in self.mine)

    def over(self, gone: Iterable[str] = ()) -> list[str]:
        gone = tuple(gone)
        return [
            d for d in self.mine if not _fits(*self.used_on(d, gone), self.need[d], self.budgets[d])
        ]

    def over_text(self) -> str:
        parts = [
            _over(*self.used_on(d), self.need[d], self.budgets[d])
            + ("" if len(self.mine) == 1 else f" on {d}")
            for d in self.over()
        ]
        return "; ".join(parts)

    def plan(
        self, decision: Decision, why: str, evict: Sequence[str] = (), retry: float | None = None
    ) -> WakePlan[M]:
        mine, need, scratch = self.mine, self.need, self.scratch
        taken = self.deepened if decision in (Decision.EVICT, Decision.DEEPEN) else []
        deep = tuple(self.by_name[n] for n in taken)
        # With one device the figures are that device's; with several, the tightest's.
        dev = max(mine, key=lambda d: self.used_on(d)[0] + need[d]) if len(mine) > 1 else mine[0]
        if scratch:
            why += f" (the need includes {mib(scratch)} of scratch the wake holds while it runs)"
        if self.restore:
            why += f" (the need includes {mib(self.restore)} its restore brings back)"
        return WakePlan(
            self.t.name,
            decision,
            why,
            tuple(self.by_name[n] for n in evict),
            need[dev] if len(mine) > 1 else self.need_total,
            self.used_on(dev)[0],
            self.budgets[dev].bytes,
            retry,
            devices=mine,
            scratch_bytes=_share(scratch, self.t) if len(mine) > 1 else scratch,
            deepen=deep,
        )

    def beyond_budget(self) -> WakePlan[M] | None:
        """A refusal when no eviction could ever make room on some device."""
        for d in self.mine:
            b = self.budgets[d]
            if b.bytes is not None and self.need[d] > b.bytes:
                where = "" if len(self.mine) == 1 else f" on device {d}"
                why = (
                    f"needs {mib(self.need[d])}{where}, "
                    f"more than the whole budget of {mib(b.bytes)}"
                )
                return self.plan(Decision.REFUSE, why)
            if b.max_awake is not None and b.max_awake < 1:
                return self.plan(Decision.REFUSE, "the budget allows no awake model")
        return None

    def deepen_sleepers(self) -> str:
        """Take sleepers deep, least recently used first, until the target fits; what was
        taken, as the reason says it ("" if none)."""
        deepable = sorted(
            (
                m
                for m in self.models
                if m.name != self.t.name and _may_deepen(m) and set(m.placement) & set(self.mine)
            ),
            key=_least_used,
        )
        for m in deepable:
            if self.fits():
                break
            if set(m.placement) & set(self.over()):  # frees something where room is short
                self.deepened.append(m.name)
        if not self.deepened:
            return ""
        freed = sum(self.by_name[n].asleep_bytes for n in self.deepened)
        return (
            f"taking {', '.join(self.deepened)} deep first (frees {mib(freed)} left beside pools)"
        )

    def evict_sparing_checkpoints(
        self, now: float, short: str, took: str, allow_evict: bool
    ) -> WakePlan[M]:
        """Deepening alone was not enough: an eviction is needed anyway. Each checkpoint
        sits on this wake's path and frees only what a sleeper left beside its pools, so
        the sleepers go deep only where that spares an eviction (fewer evicted than without
        them); else the plan evicts alone."""
        if not took:
            return self.evict_or_refuse(now, short, took, allow_evict)
        deepened, self.deepened = self.deepened, []
        alone = self.evict_or_refuse(now, short, "", allow_evict)
        self.deepened = deepened
        both = self.evict_or_refuse(now, short, took, allow_evict)
        if alone.decision is Decision.EVICT and (
            both.decision is not Decision.EVICT or len(alone.evict) <= len(both.evict)
        ):
            return alone
        return both

    def evict_or_refuse(self, now: float, short: str, took: str, allow_evict: bool) -> WakePlan[M]:
        """Evict idle awake peers, least recently used first; else refuse, saying when a
        retry could succeed."""
        min_awake = max(self.budgets[d].min_awake_s for d in self.mine)
        # (a model with requests held for it is handed them as soon as it is RUNNING)
        idle = sorted(
            (p for p in self.peers if p.state is State.RUNNING and not p.pinned and not p.queued),
            key=_least_used,
        )
        ready = [p for p in idle if _awake_for(p, now) >= min_awake]
        fresh = [p for p in idle if _awake_for(p, now) < min_awake]
        chosen: list[str] = []
        for p in ready:
            if self.fits(chosen):
                break
            if set(p.placement) & set(self.over(chosen)):  # frees something where room is short
                chosen.append(p.name)
        if self.fits(chosen):
            names = tuple(self.spare(chosen))
            lru = ", ".join(
                f"{n} (idle {max(0.0, now - self.by_name[n].last_used):.1f} s,"
                f" {self.by_name[n].recent_uses:.1f} recent requests)"
                for n in names
            )
            if not allow_evict:
                why = f"does not fit without evicting {', '.join(names)}, and evict=false"
                return self.plan(Decision.REFUSE, why, names)
            later = self.after_wakes(names) if self.wait_for_wakes else None
            if later is not None:
                return later
            why = f"over budget ({short}): " + (f"{took}, then " if took else "")
            return self.plan(Decision.EVICT, why + f"evicting the least used {lru}", names)
        return self.refuse(now, chosen, fresh, min_awake)

    def after_wakes(self, names: Sequence[str]) -> WakePlan[M] | None:
        """A refusal to be planned again (retry 1.0) when a victim is asked `MORE_ASKED`
        times as often as the target (counted as one request at least) or more, while a peer
        asked less often than that victim is RESUMING: once awake it may go in its place (no
        thrash: the most used model is not evicted because the others were all mid-wake)."""
        waking = [p for p in self.peers if not p.pinned and p.state is State.RESUMING]
        wanted = self.t.recent_uses
        for n in names:
            victim = self.by_name[n]
            if victim.recent_uses < MORE_ASKED * max(wanted, 1.0):
                continue
            less = [p for p in waking if p.recent_uses < victim.recent_uses]
            if less:
                why = (
                    f"over budget ({self.over_text()}): not evicting {n} "
                    f"({victim.recent_uses:.1f} recent requests, {self.t.name} "
                    f"{wanted:.1f}) while {', '.join(p.name for p in less)}, asked less, "
                    "still wake"
                )
                return self.plan(Decision.REFUSE, why, retry=1.0)
        return None

    def spare(self, chosen: list[str]) -> list[str]:
        """The victims the wake needs: each one it fits without is spared, the last taken
        first (a large one taken last may make the small ones before it needless)."""
        kept = list(chosen)
        for name in reversed(chosen):
            rest = [n for n in kept if n != name]
            if self.fits(rest):
                kept = rest
        return kept

    def refuse(
        self, now: float, chosen: list[str], fresh: list[ModelView[M]], min_awake: float
    ) -> WakePlan[M]:
        """Not enough even with every evictable model asleep: would the fresh ones do, later?"""
        gone = list(chosen)
        for p in sorted(fresh, key=lambda p: (min_awake - _awake_for(p, now), p.name)):
            gone.append(p.name)
            if self.fits(gone):
                wait = min_awake - _awake_for(p, now)
                young = ", ".join(q.name for q in fresh)
                why = (
                    f"over budget ({self.over_text()}): {young} awake for less "
                    f"than min_awake_s={min_awake:g}"
                )
                return self.plan(Decision.REFUSE, why, retry=max(0.0, wait))
        pinned = [p.name for p in self.peers if p.pinned]
        busy = [f"{p.name} ({p.state.value})" for p in self.peers if p.state is not State.RUNNING]
        busy += [
            f"{p.name} ({p.queued} request(s) held for it)"
            for p in self.peers
            if p.state is State.RUNNING and p.queued and not p.pinned
        ]
        held = "; ".join(
            part
            for part in (
                f"pinned: {', '.join(pinned)}" if pinned else "",
                f"busy: {', '.join(busy)}" if busy else "",
            )
            if part
        )
        why = f"over budget ({self.over_text()}) and nothing evictable"
        if held:
            why += f" ({held})"
        # A busy peer settles by itself: worth retrying; pinned ones never move.
        retry = 1.0 if busy else None
        return self.plan(Decision.REFUSE, why, retry=retry)


def measured_budget(free: int, device: str, models: Sequence[ModelView[Any]]) -> int:
    """A device's byte budget from its free memory measured with every unpinned model
    asleep: plus what `plan_wake` counts for the models on it then (the pinned ones'
    footprint, every live engine's `asleep_bytes`), so that nothing is counted twice."""
    on = [m for m in models if device in m.placement]
    pinned = sum(_share(m.footprint_bytes or 0, m) for m in on if m.pinned)
    return free + pinned + sum(_share(m.asleep_bytes, m) for m in on if m.leaves)


def _least_used(m: ModelView[Any]) -> tuple[float, float, str]:
    """The order victims (and sleepers taken deep) are chosen in: the fewest recent requests,
    then the least recently used, then by name."""
    return (m.recent_uses, m.last_used, m.name)


def _may_deepen(m: ModelView[Any]) -> bool:
    """A sleeper the policy may take deep: asleep, not deep, allowed and not known unable,
    at rest, holding something beside its pools to free, and not about to be woken (no
    gateway request held for it: its checkpoint and then its restore would be on their
    path)."""
    at_rest = m.state is State.SUSPENDED and not m.busy and not m.process_gone
    wanted = m.queued > 0 or m.in_flight > 0
    return at_rest and not wanted and m.deepable and not m.deep and m.asleep_bytes > 0


def _share(total: int, view: ModelView[Any]) -> int:
    """A model's bytes on each of its devices (tensor parallel shards evenly)."""
    n = len(view.placement)
    return total if n <= 1 else -(-total // n)


def _awake_for(view: ModelView[Any], now: float) -> float:
    return float("inf") if view.awake_since is None else now - view.awake_since


def _fit_reason(used: int, need: int, awake: int, budget: Budget) -> str:
    parts = []
    if budget.bytes is not None:
        parts.append(f"{mib(used)} + {mib(need)} <= {mib(budget.bytes)}")
    if budget.max_awake is not None:
        parts.append(f"{awake + 1} awake <= {budget.max_awake}")
    return ", ".join(parts)


def _fit_reasons(
    devices: tuple[str, ...],
    used_on: Callable[[str], tuple[int, int]],
    need: Mapping[str, int],
    budgets: Mapping[str, Budget],
) -> str:
    parts = []
    for d in devices:
        used, awake = used_on(d)
        text = _fit_reason(used, need[d], awake, budgets[d])
        if text:
            parts.append(text if len(devices) == 1 else f"device {d}: {text}")
    return "fits: " + "; ".join(parts) if parts else "fits: no budget"


def _over(used: int, awake: int, need: int, budget: Budget) -> str:
    parts = []
    if budget.bytes is not None and used + need > budget.bytes:
        parts.append(f"{mib(used)} held + {mib(need)} > {mib(budget.bytes)}")
    if budget.max_awake is not None and awake + 1 > budget.max_awake:
        parts.append(f"{awake} awake, max_awake={budget.max_awake}")
    return "; ".join(parts)


# ----------------------------------------------------------------------------- idle sleep


@dataclass(frozen=True)
class IdlePlan:
    """Whether a model that served nothing for a while is put to sleep now, and if not, how
    long until it might be (None: not while things stay as they are; a change re-plans)."""

    model: str
    sleep: bool
    reason: str
    due_in_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "sleep": self.sleep,
            "reason": self.reason,
            "due_in_s": self.due_in_s,
        }


def plan_idle(view: ModelView[Any], idle_sleep_s: float | None, now: float) -> IdlePlan:
    """Idle sleep: a RUNNING, unpinned model with nothing in flight or queued and no
    transition, idle (no request, and awake) for `idle_sleep_s`, sleeps; never otherwise."""
    name = view.name
    if idle_sleep_s is None:
        return IdlePlan(name, False, "idle sleep is off")
    if view.pinned:
        return IdlePlan(name, False, "pinned")
    if view.state is not State.RUNNING or view.busy:
        return IdlePlan(name, False, f"not at rest ({view.state.value})")
    if view.in_flight or view.queued:
        why = f"{view.in_flight} request(s) in flight, {view.queued} queued"
        return IdlePlan(name, False, why)
    since = max(view.last_used, view.awake_since if view.awake_since is not None else 0.0)
    idle = now - since
    if idle >= idle_sleep_s:
        return IdlePlan(name, True, f"idle {idle:.1f} s >= idle_sleep_s={idle_sleep_s:g}")
    left = idle_sleep_s - idle
    return IdlePlan(name, False, f"idle {max(0.0, idle):.1f} s < {idle_sleep_s:g} s", left)


def restart_delay(failures: int, base_s: float, max_s: float) -> float:
    """Bounded exponential backoff: base, 2*base, 4*base, ... capped at max_s."""
    if failures <= 0:
        return 0.0
    return float(min(max_s, base_s * (2 ** min(failures - 1, 30))))
