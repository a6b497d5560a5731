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
from collections.abc import Callable, Iterable, Mapping, Sequence
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
    # Placement: every device the engine uses (tensor parallel); () = just `device`.
    devices: tuple[str, ...] = ()
    # What a sleeping engine still holds on its devices (in all, over ranks): 0 until the
    # engine reports it (the worker's own figure), counted while SUSPENDED.
    asleep_bytes: int = 0
    # Host memory: what the model holds in host RAM now (a level-1 sleeper's weights, an
    # awake model's kept backup), and what a level-1 sleep would hold (its weights' bytes).
    host_bytes: int = 0
    host_weights_bytes: int | None = None
    level: int | None = None  # the sleep level while SUSPENDED
    demotable: bool = True  # its engine can drop a level-1 host copy while asleep
    # The gateway's requests in flight and held for it, and whether a transition runs.
    in_flight: int = 0
    queued: int = 0
    busy: bool = False

    @property
    def placement(self) -> tuple[str, ...]:
        return self.devices or (self.device,)

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
    devices: tuple[str, ...] = ()  # the target's devices (the plan looked at these only)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "devices": list(self.devices),
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


def _budget_of(budget: Budget | Mapping[str, Budget], device: str) -> Budget:
    return budget if isinstance(budget, Budget) else budget.get(device, Budget())


def plan_wake(
    target: str,
    models: Sequence[ModelView],
    budget: Budget | Mapping[str, Budget],
    now: float,
    *,
    allow_evict: bool = True,
) -> WakePlan:
    """Decide how `target` can wake within the budget of each of its devices.

    `budget` is one Budget for every device, or one per device. A model on several devices
    (tensor parallel) needs its share (footprint / devices) on each; only models that share a
    device with it are counted, and only those are evicted (a wake never touches another
    device). A sleeping peer counts what it leaves behind (`ModelView.asleep_bytes`)."""
    by_name = {m.name: m for m in models}
    if target not in by_name:
        raise KeyError(target)
    t = by_name[target]
    if t.state in (State.RUNNING, State.RESUMING):
        return WakePlan(target, Decision.NOOP, f"already {t.state.value}")
    if t.state is not State.SUSPENDED:
        return WakePlan(target, Decision.REFUSE, f"cannot wake a model in state {t.state.value}")
    mine = t.placement
    budgets = {d: _budget_of(budget, d) for d in mine}
    on = {d: [m for m in models if d in m.placement] for d in mine}
    # Awake footprints are estimated per device from the models that share it.
    sizes = {
        m.name: estimate(m, on[d], budgets[d])
        for d in mine
        for m in on[d]
        if m.name == target or m.holds
    }
    peers = [m for m in models if m.name != target and m.holds and set(m.placement) & set(mine)]
    need_total = sizes[target]
    need = {d: _share(need_total, t) for d in mine}

    def used_on(d: str, gone: Iterable[str] = ()) -> tuple[int, int]:
        out = set(gone)
        held = [p for p in peers if d in p.placement and p.name not in out]
        asleep = sum(
            m.asleep_bytes
            for m in on[d]
            if m.name != target and (m.state is State.SUSPENDED or m.name in out)
        )
        return sum(_share(sizes[p.name], p) for p in held) + asleep, len(held)

    def fits(gone: Iterable[str] = ()) -> bool:
        gone = tuple(gone)
        return all(_fits(*used_on(d, gone), need[d], budgets[d]) for d in mine)

    def over(gone: Iterable[str] = ()) -> list[str]:
        gone = tuple(gone)
        return [d for d in mine if not _fits(*used_on(d, gone), need[d], budgets[d])]

    def over_text() -> str:
        parts = [
            _over(*used_on(d), need[d], budgets[d]) + ("" if len(mine) == 1 else f" on {d}")
            for d in over()
        ]
        return "; ".join(parts)

    first = mine[0]

    def plan(
        decision: Decision, why: str, evict: tuple[str, ...] = (), retry: float | None = None
    ) -> WakePlan:
        # With one device the figures are that device's; with several, the tightest's.
        dev = max(mine, key=lambda d: used_on(d)[0] + need[d]) if len(mine) > 1 else first
        return WakePlan(
            target,
            decision,
            why,
            evict,
            need[dev] if len(mine) > 1 else need_total,
            used_on(dev)[0],
            budgets[dev].bytes,
            retry,
            devices=mine,
        )

    for d in mine:
        b = budgets[d]
        if b.bytes is not None and need[d] > b.bytes:
            where = "" if len(mine) == 1 else f" on device {d}"
            why = f"needs {_mib(need[d])}{where}, more than the whole budget of {_mib(b.bytes)}"
            return plan(Decision.REFUSE, why)
        if b.max_awake is not None and b.max_awake < 1:
            return plan(Decision.REFUSE, "the budget allows no awake model")
    if fits():
        return plan(Decision.WAKE, _fit_reasons(mine, used_on, need, budgets))

    min_awake = max(budgets[d].min_awake_s for d in mine)
    idle = sorted(
        (p for p in peers if p.state is State.RUNNING and not p.pinned),
        key=lambda p: (p.last_used, p.name),
    )
    ready = [p for p in idle if _awake_for(p, now) >= min_awake]
    fresh = [p for p in idle if _awake_for(p, now) < min_awake]

    chosen: list[str] = []
    for p in ready:
        if fits(chosen):
            break
        if set(p.placement) & set(over(chosen)):  # frees something where room is short
            chosen.append(p.name)
    if fits(chosen):
        names = tuple(chosen)
        lru = ", ".join(f"{n} (idle {max(0.0, now - by_name[n].last_used):.1f} s)" for n in chosen)
        if not allow_evict:
            why = f"does not fit without evicting {', '.join(names)}, and evict=false"
            return plan(Decision.REFUSE, why, names)
        why = f"over budget ({over_text()}): evicting LRU {lru}"
        return plan(Decision.EVICT, why, names)

    # Not enough even with every evictable model asleep: would the fresh ones do, later?
    gone = list(chosen)
    for p in sorted(fresh, key=lambda p: (min_awake - _awake_for(p, now), p.name)):
        gone.append(p.name)
        if fits(gone):
            wait = min_awake - _awake_for(p, now)
            young = ", ".join(q.name for q in fresh)
            why = (
                f"over budget ({over_text()}): {young} awake for less "
                f"than min_awake_s={min_awake:g}"
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
    why = f"over budget ({over_text()}) and nothing evictable"
    if held:
        why += f" ({held})"
    # A busy peer settles by itself: worth retrying; pinned ones never move.
    retry = 1.0 if busy else None
    return plan(Decision.REFUSE, why, retry=retry)


def _share(total: int, view: ModelView) -> int:
    """A model's bytes on each of its devices (tensor parallel shards evenly)."""
    n = len(view.placement)
    return total if n <= 1 else -(-total // n)


def _awake_for(view: ModelView, now: float) -> float:
    return float("inf") if view.awake_since is None else now - view.awake_since


def _fit_reason(used: int, need: int, awake: int, budget: Budget) -> str:
    parts = []
    if budget.bytes is not None:
        parts.append(f"{_mib(used)} + {_mib(need)} <= {_mib(budget.bytes)}")
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
        parts.append(f"{_mib(used)} held + {_mib(need)} > {_mib(budget.bytes)}")
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


def plan_idle(view: ModelView, idle_sleep_s: float | None, now: float) -> IdlePlan:
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


# ----------------------------------------------------------------------------- host memory


@dataclass(frozen=True)
class HostBudget:
    """Host RAM the models may hold (level-1 sleepers' weights, awake models' backups)."""

    bytes: int | None = None


@dataclass(frozen=True)
class HostPlan:
    """How a sleep of `model` (or, with model None, the fleet as it is) stays within the host
    budget: the level it sleeps at, awake models whose backup goes first, LRU level-1
    sleepers demoted to level 2. `reason` says why, with the figures."""

    model: str | None
    level: int | None
    reason: str
    drop_backup: tuple[str, ...] = ()
    demote: tuple[str, ...] = ()
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
            "drop_backup": list(self.drop_backup),
            "demote": list(self.demote),
            "need_bytes": self.need_bytes,
            "used_bytes": self.used_bytes,
            "budget_bytes": self.budget_bytes,
        }


def host_need(view: ModelView) -> int:
    """Host bytes a level-1 sleep of `view` holds: its weights (else its awake footprint)."""
    if view.host_weights_bytes is not None:
        return view.host_weights_bytes
    return view.footprint_bytes or 0


def plan_host(
    target: str | None,
    level: int | None,
    models: Sequence[ModelView],
    budget: HostBudget,
) -> HostPlan:
    """Keep host memory within `budget` for a sleep of `target` at `level` (None: just
    enforce it for the fleet as it is). Room is made in this order: awake models drop their
    kept backup (least recently used first), then level-1 sleepers are demoted to level 2
    (LRU first); if that is not enough the target sleeps at level 2 itself. Pinned models
    keep their host memory."""
    by_name = {m.name: m for m in models}
    if target is not None and target not in by_name:
        raise KeyError(target)
    used = sum(m.host_bytes for m in models)
    t = by_name.get(target) if target is not None else None
    need = 0
    if t is not None and level == 1:
        need = max(0, host_need(t) - t.host_bytes)  # a kept backup becomes its host copy

    def plan(lvl: int | None, why: str, drop: list[str], demote: list[str]) -> HostPlan:
        return HostPlan(target, lvl, why, tuple(drop), tuple(demote), need, used, budget.bytes)

    if budget.bytes is None:
        return plan(level, "no host budget", [], [])
    cap = budget.bytes
    if used + need <= cap:
        return plan(level, f"host fits: {_mib(used)} + {_mib(need)} <= {_mib(cap)}", [], [])
    others = [m for m in models if m.name != target and not m.pinned and m.host_bytes > 0]
    lru = sorted(others, key=lambda m: (m.last_used, m.name))
    backups = [m for m in lru if m.state is State.RUNNING]
    sleepers = [m for m in lru if m.state is State.SUSPENDED and m.level == 1 and m.demotable]
    over = f"host over budget ({_mib(used)} held + {_mib(need)} > {_mib(cap)})"

    def free_until(total: int, pool: list[ModelView], into: list[str]) -> int:
        for m in pool:
            if total <= cap:
                break
            into.append(m.name)
            total -= m.host_bytes
        return total

    drop: list[str] = []
    demote: list[str] = []
    total = free_until(used + need, backups, drop)
    total = free_until(total, sleepers, demote)
    if total <= cap:
        parts = []
        if drop:
            parts.append(f"dropping the backup of {', '.join(drop)}")
        if demote:
            parts.append(f"demoting LRU {', '.join(demote)} to level 2")
        return plan(level, f"{over}: {'; '.join(parts)}", drop, demote)
    if t is not None and level == 1:
        # Not enough even so: the target sleeps at level 2, and frees only what that needs.
        drop, demote = [], []
        total = free_until(used - t.host_bytes, backups, drop)
        total = free_until(total, sleepers, demote)
        why = f"{over} and not enough to release: sleeping at level 2"
        if drop or demote:
            why += f" (and releasing {', '.join(drop + demote)})"
        if total > cap:
            why += f"; still {_mib(total)} held > {_mib(cap)} (pinned or not demotable)"
        return HostPlan(target, 2, why, tuple(drop), tuple(demote), 0, used, cap)
    why = f"{over}: releasing {', '.join(drop + demote) or 'nothing'}"
    if total > cap:
        why += f"; still {_mib(total)} held > {_mib(cap)} (pinned or not demotable)"
    return plan(level, why, drop, demote)


def host_budget_bytes(value: int | float | None, total_ram: int) -> int | None:
    """The host budget in bytes: an int is bytes, a float in (0, 1] a fraction of RAM."""
    if value is None:
        return None
    if isinstance(value, float):
        return int(value * total_ram)
    return int(value)


# ----------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class Want:
    """What one model asks of placement: named devices, or a count of them (its TP size)."""

    name: str
    devices: tuple[str, ...] = ()
    count: int = 1


def place(wants: Sequence[Want], available: Sequence[str]) -> dict[str, tuple[str, ...]]:
    """Assign devices: a model that names its devices gets them; the others, in order, get
    `count` distinct devices among those with the fewest models placed so far (ties by the
    order of `available`). Raises ValueError with one clear line when a model cannot be
    placed (an unknown device, more devices than there are)."""
    avail = list(dict.fromkeys(available))
    load = {d: 0 for d in avail}
    out: dict[str, tuple[str, ...]] = {}
    for w in wants:
        if w.devices:
            unknown = [d for d in w.devices if d not in load]
            if unknown:
                raise ValueError(
                    f"model {w.name}: device(s) {', '.join(unknown)} not among "
                    f"swap.devices ({', '.join(avail)})"
                )
            if len(set(w.devices)) != len(w.devices):
                raise ValueError(f"model {w.name}: a device is named twice: {list(w.devices)}")
            for d in w.devices:
                load[d] += 1
            out[w.name] = tuple(w.devices)
    for w in wants:
        if w.devices:
            continue
        if w.count > len(avail):
            raise ValueError(
                f"model {w.name}: needs {w.count} devices, swap.devices has {len(avail)}"
            )
        order = sorted(avail, key=lambda d: (load[d], avail.index(d)))
        chosen = tuple(sorted(order[: w.count], key=avail.index))
        for d in chosen:
            load[d] += 1
        out[w.name] = chosen
    return {w.name: out[w.name] for w in wants}


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


# ----------------------------------------------------------------------------- overlapped swap


@dataclass(frozen=True)
class Overlap:
    """Whether an evicting wake may map the target's weights while the evicted model's
    weights are still leaving the device (its KV cache already gone), and why."""

    ok: bool
    reason: str
    peak_bytes: int | None = None  # what the device holds at most while both move


def plan_overlap(
    plan: WakePlan,
    victim_pools: Mapping[str, int],
    target_pools: Mapping[str, int],
    victim_counted: int,
) -> Overlap:
    """One evicted model on one device, a byte budget, and both models' pools measured:
    the overlap holds, at its peak, the other models' bytes plus both models' weights (the
    target's KV cache waits until the victim's weights are gone). `victim_counted`: the
    bytes `plan.used_bytes` counted for the victim (`estimate`). Anything unknown: the swap
    runs one sleep after the other, as before."""
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
    peak = others + vw + tw
    if peak > plan.budget_bytes:
        why = (
            f"{_mib(others)} held + both weights {_mib(vw)} + {_mib(tw)}"
            f" > {_mib(plan.budget_bytes)}"
        )
        return Overlap(False, why, peak)
    why = f"{_mib(others)} held + both weights {_mib(vw)} + {_mib(tw)} <= {_mib(plan.budget_bytes)}"
    return Overlap(True, why, peak)
