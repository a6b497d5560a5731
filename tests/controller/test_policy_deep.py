"""The budget's third tier (docs/contracts.md §2.2): under device pressure a sleeper goes
deep before anything awake is evicted; a deep sleeper counts what was measured after it."""

from __future__ import annotations

import dataclasses

from policyviews import MIB, NOW, S, handed, v

from controller.fleet.policy import Budget, Decision, ModelView, plan_wake


def deepable(view: ModelView[str], deep: bool = False) -> ModelView[str]:
    return dataclasses.replace(view, deepable=not deep, deep=deep)


BUDGET = Budget(bytes=1000 * MIB)


def test_sleepers_go_deep_before_anything_awake_is_evicted() -> None:
    models = [
        v("t", S.SUSPENDED, 400),
        v("awake", S.RUNNING, 400, used=NOW - 1),
        deepable(v("s1", asleep_mib=150, used=10.0)),
        deepable(v("s2", asleep_mib=150, used=20.0)),
    ]
    # 400 awake + 300 leftover + 400 need > 1000; taking s1 deep frees 150: fits
    plan = plan_wake("t", models, BUDGET, NOW)
    assert plan.decision is Decision.DEEPEN
    assert handed(plan.deepen) == ("s1",)
    assert handed(plan.evict) == ()
    assert "deep" in plan.reason


def test_evicts_only_when_deepening_is_not_enough() -> None:
    models = [
        v("t", S.SUSPENDED, 700),
        v("awake", S.RUNNING, 400, used=NOW - 1),
        deepable(v("s1", asleep_mib=150)),
    ]
    plan = plan_wake("t", models, BUDGET, NOW)
    assert plan.decision is Decision.EVICT
    assert handed(plan.evict) == ("awake",)
    # the eviction alone fits (150 + 700): no checkpoint on the wake's path for nothing
    assert handed(plan.deepen) == ()


def test_a_sleeper_goes_deep_with_an_eviction_where_it_spares_another() -> None:
    models = [
        v("t", S.SUSPENDED, 500),
        v("a1", S.RUNNING, 300, used=NOW - 2),
        v("a2", S.RUNNING, 300, used=NOW - 1),
        deepable(v("s1", asleep_mib=250)),
    ]
    # 600 awake + 250 leftover + 500 > 1000, and 600 + 500 with s1 deep too. Without s1 deep:
    # a1 and a2 evicted (250 + 500); with it: a1 alone (300 + 500)
    plan = plan_wake("t", models, BUDGET, NOW)
    assert plan.decision is Decision.EVICT
    assert handed(plan.evict) == ("a1",)
    assert handed(plan.deepen) == ("s1",)


def test_a_sleeper_not_deepable_is_not_taken_deep() -> None:
    models = [
        v("t", S.SUSPENDED, 400),
        v("awake", S.RUNNING, 400, used=NOW - 1),
        v("s1", asleep_mib=300),  # deep_sleep off, or known unable
    ]
    plan = plan_wake("t", models, BUDGET, NOW)
    assert plan.decision is Decision.EVICT
    assert handed(plan.deepen) == ()


def test_a_deep_sleeper_counts_what_was_measured() -> None:
    models = [
        v("t", S.SUSPENDED, 500),
        v("awake", S.RUNNING, 400, used=NOW - 1),
        deepable(v("s1", asleep_mib=2), deep=True),  # measured after its checkpoint
    ]
    plan = plan_wake("t", models, BUDGET, NOW)
    assert plan.decision is Decision.WAKE
    assert plan.used_bytes == 402 * MIB
    assert plan.to_dict()["deepen"] == []


def test_a_busy_sleeper_is_not_taken_deep() -> None:
    models = [
        v("t", S.SUSPENDED, 400),
        v("awake", S.RUNNING, 400, used=NOW - 1),
        deepable(dataclasses.replace(v("s1", asleep_mib=300), busy=True)),
    ]
    assert handed(plan_wake("t", models, BUDGET, NOW).deepen) == ()


def test_a_sleeper_about_to_be_woken_is_not_taken_deep() -> None:
    """Requests held for s1 (its wake waits for the device): its checkpoint, then its
    restore, would sit on their path; s2, with none, goes deep in its place."""
    models = [
        v("t", S.SUSPENDED, 400),
        v("awake", S.RUNNING, 400, used=NOW - 1),
        deepable(v("s1", asleep_mib=150, used=10.0, queued=2)),
        deepable(v("s2", asleep_mib=150, used=20.0)),
    ]
    plan = plan_wake("t", models, BUDGET, NOW)
    assert plan.decision is Decision.DEEPEN
    assert handed(plan.deepen) == ("s2",)


def test_a_deep_targets_wake_needs_what_its_restore_brings_back() -> None:
    """t is deep: NVML says it holds 0 now, but its restore brings back the 150 it left
    beside its pools before its checkpoint: 400 awake + 400 + 150 > 900 evicts, where the
    footprint alone (800) would fit."""
    t = dataclasses.replace(v("t", S.SUSPENDED, 400), deep=True, restore_bytes=150 * MIB)
    models = [t, v("awake", S.RUNNING, 400, used=NOW - 1)]
    plan = plan_wake("t", models, Budget(bytes=900 * MIB), NOW)
    assert plan.decision is Decision.EVICT
    assert handed(plan.evict) == ("awake",)
    assert "restore brings back" in plan.reason
    assert plan.need_bytes == 550 * MIB
    # not deep: its leftover is counted where it is (held), not again in the need
    woke = dataclasses.replace(t, deep=False, asleep_bytes=150 * MIB)
    plan = plan_wake("t", [woke, models[1]], Budget(bytes=1000 * MIB), NOW)
    assert plan.decision is Decision.WAKE
    assert plan.need_bytes == 400 * MIB
