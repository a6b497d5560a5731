"""The reconciliation table: written-out cases, then invariants over every combination."""

from __future__ import annotations

import dataclasses
import gc
import itertools
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from controller.models.reconcile import (
    RULES,
    Do,
    Memory,
    Observation,
    Verdict,
    reconcile,
    rules_table,
)
from controller.reports import Phase, RankView, ranks_from_info
from controller.state import State

S, P = State, Phase
DOCS = Path(__file__).resolve().parents[2] / "docs" / "contracts.md"


def rank(i: int = 0, phase: Phase = P.AWAKE_VERIFIED, **kw: object) -> RankView:
    kw.setdefault("boot_id", f"boot{i}")
    kw.setdefault("world_size", kw.pop("world", 1))
    if phase in (P.SUSPENDED, P.RESUMED_UNVERIFIED):
        kw.setdefault("level", 1)
    if phase is P.SUSPENDED:
        kw.setdefault("tags", ("kv_cache", "weights"))
    return RankView(rank=i, phase=phase, **kw)  # type: ignore[arg-type]


def obs(*ranks: RankView, **kw: object) -> Observation:
    kw.setdefault("reachable", True)
    kw.setdefault("process", "p1")
    return Observation(ranks=ranks or None, **kw)  # type: ignore[arg-type]


def mem(state: State = S.UNKNOWN, **kw: object) -> Memory:
    kw.setdefault("process", "p1")
    return Memory(state=state, **kw)  # type: ignore[arg-type]


TWO = {"world": 2}

# (name, observation, memory, expected rule, expected state, expected action)
CASES: list[tuple[str, Observation, Memory, str, State | None, Do]] = [
    (
        "down",
        Observation(reachable=False),
        mem(S.RUNNING, verified=True),
        "unreachable",
        S.FAILED,
        Do.NONE,
    ),
    ("dead", obs(alive=False), mem(S.RUNNING, verified=True), "dead", S.FAILED, Do.NONE),
    (
        "desynced, same process",
        obs(rank()),
        mem(S.FAILED, desynced=True),
        "desynced",
        S.FAILED,
        Do.NONE,
    ),
    (
        "desynced, no sign",
        obs(process=None),
        mem(S.FAILED, desynced=True, process=None),
        "desynced",
        S.FAILED,
        Do.NONE,
    ),
    (
        "desynced, new process",
        obs(process="p2"),
        mem(S.FAILED, desynced=True),
        "probe",
        None,
        Do.PROBE,
    ),
    ("start-up", obs(), mem(S.UNKNOWN), "probe", None, Do.PROBE),
    (
        "running, as probed",
        obs(),
        mem(S.RUNNING, verified=True, boot_ids=("boot0",)),
        "cache-fits",
        S.RUNNING,
        Do.NONE,
    ),
    ("running, unverified", obs(), mem(S.RUNNING, boot_ids=("boot0",)), "probe", None, Do.PROBE),
    (
        "running, now paused",
        obs(paused=True),
        mem(S.RUNNING, verified=True, boot_ids=("b",)),
        "probe",
        None,
        Do.PROBE,
    ),
    (
        "running, no sign",
        obs(process=None),
        mem(S.RUNNING, verified=True, boot_ids=("b",), process=None),
        "probe",
        None,
        Do.PROBE,
    ),
    (
        "running, new sign",
        obs(process="p2"),
        mem(S.RUNNING, verified=True, boot_ids=("b",)),
        "probe",
        None,
        Do.PROBE,
    ),
    (
        "suspended, as probed",
        obs(paused=True),
        mem(S.SUSPENDED, boot_ids=("b",)),
        "cache-fits",
        S.SUSPENDED,
        Do.NONE,
    ),
    ("suspended, unpaused", obs(), mem(S.SUSPENDED, boot_ids=("b",)), "probe", None, Do.PROBE),
    ("failed: probe", obs(), mem(S.FAILED, boot_ids=("b",)), "probe", None, Do.PROBE),
    ("info timed out", obs(info_error="timeout"), mem(), "info-failed", S.FAILED, Do.NONE),
    (
        "info rank not ok",
        obs(rank(ok=False, error="boom")),
        mem(),
        "info-failed",
        S.FAILED,
        Do.NONE,
    ),
    ("a rank missing", obs(rank(world=2)), mem(), "ranks-missing", S.FAILED, Do.NONE),
    ("old extension", obs(rank(phase=P.UNREPORTED)), mem(), "unreported", S.FAILED, Do.NONE),
    (
        "rank failed",
        obs(rank(phase=P.FAILED, reason="verify: w differs")),
        mem(),
        "rank-failed",
        S.FAILED,
        Do.NONE,
    ),
    ("poisoned", obs(rank(poisoned=True)), mem(), "poisoned", S.FAILED, Do.NONE),
    (
        "mixed phases",
        obs(rank(0, **TWO), rank(1, P.SUSPENDED, **TWO), paused=True),
        mem(),
        "mixed",
        S.FAILED,
        Do.NONE,
    ),
    (
        "mixed pools",
        obs(
            rank(0, P.SUSPENDED, **TWO),
            rank(1, P.SUSPENDED, tags=("kv_cache",), **TWO),
            paused=True,
        ),
        mem(),
        "mixed",
        S.FAILED,
        Do.NONE,
    ),
    (
        "mixed levels",
        obs(rank(0, P.SUSPENDED, **TWO), rank(1, P.SUSPENDED, level=2, **TWO), paused=True),
        mem(),
        "mixed",
        S.FAILED,
        Do.NONE,
    ),
    (
        "the ranks serve another name",
        obs(rank(served_model_name="other")),
        mem(S.RUNNING, verified=True, served="tiny"),
        "not-this-model",
        S.FAILED,
        Do.NONE,
    ),
    (
        "the API server lists another name",
        obs(rank(served_model_name="tiny"), served=("other",)),
        mem(S.UNKNOWN, served="tiny"),
        "not-this-model",
        S.FAILED,
        Do.NONE,
    ),
    (
        "the ranks run another model class than first verified",
        obs(rank(model="GemmaForCausalLM"), paused=True),
        mem(S.SUSPENDED, model="LlamaForCausalLM"),
        "not-this-model",
        S.FAILED,
        Do.NONE,
    ),
    (
        "the same model, served under its name",
        obs(rank(served_model_name="tiny", model="LlamaForCausalLM"), served=("tiny",)),
        mem(S.UNKNOWN, served="tiny", model="LlamaForCausalLM"),
        "running",
        S.RUNNING,
        Do.NONE,
    ),
    (
        "orphan answers a start",
        obs(rank(transitions=3, verified_transition=3)),
        mem(S.STARTING, fresh=True),
        "not-ours",
        S.FAILED,
        Do.NONE,
    ),
    (
        "orphan asleep answers a start",
        obs(rank(phase=P.SUSPENDED, transitions=1), paused=True),
        mem(S.STARTING, fresh=True),
        "not-ours",
        S.FAILED,
        Do.NONE,
    ),
    ("fresh start", obs(rank()), mem(S.STARTING, fresh=True), "running", S.RUNNING, Do.NONE),
    (
        "slept by vLLM's own cumem behind the sidecar's back",
        obs(rank(allocator_asleep=("kv_cache", "weights")), paused=True, sleeping=True),
        mem(S.RUNNING, verified=True, boot_ids=("boot0",)),
        "asleep-unseen",
        S.FAILED,
        Do.NONE,
    ),
    (
        "slept by vLLM's own cumem, the sidecar told to accept its unverified wake (§2.3)",
        obs(rank(allocator_asleep=("kv_cache", "weights")), paused=True, sleeping=True),
        mem(S.UNKNOWN, accept_unverified=True),
        "asleep-accepted",
        S.SUSPENDED,
        Do.NONE,
    ),
    (
        "put to sleep through vLLM's plain sleep on CPU (the ranks show nothing), read again",
        obs(rank(), paused=True, sleeping=True),
        mem(S.SUSPENDED, accept_unverified=True, plain_asleep=True),
        "asleep-accepted",
        S.SUSPENDED,
        Do.NONE,
    ),
    (
        "the same, after its engine restarted: a new process, judged afresh",
        obs(rank(boot_id="boot1"), paused=True, sleeping=True),
        mem(S.SUSPENDED, boot_ids=("boot0",), accept_unverified=True, plain_asleep=True),
        "interrupted-sleep",
        S.RESUMING,
        Do.RESUME_ENGINE,
    ),
    (
        "slept by vLLM's own cumem, then resumed by /resume, even where accepted",
        obs(rank(allocator_asleep=("weights",)), sleeping=True),
        mem(S.RUNNING, verified=True, boot_ids=("boot0",), accept_unverified=True),
        "asleep-unseen",
        S.FAILED,
        Do.NONE,
    ),
    (
        "woken unverified (accepted), read again: still not verified",
        obs(rank()),
        mem(S.RUNNING, boot_ids=("boot0",), accept_unverified=True, unverified=True),
        "running",
        S.RUNNING,
        Do.NONE,
    ),
    (
        "slept by vLLM's own cumem, then resumed by /resume",
        obs(rank(allocator_asleep=("weights",)), sleeping=True),
        mem(S.RUNNING, verified=True, boot_ids=("boot0",)),
        "asleep-unseen",
        S.FAILED,
        Do.NONE,
    ),
    (
        "slept through the hotswap backend behind the sidecar's back",
        obs(rank(0, P.SUSPENDED, snapshot_held=True), paused=True, sleeping=True),
        mem(S.RUNNING, verified=True, boot_ids=("boot0",)),
        "suspended",
        S.SUSPENDED,
        Do.NONE,
    ),
    (
        "vLLM sleeping while unpaused: the RUNNING cache does not fit",
        obs(process="p1", sleeping=True),
        mem(S.RUNNING, verified=True, boot_ids=("boot0",)),
        "probe",
        None,
        Do.PROBE,
    ),
    (
        "sleep stopped before suspend",
        obs(rank(snapshot_held=True), paused=True),
        mem(),
        "interrupted-sleep",
        S.RESUMING,
        Do.RESUME_ENGINE,
    ),
    ("running", obs(rank()), mem(), "running", S.RUNNING, Do.NONE),
    ("tp2 running", obs(rank(0, **TWO), rank(1, **TWO)), mem(), "running", S.RUNNING, Do.NONE),
    (
        "suspended, unpaused",
        obs(rank(phase=P.SUSPENDED)),
        mem(),
        "suspended-unpaused",
        S.FAILED,
        Do.NONE,
    ),
    (
        "suspended",
        obs(rank(phase=P.SUSPENDED), paused=True),
        mem(),
        "suspended",
        S.SUSPENDED,
        Do.NONE,
    ),
    (
        "half woken",
        obs(rank(phase=P.SUSPENDED, tags=("kv_cache",)), paused=True),
        mem(),
        "suspended",
        S.SUSPENDED,
        Do.NONE,
    ),
    (
        "unverified, unpaused",
        obs(rank(phase=P.RESUMED_UNVERIFIED, snapshot_held=True)),
        mem(),
        "unverified-unpaused",
        S.FAILED,
        Do.NONE,
    ),
    (
        "unverified, copies gone",
        obs(rank(phase=P.RESUMED_UNVERIFIED), paused=True),
        mem(),
        "copies-gone",
        S.FAILED,
        Do.NONE,
    ),
    (
        "tp2 one rank's copies gone",
        obs(
            rank(0, P.RESUMED_UNVERIFIED, snapshot_held=True, **TWO),
            rank(1, P.RESUMED_UNVERIFIED, **TWO),
            paused=True,
        ),
        mem(),
        "copies-gone",
        S.FAILED,
        Do.NONE,
    ),
    (
        "wake stopped before verify",
        obs(rank(phase=P.RESUMED_UNVERIFIED, snapshot_held=True), paused=True),
        mem(),
        "interrupted-wake",
        S.RESUMING,
        Do.FINISH_WAKE,
    ),
    (
        "restarted behind our back while SUSPENDED",
        obs(rank(boot_id="new")),
        mem(S.SUSPENDED, boot_ids=("boot0",)),
        "running",
        S.RUNNING,
        Do.NONE,
    ),
]


@pytest.mark.parametrize(
    ("observed", "memory", "rule", "state", "do"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_case(
    observed: Observation, memory: Memory, rule: str, state: State | None, do: Do
) -> None:
    v = reconcile(observed, memory)
    assert (v.rule, v.state, v.do) == (rule, state, do), v.reason
    assert v.reason


def test_every_rule_has_a_written_case() -> None:
    assert {c[3] for c in CASES} == {r.id for r in RULES}


def test_boot_ids_and_signs_are_remembered() -> None:
    v = reconcile(obs(rank(0, boot_id="a", world=2), rank(1, boot_id="b", world=2)), mem())
    assert v.boot_ids == ("a", "b")
    assert v.process == "p1"
    assert not v.new_process
    again = reconcile(
        obs(rank(0, boot_id="a", world=2), rank(1, boot_id="c", world=2)), mem(boot_ids=v.boot_ids)
    )
    assert again.new_process  # one rank's process is new: the engine was restarted
    moved = reconcile(obs(process="p2"), mem(S.RUNNING, verified=True, boot_ids=("a",)))
    assert moved.new_process
    assert moved.process == "p2"
    assert moved.boot_ids is None  # the old process's ids say nothing about the new one


def test_a_new_process_clears_the_desync_and_a_failed_info_sets_it() -> None:
    v = reconcile(obs(process="p2"), mem(S.FAILED, desynced=True))
    assert not v.desynced
    assert reconcile(obs(info_error="timed out"), mem()).desynced
    # Every rank answered (ok: false): the replies were all read, the queues are in step.
    assert not reconcile(obs(rank(ok=False)), mem()).desynced


def test_the_rank_reason_and_the_ranks_are_named() -> None:
    v = reconcile(obs(rank(phase=P.FAILED, reason="restore_and_verify: 2 differ")), mem())
    assert "restore_and_verify: 2 differ" in v.reason
    v = reconcile(obs(rank(0, **TWO), rank(1, P.SUSPENDED, **TWO), paused=True), mem())
    assert "rank 0 awake_verified" in v.reason
    assert "rank 1 suspended L1" in v.reason


def test_from_info_reads_the_extension_dict() -> None:
    report = {
        "ok": True,
        "rank": 1,
        "world_size": 2,
        "phase": "suspended",
        "phase_level": 2,
        "phase_tags": ["weights", "kv_cache"],
        "phase_reason": None,
        "transitions": 4,
        "verified_transition": 2,
        "snapshot_held": True,
        "boot_id": "ab" * 16,
        "process_start_s": 1.0,
        "pid": 7,
        "poisoned": False,
        "allocator_asleep": ["weights"],
    }
    r = RankView.from_info(report)
    assert r == RankView(
        rank=1,
        phase=P.SUSPENDED,
        level=2,
        tags=("kv_cache", "weights"),
        transitions=4,
        verified_transition=2,
        snapshot_held=True,
        boot_id="ab" * 16,
        world_size=2,
        allocator_asleep=("weights",),
    )
    old = RankView.from_info({"ok": True, "rank": 0, "suspended": {}, "level": None})
    assert old.phase is P.UNREPORTED
    assert RankView.from_info({"ok": True, "phase": "napping"}).phase is P.UNREPORTED
    assert [r.rank for r in ranks_from_info([{"ok": True}, {"ok": True, "rank": -1}])] == [0, 1]
    assert RankView.from_info({"ok": False, "error": "x"}).ok is False


def test_the_docs_hold_the_same_table() -> None:
    text = DOCS.read_text()
    assert rules_table() in text, (
        "docs/contracts.md §2.1 differs from controller.models.reconcile.RULES"
    )


# ----------------------------------------------------------------------------- every combination

PHASES = [P.AWAKE_VERIFIED, P.SUSPENDED, P.RESUMED_UNVERIFIED, P.FAILED, P.UNREPORTED]


def _rank_variants(i: int, world: int) -> list[RankView]:
    out = []
    for phase, held, poisoned, steps in itertools.product(
        PHASES, (False, True), (False, True), (0, 2)
    ):
        out.append(
            rank(i, phase, snapshot_held=held, poisoned=poisoned, transitions=steps, world=world)
        )
    out.append(rank(i, ok=False, error="boom", world=world))
    out.append(rank(i, P.SUSPENDED, tags=("kv_cache",), world=world))
    out.append(rank(i, P.SUSPENDED, level=2, world=world))
    out.append(rank(i, allocator_asleep=("weights",), world=world))  # vLLM's own sleep
    return out


def _rank_sets() -> list[tuple[RankView, ...] | None]:
    one = [(r,) for r in _rank_variants(0, 1)]
    # Two ranks: every pair of phases, plus a held/unheld and a poisoned split.
    two: list[tuple[RankView, ...]] = []
    for a, b in itertools.product(PHASES, PHASES):
        two.append(
            (rank(0, a, world=2, snapshot_held=True), rank(1, b, world=2, snapshot_held=True))
        )
    two.append(
        (
            rank(0, P.RESUMED_UNVERIFIED, world=2, snapshot_held=True),
            rank(1, P.RESUMED_UNVERIFIED, world=2),
        )
    )
    two.append((rank(0, world=2), rank(1, world=2, poisoned=True)))
    two.append((rank(0, world=2, model="A"), rank(1, world=2, model="B")))  # two models
    two.append((rank(0, world=2),))  # a rank missing
    return [None, (), *one, *two]


def _observations() -> list[Observation]:
    out = [Observation(reachable=False)]
    for alive, paused, sleeping, process, ranks, info_error in itertools.product(
        (True, False),
        (False, True),
        (None, True),
        (None, "p1", "p2"),
        _rank_sets(),
        (None, "timed out"),
    ):
        if info_error is not None and ranks is not None:
            continue
        out.append(
            Observation(
                reachable=True,
                alive=alive,
                paused=paused,
                sleeping=sleeping,
                process=process,
                ranks=ranks,
                info_error=info_error,
            )
        )
    return out


def _memories() -> list[Memory]:
    out = []
    # The states a reconciliation meets (never one with a transition in flight, except as
    # the cache a restarted sidecar does not have: UNKNOWN).
    states = (S.UNKNOWN, S.STARTING, S.RUNNING, S.SUSPENDED, S.FAILED)
    for state, verified, desynced, process, boots, fresh in itertools.product(
        states, (False, True), (False, True), (None, "p1"), (None, ("boot0",)), (False, True)
    ):
        out.append(Memory(state, verified, desynced, process, boots, fresh))
        if desynced or fresh:
            continue  # what the consent below changes is read only of a trusted process
        # §2.3: the model accepts an unverified wake; and, RUNNING, was woken so
        out.append(Memory(state, verified, False, process, boots, accept_unverified=True))
        if state is S.RUNNING:
            out.append(
                Memory(state, False, False, process, boots, accept_unverified=True, unverified=True)
            )
        if state is S.SUSPENDED:  # put to sleep through vLLM's plain sleep by this sidecar
            out.append(
                Memory(
                    state, False, False, process, boots, accept_unverified=True, plain_asleep=True
                )
            )
    return out


OBS, MEMS = _observations(), _memories()


Judged = list[tuple[Observation, Memory, Verdict]]


@pytest.fixture(scope="module")
def judged() -> Iterator[Judged]:
    """Every (observation, memory) and its verdict, judged once for the module's tests. The
    140k verdicts are frozen out of the collector's sweeps while they live (kept, they slowed
    every later collection) and released after the module."""
    made = [(o, m, reconcile(o, m)) for o, m in itertools.product(OBS, MEMS)]
    gc.freeze()
    try:
        yield made
    finally:
        made.clear()
        gc.unfreeze()


def test_the_product_is_large_and_every_rule_is_reached(judged: Judged) -> None:
    reached = Counter(v.rule for _, _, v in judged)
    assert sum(reached.values()) > 50_000
    assert set(reached) == {r.id for r in RULES}


def test_running_only_when_every_rank_is_awake_and_verified_and_unpaused(judged: Judged) -> None:
    for o, m, v in judged:
        if v.state is not S.RUNNING:
            continue
        assert o.reachable
        assert o.alive
        assert not o.paused
        # verified, or (§2.3) woken unverified by a model that accepts it, never both
        assert v.verified != v.unverified
        assert not v.unverified or (m.accept_unverified and m.unverified)
        if v.rule == "cache-fits":
            # Nothing new was read: only the same process, last probed RUNNING and verified
            # (or woken unverified where accepted).
            assert m.state is S.RUNNING
            assert m.verified or m.unverified
            assert o.sleeping is not True
            assert o.process == m.process is not None
            assert not m.fresh
            assert m.boot_ids is not None
            continue
        assert o.ranks
        assert all(r.ok and r.phase is P.AWAKE_VERIFIED and not r.poisoned for r in o.ranks)
        assert not any(r.allocator_asleep for r in o.ranks)  # nothing vLLM itself released
        assert len(o.ranks) == o.ranks[0].world_size


def test_never_an_rpc_to_an_engine_whose_queues_may_be_out_of_step(judged: Judged) -> None:
    for o, m, v in judged:
        if not v.sends_rpc:
            continue
        assert o.reachable
        assert o.alive
        assert not v.desynced
        if m.desynced:
            assert o.process is not None
            assert m.process is not None
            assert o.process != m.process


def test_verdicts_are_complete_and_match_their_rule(judged: Judged) -> None:
    by_id = {r.id: r for r in RULES}
    allowed = {S.RUNNING, S.SUSPENDED, S.FAILED, S.RESUMING}
    for o, _m, v in judged:
        assert v.do is by_id[v.rule].do
        assert v.reason
        if v.do is Do.PROBE:
            assert v.state is None
            assert o.ranks is None
        else:
            assert v.state in allowed
        if v.state is S.SUSPENDED:
            assert o.paused
        if v.do is Do.FINISH_WAKE:
            assert o.ranks
            assert all(r.snapshot_held for r in o.ranks)
        if v.state is not S.RUNNING:
            assert not v.verified
        if v.state not in (S.RUNNING, S.RESUMING):
            assert not v.unverified


def test_mixed_ranks_are_failed_whatever_else_holds(judged: Judged) -> None:
    for o, _, v in judged:
        if o.reachable and o.alive and o.ranks and len({r.phase for r in o.ranks}) > 1:
            assert v.state in (S.FAILED, None) or v.rule == "desynced"
            assert v.state is S.FAILED


def test_a_fresh_process_with_memory_steps_is_never_taken_for_ours(judged: Judged) -> None:
    for o, m, v in judged:
        if m.fresh and o.ranks and any(r.transitions for r in o.ranks):
            assert v.state is not S.RUNNING


def test_rules_table_lines_are_one_per_rule() -> None:
    rows = [ln for ln in rules_table().splitlines() if re.match(r"\| `", ln)]
    assert len(rows) == len(RULES)
    assert dataclasses.is_dataclass(RULES[0])


def test_an_info_call_that_never_connected_leaves_the_queues_in_step() -> None:
    v = reconcile(obs(info_error="connection refused", info_may_desync=False), mem())
    assert v.state is S.FAILED
    assert not v.desynced


def test_a_verdict_remembers_what_the_engine_is_and_a_later_one_holds_it_to_that() -> None:
    """Identity: the first verified probe's served name and class are remembered (the
    verdict carries them), and a restarted engine that serves another model is FAILED."""
    first = reconcile(
        obs(rank(served_model_name="tiny", model="LlamaForCausalLM"), served=("tiny",)), mem()
    )
    assert (first.rule, first.served, first.model) == ("running", "tiny", "LlamaForCausalLM")
    later = reconcile(
        obs(rank(served_model_name="tiny", model="GemmaForCausalLM"), process="p2"),
        mem(S.RUNNING, verified=True, served=first.served, model=first.model),
    )
    assert (later.rule, later.state) == ("not-this-model", S.FAILED)
    assert "GemmaForCausalLM" in later.reason
