"""Table tests for the fleet parts of the pure policy: placement on many devices, per-device
budgets for tensor-parallel models, what a sleeper leaves behind, idle sleep, and the host
memory budget with demotion from level 1 to level 2."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
from policyviews import MIB, NOW, S, handed, v

from controller.config.placement import Want, place
from controller.fleet.hostpolicy import HostBudget, host_budget_bytes, plan_host
from controller.fleet.policy import (
    Budget,
    Decision,
    ModelView,
    measured_budget,
    plan_idle,
    plan_wake,
)

# ---------------------------------------------------------------------------- per device


@dataclass(frozen=True)
class WakeCase:
    id: str
    target: str
    models: tuple[ModelView, ...]
    budget: Budget | dict[str, Budget]
    decision: Decision
    evict: tuple[str, ...] = ()
    reason_has: str = ""


WAKE_CASES = [
    WakeCase(
        "a wake evicts only on its own device",
        "a",
        (v("a", on="1"), v("b", S.RUNNING, on="0", used=1), v("c", S.RUNNING, on="1", used=9)),
        Budget(max_awake=1),
        Decision.EVICT,
        evict=("c",),
    ),
    WakeCase(
        "TP2 needs room on both devices: evicts one per device",
        "t",
        (
            v("t", mib=200, on="0,1"),
            v("x", S.RUNNING, on="0", used=5),
            v("y", S.RUNNING, on="1", used=1),
            v("z", S.RUNNING, on="2", used=0),
        ),
        Budget(150 * MIB),
        Decision.EVICT,
        evict=("y", "x"),
        reason_has="on 0",
    ),
    WakeCase(
        "TP2 share is half its footprint per device",
        "t",
        (v("t", mib=200, on="0,1"), v("x", S.RUNNING, mib=100, on="0")),
        Budget(200 * MIB),
        Decision.WAKE,
        reason_has="device 0",
    ),
    WakeCase(
        "an LRU model on an unrelated device is not evicted",
        "a",
        (
            v("a", on="0"),
            v("old", S.RUNNING, on="1", used=0),
            v("b", S.RUNNING, on="0", used=50),
        ),
        Budget(max_awake=1),
        Decision.EVICT,
        evict=("b",),
    ),
    WakeCase(
        "evict only where room is short (TP peer on the full device)",
        "a",
        (
            v("a", mib=100, on="0"),
            v("p", S.RUNNING, mib=100, on="1", used=0),
            v("q", S.RUNNING, mib=200, on="0,1", used=5),
        ),
        Budget(150 * MIB),
        Decision.EVICT,
        evict=("q",),
    ),
    WakeCase(
        "per-device budgets",
        "a",
        (v("a", mib=100, on="1"), v("b", S.RUNNING, mib=100, on="1")),
        {"0": Budget(100 * MIB), "1": Budget(300 * MIB)},
        Decision.WAKE,
    ),
    WakeCase(
        "a sleeper's leftover counts on its device",
        "a",
        (v("a", mib=100), v("b", S.SUSPENDED, asleep_mib=60)),
        Budget(150 * MIB),
        Decision.REFUSE,
        reason_has="nothing evictable",
    ),
    WakeCase(
        "a sleeper that leaves nothing does not count",
        "a",
        (v("a", mib=100), v("b", S.SUSPENDED, asleep_mib=0)),
        Budget(150 * MIB),
        Decision.WAKE,
    ),
    WakeCase(
        "evicting a model counts what it will leave behind asleep",
        "a",
        (v("a", mib=100), v("b", S.RUNNING, mib=100, asleep_mib=60)),
        Budget(150 * MIB),
        Decision.REFUSE,
    ),
    WakeCase(
        "the target's own leftover is on the device: it counts",
        "a",
        (v("a", mib=100, asleep_mib=60),),
        Budget(150 * MIB),
        Decision.REFUSE,
        reason_has="60.0 MiB held + 100.0 MiB > 150.0 MiB",
    ),
    WakeCase(
        "an awake peer counts its leftover beside its footprint",
        "a",
        (v("a", mib=100), v("b", S.RUNNING, mib=40, asleep_mib=20)),
        Budget(150 * MIB),
        Decision.EVICT,
        evict=("b",),
        reason_has="60.0 MiB held",
    ),
    WakeCase(
        "a TP2 sleeper's leftover (over both ranks) is its share on each device",
        "a",
        (v("a", mib=100, on="0"), v("s", S.SUSPENDED, on="0,1", asleep_mib=100)),
        Budget(150 * MIB),
        Decision.WAKE,
        reason_has="50.0 MiB + 100.0 MiB <= 150.0 MiB",
    ),
    WakeCase(
        "a sleeper whose engine process is gone leaves nothing",
        "a",
        (v("a", mib=100), v("b", S.SUSPENDED, asleep_mib=60, gone=True)),
        Budget(150 * MIB),
        Decision.WAKE,
    ),
    WakeCase(
        "the wake's codec scratch counts in the need",
        "a",
        (v("a", mib=100, scratch_mib=30), v("b", S.RUNNING, mib=40, used=1)),
        Budget(150 * MIB),
        Decision.EVICT,
        evict=("b",),
        reason_has="30.0 MiB of scratch",
    ),
    WakeCase(
        "the scratch alone can put a wake over the whole budget",
        "a",
        (v("a", mib=100, scratch_mib=60),),
        Budget(150 * MIB),
        Decision.REFUSE,
        reason_has="needs 160.0 MiB",
    ),
    WakeCase(
        "TP2 bigger than one device's budget",
        "t",
        (v("t", mib=500, on="0,1"),),
        Budget(200 * MIB),
        Decision.REFUSE,
        reason_has="on device 0",
    ),
]


@pytest.mark.parametrize("case", WAKE_CASES, ids=lambda c: c.id)
def test_plan_wake_per_device(case: WakeCase) -> None:
    plan = plan_wake(case.target, case.models, case.budget, NOW)
    assert plan.decision is case.decision, plan.reason
    assert handed(plan.evict) == case.evict, plan.reason
    assert case.reason_has in plan.reason, plan.reason
    assert plan.to_dict()["devices"] == list(case.models[0].placement)
    assert plan.scratch_bytes == case.models[0].wake_scratch_bytes


@pytest.mark.parametrize(
    ("device", "models", "expected_mib"),
    [
        ("0", (), 1000),
        # sleepers' leftovers are out of the free memory already: added back
        ("0", (v("a", asleep_mib=50), v("b", asleep_mib=30)), 1080),
        # a pinned model is awake: its footprint too; a TP2 engine counts its share
        ("0", (v("p", S.RUNNING, mib=200, pinned=True, asleep_mib=10),), 1210),
        ("0", (v("t", on="0,1", asleep_mib=60),), 1030),
        # another device's models, and a sleeper whose process is gone, add nothing
        ("1", (v("a", asleep_mib=50),), 1000),
        ("0", (v("a", asleep_mib=50, gone=True),), 1000),
    ],
)
def test_measured_budget_counts_nothing_twice(
    device: str, models: tuple[ModelView, ...], expected_mib: int
) -> None:
    assert measured_budget(1000 * MIB, device, models) == expected_mib * MIB


def test_a_measured_budget_admits_exactly_what_the_free_memory_holds() -> None:
    """Free memory F with both asleep: a wake that needs F fits, one byte more does not."""
    free = 500 * MIB
    sleepers = (v("a", mib=500, asleep_mib=60), v("b", asleep_mib=40))
    budget = Budget(measured_budget(free, "0", sleepers))
    assert plan_wake("a", sleepers, budget, NOW).decision is Decision.WAKE
    bigger = (v("a", mib=501, asleep_mib=60), sleepers[1])
    assert plan_wake("a", bigger, budget, NOW).decision is Decision.REFUSE


# ---------------------------------------------------------------------------- placement


@dataclass(frozen=True)
class PlaceCase:
    id: str
    wants: tuple[Want, ...]
    available: tuple[str, ...]
    expected: dict[str, tuple[str, ...]] | None  # None: refused
    error_has: str = ""


PLACE_CASES = [
    PlaceCase("one device", (Want("a"), Want("b")), ("0",), {"a": ("0",), "b": ("0",)}),
    PlaceCase(
        "spread over free devices",
        (Want("a"), Want("b"), Want("c")),
        ("0", "1"),
        {"a": ("0",), "b": ("1",), "c": ("0",)},
    ),
    PlaceCase(
        "named devices first, then the least loaded",
        (Want("a"), Want("b", devices=("0",))),
        ("0", "1"),
        {"a": ("1",), "b": ("0",)},
    ),
    PlaceCase(
        "TP size takes distinct devices",
        (Want("t", count=2), Want("a"), Want("u", count=2)),
        ("0", "1", "2", "3"),
        {"t": ("0", "1"), "a": ("2",), "u": ("0", "3")},
    ),
    PlaceCase(
        "unknown device refused",
        (Want("a", devices=("7",)),),
        ("0", "1"),
        None,
        "device(s) 7 not among swap.devices",
    ),
    PlaceCase(
        "too many devices refused",
        (Want("t", count=4),),
        ("0", "1"),
        None,
        "needs 4 devices, swap.devices has 2",
    ),
    PlaceCase(
        "a device named twice refused",
        (Want("a", devices=("0", "0")),),
        ("0", "1"),
        None,
        "named twice",
    ),
]


@pytest.mark.parametrize("case", PLACE_CASES, ids=lambda c: c.id)
def test_place(case: PlaceCase) -> None:
    if case.expected is None:
        with pytest.raises(ValueError, match=re.escape(case.error_has)):
            place(case.wants, case.available)
    else:
        assert place(case.wants, case.available) == case.expected


# ---------------------------------------------------------------------------- idle sleep


@dataclass(frozen=True)
class IdleCase:
    id: str
    view: ModelView
    idle_s: float | None
    sleep: bool
    due: float | None = None
    reason_has: str = ""


IDLE_CASES = [
    IdleCase("off", v("a", S.RUNNING), None, False, reason_has="off"),
    IdleCase("idle long enough", v("a", S.RUNNING, used=900, since=0), 60, True, reason_has="idle"),
    IdleCase("used recently: due later", v("a", S.RUNNING, used=970, since=0), 60, False, 30.0),
    IdleCase("woken recently: due later", v("a", S.RUNNING, used=0, since=990), 60, False, 50.0),
    IdleCase("pinned never", v("a", S.RUNNING, pinned=True), 1, False, reason_has="pinned"),
    IdleCase("in flight never", v("a", S.RUNNING, in_flight=1), 1, False, reason_has="flight"),
    IdleCase("queued never", v("a", S.RUNNING, queued=2), 1, False, reason_has="2 queued"),
    IdleCase("in a transition never", v("a", S.RUNNING, busy=True), 1, False),
    IdleCase("resuming never", v("a", S.RESUMING), 1, False, reason_has="RESUMING"),
    IdleCase("asleep already", v("a", S.SUSPENDED), 1, False),
    IdleCase("failed never", v("a", S.FAILED), 1, False),
]


@pytest.mark.parametrize("case", IDLE_CASES, ids=lambda c: c.id)
def test_plan_idle(case: IdleCase) -> None:
    plan = plan_idle(case.view, case.idle_s, NOW)
    assert plan.sleep is case.sleep, plan.reason
    assert plan.due_in_s == case.due
    assert case.reason_has in plan.reason
    assert plan.to_dict()["sleep"] is case.sleep


# ---------------------------------------------------------------------------- host budget


@dataclass(frozen=True)
class HostCase:
    id: str
    target: str | None
    level: int | None
    models: tuple[ModelView, ...]
    budget_mib: int | None
    out_level: int | None
    drop: tuple[str, ...] = ()
    demote: tuple[str, ...] = ()
    reason_has: str = ""


HOST_CASES = [
    HostCase("no budget", "a", 1, (v("a", S.RUNNING),), None, 1, reason_has="no host budget"),
    HostCase(
        "fits",
        "a",
        1,
        (v("a", S.RUNNING, weights_mib=100), v("b", S.SUSPENDED, host_mib=100)),
        200,
        1,
        reason_has="host fits",
    ),
    HostCase(
        "level 2 adds nothing",
        "a",
        2,
        (v("a", S.RUNNING, weights_mib=100), v("b", S.SUSPENDED, host_mib=100)),
        100,
        2,
    ),
    HostCase(
        "over: demote the LRU level-1 sleeper",
        "a",
        1,
        (
            v("a", S.RUNNING, weights_mib=100),
            v("b", S.SUSPENDED, host_mib=100, used=50),
            v("c", S.SUSPENDED, host_mib=100, used=10),
        ),
        250,
        1,
        demote=("c",),
        reason_has="demoting LRU c to level 2",
    ),
    HostCase(
        "awake backups go before sleepers",
        "a",
        1,
        (
            v("a", S.RUNNING, weights_mib=100),
            v("b", S.SUSPENDED, host_mib=100, used=1),
            v("c", S.RUNNING, host_mib=100, used=50),
        ),
        200,
        1,
        drop=("c",),
        reason_has="dropping the backup of c",
    ),
    HostCase(
        "a kept backup becomes the host copy: nothing added",
        "a",
        1,
        (v("a", S.RUNNING, host_mib=100, weights_mib=100), v("b", S.SUSPENDED, host_mib=100)),
        200,
        1,
        reason_has="+ 0.0 MiB",
    ),
    HostCase(
        "level-2 sleepers hold nothing to demote: the target sleeps at level 2",
        "a",
        1,
        (v("a", S.RUNNING, weights_mib=100), v("b", S.SUSPENDED, host_mib=0, level=2)),
        50,
        2,
        reason_has="sleeping at level 2",
    ),
    HostCase(
        "pinned sleepers keep their copy",
        "a",
        1,
        (v("a", S.RUNNING, weights_mib=100), v("b", S.SUSPENDED, host_mib=100, pinned=True)),
        150,
        2,
    ),
    HostCase(
        "a sleeper that cannot demote is skipped",
        "a",
        1,
        (
            v("a", S.RUNNING, weights_mib=100),
            v("b", S.SUSPENDED, host_mib=100, demotable=False, used=0),
            v("c", S.SUSPENDED, host_mib=100, used=5),
        ),
        200,
        1,
        demote=("c",),
    ),
    HostCase(
        "unmeasured weights count the awake footprint",
        "a",
        1,
        (v("a", S.RUNNING, mib=300), v("b", S.SUSPENDED, host_mib=100)),
        350,
        1,
        demote=("b",),
    ),
    HostCase(
        "the fleet as it is: over after a wake kept a backup",
        None,
        None,
        (
            v("a", S.RUNNING, host_mib=100, used=100),
            v("b", S.SUSPENDED, host_mib=100, used=1),
            v("c", S.SUSPENDED, host_mib=100, used=2),
        ),
        200,
        None,
        drop=("a",),
        reason_has="dropping the backup of a",
    ),
    HostCase(
        "the fleet as it is: the backup is not enough, demote too",
        None,
        None,
        (
            v("a", S.RUNNING, host_mib=100, used=100),
            v("b", S.SUSPENDED, host_mib=100, used=1),
            v("c", S.SUSPENDED, host_mib=100, used=2),
        ),
        100,
        None,
        drop=("a",),
        demote=("b",),
    ),
]


@pytest.mark.parametrize("case", HOST_CASES, ids=lambda c: c.id)
def test_plan_host(case: HostCase) -> None:
    budget = HostBudget(None if case.budget_mib is None else case.budget_mib * MIB)
    plan = plan_host(case.target, case.level, case.models, budget)
    assert plan.level == case.out_level, plan.reason
    assert handed(plan.drop_backup) == case.drop, plan.reason
    assert handed(plan.demote) == case.demote, plan.reason
    assert case.reason_has in plan.reason
    assert plan.to_dict()["demote"] == list(case.demote)


def test_plan_host_unknown_target_raises() -> None:
    with pytest.raises(KeyError):
        plan_host("x", 1, [v("a")], HostBudget(1))


@pytest.mark.parametrize(
    ("value", "expected"), [(None, None), (1024, 1024), (0.5, 500), (1.0, 1000)]
)
def test_host_budget_bytes(value: int | float | None, expected: int | None) -> None:
    assert host_budget_bytes(value, 1000) == expected
