"""The rank's own phase record (worker_ext.phase): pure, no engine."""

from __future__ import annotations

import os
import time

from worker_ext import phase as ph
from worker_ext.phase import RankPhase, process_start_time


def test_fresh_rank_is_awake_and_verified() -> None:
    p = RankPhase()
    r = p.report()
    assert r["phase"] == ph.AWAKE_VERIFIED
    assert r["transitions"] == r["verified_transition"] == 0
    assert r["phase_level"] is None
    assert r["phase_tags"] == []
    assert r["phase_reason"] is None
    assert len(r["boot_id"]) == 32
    assert int(r["boot_id"], 16) >= 0
    assert r["pid"] == os.getpid()
    assert RankPhase().boot_id != p.boot_id


def test_a_full_cycle_moves_through_every_phase() -> None:
    p = RankPhase()
    p.suspended(2, ["weights", "kv_cache"])
    assert (p.phase, p.level, p.tags, p.transitions) == (
        ph.SUSPENDED,
        2,
        ("kv_cache", "weights"),
        1,
    )
    p.resumed(["kv_cache"])
    assert (p.phase, p.tags) == (ph.SUSPENDED, ("kv_cache",))
    p.reloaded()
    assert p.phase == ph.SUSPENDED
    p.resumed([])
    assert (p.phase, p.level, p.tags) == (ph.RESUMED_UNVERIFIED, 2, ())
    p.reloaded()
    assert p.phase == ph.RESUMED_UNVERIFIED
    assert p.verified_transition == 0
    p.verified()
    assert (p.phase, p.level, p.tags) == (ph.AWAKE_VERIFIED, None, ())
    assert p.transitions == p.verified_transition == 6


def test_reload_of_an_awake_rank_is_unverified() -> None:
    p = RankPhase()
    p.reloaded()
    assert p.phase == ph.RESUMED_UNVERIFIED
    assert p.verified_transition == 0 < p.transitions


def test_failed_is_final() -> None:
    p = RankPhase()
    p.suspended(1, ["kv_cache"])
    p.resumed([])
    p.failed("restore_and_verify: 1 tensor(s) differ")
    assert (p.phase, p.level, p.tags) == (ph.FAILED, None, ())
    assert p.reason == "restore_and_verify: 1 tensor(s) differ"
    for step in (
        lambda: p.suspended(1, ["kv_cache"]),
        lambda: p.resumed([]),
        p.reloaded,
        p.verified,
    ):
        step()
        assert p.phase == ph.FAILED
    p.failed("later")
    assert p.reason == "restore_and_verify: 1 tensor(s) differ"  # the first cause is kept
    assert p.transitions == 8
    assert p.verified_transition == 0


def test_process_start_time_reads_proc_like_prometheus() -> None:
    tick = os.sysconf("SC_CLK_TCK")
    stat = "42 (a b) c) S " + " ".join(["0"] * 18) + f" {5 * tick} 0 0"
    assert process_start_time(stat, "cpu 1 2\nbtime 1000\n") == 1005.0
    assert process_start_time("garbage", "btime 1000\n") == ph._IMPORTED_S
    now = process_start_time()
    assert now <= time.time()
    assert now > time.time() - 10 * 24 * 3600 or now == ph._IMPORTED_S
