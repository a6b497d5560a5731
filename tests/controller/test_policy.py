"""Table tests for the pure swap policy: budgets, LRU, pinning, minimum awake time."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from policyviews import MIB, NOW, S, handed, v

from controller.fleet.policy import Budget, Decision, ModelView, plan_wake, restart_delay
from controller.models.changes import Changes
from controller.models.fleetparts import USE_DECAY_S, Lane
from controller.models.footprints import budget_from_info, footprint_from_info, footprint_from_sleep
from controller.state import PhaseRecord, State, TransitionRecord


@dataclass(frozen=True)
class Case:
    id: str
    target: str
    models: tuple[ModelView, ...]
    budget: Budget
    decision: Decision
    evict: tuple[str, ...] = ()
    allow_evict: bool = True
    reason_has: str = ""
    retry: float | None = None


CASES = [
    Case("running is a noop", "a", (v("a", S.RUNNING),), Budget(100 * MIB), Decision.NOOP),
    Case("resuming is a noop", "a", (v("a", S.RESUMING),), Budget(100 * MIB), Decision.NOOP),
    Case(
        "failed is refused",
        "a",
        (v("a", S.FAILED),),
        Budget(),
        Decision.REFUSE,
        reason_has="FAILED",
    ),
    Case("no budget: wake", "a", (v("a"), v("b", S.RUNNING)), Budget(), Decision.WAKE),
    Case(
        "fits in bytes",
        "a",
        (v("a", mib=100), v("b", S.RUNNING, mib=100)),
        Budget(200 * MIB),
        Decision.WAKE,
        reason_has="fits",
    ),
    Case(
        "bytes over: evict the only one",
        "a",
        (v("a", mib=100), v("b", S.RUNNING, mib=100)),
        Budget(150 * MIB),
        Decision.EVICT,
        evict=("b",),
        reason_has="least used",
    ),
    Case(
        "count over: evict the least recently used",
        "a",
        (v("a"), v("b", S.RUNNING, used=50), v("c", S.RUNNING, used=10)),
        Budget(max_awake=2),
        Decision.EVICT,
        evict=("c",),
    ),
    Case(
        "evict as many as needed, LRU first",
        "a",
        (
            v("a", mib=200),
            v("b", S.RUNNING, mib=100, used=30),
            v("c", S.RUNNING, mib=100, used=10),
            v("d", S.RUNNING, mib=100, used=20),
        ),
        Budget(300 * MIB),
        Decision.EVICT,
        evict=("c", "d"),
    ),
    Case(
        # b was asked 5 times lately, c once a little later: c goes (plain LRU took b)
        "the least used goes before the least recently used",
        "a",
        (
            v("a", mib=100),
            v("b", S.RUNNING, mib=100, used=10, uses=5.0),
            v("c", S.RUNNING, mib=100, used=20, uses=1.0),
        ),
        Budget(200 * MIB),
        Decision.EVICT,
        evict=("c",),
    ),
    Case(
        # requests held for b (it was just woken for them): c goes, though asked more
        "a model with requests held for it is not evicted",
        "a",
        (
            v("a", mib=100),
            v("b", S.RUNNING, mib=100, used=10, queued=2),
            v("c", S.RUNNING, mib=100, used=20, uses=3.0),
        ),
        Budget(200 * MIB),
        Decision.EVICT,
        evict=("c",),
    ),
    Case(
        # b (asked often) is the only model awake; c, asked less, is still waking: a's
        # plan waits for c rather than evict b (the coordinator plans it again once c is up)
        "a victim asked more than the target waits for a less asked peer's wake",
        "a",
        (
            v("a", mib=100, uses=2.0),
            v("b", S.RUNNING, mib=100, used=10, uses=40.0),
            v("c", S.RESUMING, mib=100, uses=1.0),
        ),
        Budget(250 * MIB),
        Decision.REFUSE,
        reason_has="not evicting b (40.0 recent requests, a 2.0) while c, asked less, still wake",
        retry=1.0,
    ),
    Case(
        "with no peer waking the victim asked more goes (nothing else to take)",
        "a",
        (
            v("a", mib=100, uses=2.0),
            v("b", S.RUNNING, mib=100, used=10, uses=40.0),
            v("c", S.RESUMING, mib=100, uses=50.0),  # asked more than b: no better victim
        ),
        Budget(250 * MIB),
        Decision.EVICT,
        evict=("b",),
    ),
    Case(
        "a victim asked more than the target, but not twice as often, goes though peers wake",
        "a",
        (
            v("a", mib=100, uses=3.0),
            v("b", S.RUNNING, mib=100, used=10, uses=5.0),
            v("c", S.RESUMING, mib=100, uses=1.0),
        ),
        Budget(250 * MIB),
        Decision.EVICT,
        evict=("b",),
    ),
    Case(
        "a target never asked counts as one request",
        "a",
        (
            v("a", mib=100),
            v("b", S.RUNNING, mib=100, used=10, uses=1.5),
            v("c", S.RESUMING, mib=100, uses=0.0),
        ),
        Budget(250 * MIB),
        Decision.EVICT,
        evict=("b",),
    ),
    Case(
        "a victim asked less than the target goes though peers wake",
        "a",
        (
            v("a", mib=100, uses=9.0),
            v("b", S.RUNNING, mib=100, used=10, uses=4.0),
            v("c", S.RESUMING, mib=100, uses=1.0),
        ),
        Budget(250 * MIB),
        Decision.EVICT,
        evict=("b",),
    ),
    Case(
        "nothing else evictable: refused, to be asked again",
        "a",
        (v("a", mib=100), v("b", S.RUNNING, mib=100, queued=1)),
        Budget(150 * MIB),
        Decision.REFUSE,
        reason_has="request(s) held for it",
        retry=1.0,
    ),
    Case(
        # LRU takes b and c (50 each) before d (200), which alone makes room: b and c are
        # spared (the old plan evicted all three)
        "a large idle model alone spares the small ones taken before it",
        "a",
        (
            v("a", mib=150),
            v("b", S.RUNNING, mib=50, used=10),
            v("c", S.RUNNING, mib=50, used=20),
            v("d", S.RUNNING, mib=200, used=30),
        ),
        Budget(300 * MIB),
        Decision.EVICT,
        evict=("d",),
    ),
    Case(
        "a victim is spared only where the wake fits without it",
        "a",
        (
            v("a", mib=150),
            v("b", S.RUNNING, mib=100, used=10),
            v("c", S.RUNNING, mib=100, used=20),
            v("d", S.RUNNING, mib=100, used=30),
        ),
        Budget(300 * MIB),
        Decision.EVICT,
        evict=("b", "c"),
    ),
    Case(
        "pinned is never evicted",
        "a",
        (v("a"), v("b", S.RUNNING, used=1, pinned=True), v("c", S.RUNNING, used=99)),
        Budget(max_awake=2),
        Decision.EVICT,
        evict=("c",),
    ),
    Case(
        "only pinned awake: refuse, no retry",
        "a",
        (v("a"), v("b", S.RUNNING, pinned=True)),
        Budget(max_awake=1),
        Decision.REFUSE,
        reason_has="pinned: b",
    ),
    Case(
        "evict=false refuses and names who would go",
        "a",
        (v("a"), v("b", S.RUNNING)),
        Budget(max_awake=1),
        Decision.REFUSE,
        evict=("b",),
        allow_evict=False,
        reason_has="evict=false",
    ),
    Case(
        "evict=false is fine when it fits",
        "a",
        (v("a"), v("b", S.RUNNING)),
        Budget(max_awake=2),
        Decision.WAKE,
        allow_evict=False,
    ),
    Case(
        "min awake time protects a fresh model; retry when it expires",
        "a",
        (v("a"), v("b", S.RUNNING, since=NOW - 2.0)),
        Budget(max_awake=1, min_awake_s=5.0),
        Decision.REFUSE,
        reason_has="min_awake_s",
        retry=3.0,
    ),
    Case(
        "min awake time: evict the old one, not the fresh one",
        "a",
        (
            v("a"),
            v("b", S.RUNNING, used=1, since=NOW - 1.0),
            v("c", S.RUNNING, used=500, since=NOW - 60.0),
        ),
        Budget(max_awake=2, min_awake_s=5.0),
        Decision.EVICT,
        evict=("c",),
    ),
    Case(
        "larger than the whole budget",
        "a",
        (v("a", mib=500),),
        Budget(400 * MIB),
        Decision.REFUSE,
        reason_has="whole budget",
    ),
    Case(
        "a model still suspending holds memory and is busy: retry",
        "a",
        (v("a"), v("b", S.SUSPENDING)),
        Budget(max_awake=1),
        Decision.REFUSE,
        reason_has="busy: b (SUSPENDING)",
        retry=1.0,
    ),
    Case(
        "other devices do not count",
        "a",
        (v("a", on="0"), v("b", S.RUNNING, on="1")),
        Budget(max_awake=1),
        Decision.WAKE,
    ),
    Case(
        "unmeasured target counts as the largest measured",
        "a",
        (v("a", mib=None), v("b", S.RUNNING, mib=300)),
        Budget(500 * MIB),
        Decision.EVICT,
        evict=("b",),
    ),
    Case(
        "nothing measured: assume the device to itself",
        "a",
        (v("a", mib=None), v("b", S.RUNNING, mib=None)),
        Budget(500 * MIB),
        Decision.EVICT,
        evict=("b",),
    ),
    Case(
        "asleep models hold nothing",
        "a",
        (v("a", mib=100), v("b", mib=100), v("c", mib=100)),
        Budget(100 * MIB, max_awake=1),
        Decision.WAKE,
    ),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_plan_wake(case: Case) -> None:
    plan = plan_wake(case.target, case.models, case.budget, NOW, allow_evict=case.allow_evict)
    assert plan.decision is case.decision, plan.reason
    assert handed(plan.evict) == case.evict
    assert case.reason_has in plan.reason
    assert plan.retry_after_s == case.retry
    assert plan.to_dict()["decision"] == case.decision.value


def test_unknown_target_raises() -> None:
    with pytest.raises(KeyError):
        plan_wake("x", [v("a")], Budget(), NOW)


def test_footprint_from_info_sums_pools_over_ranks() -> None:
    ranks = [
        {"ok": True, "rank": 0, "pools": {"weights": 10, "kv_cache": 5}},
        {"ok": True, "rank": 1, "pools": {"weights": 10, "kv_cache": 5}},
    ]
    assert footprint_from_info(ranks) == 30
    assert footprint_from_info([{"ok": True, "rank": 0, "pools": {}}]) is None


def _sleep(result: str, freed: list[dict[str, int]]) -> TransitionRecord:
    ranks = tuple({"ok": True, "rank": i, "freed_bytes": f} for i, f in enumerate(freed))
    return TransitionRecord(
        kind="sleep",
        from_state=S.RUNNING,
        to_state=S.SUSPENDED,
        result=result,
        started_at=0.0,
        ended_at=1.0,
        phases=(PhaseRecord("drain", 0.1), PhaseRecord("suspend", 0.2, ranks=ranks)),
    )


def test_footprint_from_sleep() -> None:
    assert footprint_from_sleep(_sleep("ok", [{"weights": 7, "kv_cache": 3}, {"weights": 7}])) == 17
    assert footprint_from_sleep(_sleep("gave_up", [{"weights": 7}])) is None
    assert footprint_from_sleep(None) is None


def test_budget_from_info_is_the_tightest_cuda_rank() -> None:
    cuda = [
        {"platform": "cuda", "device_memory": {"free": 80, "total": 100}},
        {"platform": "cuda", "device_memory": {"free": 60, "total": 100}},
    ]
    assert budget_from_info(cuda) == 60
    assert budget_from_info([{"platform": "cpu", "device_memory": {"rss": 5}}]) is None


@pytest.mark.parametrize(
    ("failures", "expected"),
    [(0, 0.0), (1, 1.0), (2, 2.0), (3, 4.0), (6, 30.0), (100, 30.0)],
)
def test_restart_delay_is_bounded_exponential(failures: int, expected: float) -> None:
    assert restart_delay(failures, 1.0, 30.0) == expected


# A FAILED or UNKNOWN model says nothing of its engine's memory: it counts at its footprint
# (measured, else the estimate) until its process is known to be gone.
@pytest.mark.parametrize(
    ("peer", "mib", "gone", "decision"),
    [
        (S.FAILED, 100, False, Decision.REFUSE),
        (S.FAILED, 100, True, Decision.WAKE),
        (S.FAILED, None, False, Decision.REFUSE),  # unmeasured: the largest known footprint
        (S.FAILED, None, True, Decision.WAKE),
        (S.UNKNOWN, 100, False, Decision.REFUSE),
        (S.UNKNOWN, 100, True, Decision.WAKE),
        (S.STARTING, 100, True, Decision.REFUSE),  # a boot holds whatever its process says
        (S.SUSPENDED, 100, False, Decision.WAKE),
        (S.STOPPED, 100, False, Decision.WAKE),
        (S.RUNNING, 100, False, Decision.EVICT),
    ],
)
def test_failed_and_unknown_count_until_their_process_is_gone(
    peer: State, mib: int | None, gone: bool, decision: Decision
) -> None:
    models = (
        v("a", S.SUSPENDED, 100),
        ModelView(
            "b",
            peer,
            None if mib is None else mib * MIB,
            awake_since=0.0,
            process_gone=gone,
            model="b",
        ),
    )
    plan = plan_wake("a", models, Budget(150 * MIB), NOW)
    assert plan.decision is decision, plan.reason
    if decision is Decision.REFUSE:
        assert f"b ({peer.value})" in plan.reason
        assert plan.retry_after_s == 1.0  # it may settle: the gateway retries, not 503 at once
        assert plan.used_bytes == 100 * MIB


def test_a_failed_model_counts_toward_max_awake_too() -> None:
    models = (v("a"), ModelView("b", S.FAILED, 100 * MIB, model="b"))
    assert plan_wake("a", models, Budget(max_awake=1), NOW).decision is Decision.REFUSE
    gone = (v("a"), ModelView("b", S.FAILED, 100 * MIB, process_gone=True, model="b"))
    assert plan_wake("a", gone, Budget(max_awake=1), NOW).decision is Decision.WAKE


def test_a_sleep_through_vllm_learns_the_footprint_from_the_pools_its_ranks_list() -> None:
    """vLLM's own /sleep reports no freed bytes (§2.3): the `info` read after it does."""
    info = tuple({"ok": True, "rank": i, "pools": {"weights": 7, "kv_cache": 3}} for i in range(2))
    plain = TransitionRecord(
        kind="sleep",
        from_state=S.RUNNING,
        to_state=S.SUSPENDED,
        result="ok",
        started_at=0.0,
        ended_at=1.0,
        phases=(PhaseRecord("vllm_sleep", 1.5), PhaseRecord("info", 0.01, ranks=info)),
    )
    assert footprint_from_sleep(plain) == 20


def test_a_models_recent_requests_decay_with_a_time_constant() -> None:
    clock = [1000.0]
    lane = Lane(Changes(), lambda: clock[0])
    assert lane.recent_uses(clock[0]) == 0.0
    lane.touch()
    lane.touch()
    assert lane.recent_uses(clock[0]) == pytest.approx(2.0)
    clock[0] += USE_DECAY_S
    assert lane.recent_uses(clock[0]) == pytest.approx(2.0 / math.e)
    lane.touch()  # one more, on top of what is left
    assert lane.recent_uses(clock[0]) == pytest.approx(2.0 / math.e + 1.0)
    assert lane.last_used == clock[0]


def test_a_plan_made_once_does_not_wait_for_the_devices_wakes() -> None:
    """A boot's room (`SwapCoordinator.make_room`) is planned once: the victim asked more goes
    at once rather than a refusal nobody plans again."""
    models = (
        v("a", mib=100, uses=2.0),
        v("b", S.RUNNING, mib=100, used=10, uses=40.0),
        v("c", S.RESUMING, mib=100, uses=1.0),
    )
    assert plan_wake("a", models, Budget(250 * MIB), NOW).decision is Decision.REFUSE
    once = plan_wake("a", models, Budget(250 * MIB), NOW, wait_for_wakes=False)
    assert once.decision is Decision.EVICT, once.reason
    assert handed(once.evict) == ("b",)
