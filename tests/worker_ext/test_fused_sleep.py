"""hotswap_sleep, the sleep's prepare and suspend in one RPC (docs/contracts.md §1), end to
end through the extension over inplace.py's in-place pools on host memory (no
engine, no GPU): where the backend offloads with copies (CUDA's shape, `overlaps_prepare`)
the prepare runs after the copies are queued and before anything is released; a prepare
that fails releases nothing; where the backend cannot overlap, the prepare runs first."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import pytest
import torch
from inplace import JUNK, InPlacePools, Worker

from worker_ext.pools import DISCARDED, KV_CACHE, OFFLOADED, WEIGHTS, During, policy


class OverlappingPools(InPlacePools):
    """In-place pools that, like CuMemBackend, queue the offload copies first, then call
    `during` (the prepare), then release; a log says in which order."""

    overlaps_prepare = True

    def __init__(self, base: InPlacePools) -> None:
        super().__init__(base.buf, base.records())
        self.settings = base.settings
        self.log: list[str] = []
        self.cache_released: list[list[str]] = []
        self.release_fails = False

    def suspend(
        self,
        level: int,
        tags: list[str],
        keep_kv: bool = False,
        rewritten: Sequence[tuple[int, int]] = (),
        during: During | None = None,
        early_kv: Sequence[int] = (),
    ) -> dict[str, Any]:
        how = {t: policy(level, t, keep_kv) for t in tags}
        queued = []
        for tag in tags:
            if how[tag] == OFFLOADED:
                self.host[tag] = self._view(tag).clone()  # the copy, "on the link"
                queued.append(tag)
                self.log.append(f"copy {tag}")
        early = [r for r in self._records if r[0] in set(early_kv) and r[2] == KV_CACHE]
        for s, e, _tag in early:  # released before the prepare: the memory is gone
            self.buf[s - self.base : e - self.base].fill_(JUNK)
            self.log.append("release early")

        def go_on() -> None:  # the rest of the copies, behind the prepare's own
            self.log.append("copy the rest")

        if during is not None:
            try:
                during(go_on)
            except BaseException:
                self.log.append("wait copies, release nothing")
                for tag in queued:
                    del self.host[tag]
                for s, e, _tag in early:
                    self.buf[s - self.base : e - self.base].fill_(0)  # fresh memory
                    self.log.append("map early again")
                raise
            self.log.append("prepared")
        if self.release_fails:
            raise RuntimeError("unmap failed")
        freed, offloaded = {}, {}
        for tag in tags:
            view = self._view(tag)
            view.fill_(JUNK)
            self.log.append(f"release {tag}")
            freed[tag] = int(view.numel())
            offloaded[tag] = freed[tag] if how[tag] == OFFLOADED else 0
            self._asleep[tag] = how[tag]
        self._level = level
        return {"freed_bytes": freed, "offloaded_bytes": offloaded, "overlapped": bool(queued)}

    def release_cached(self) -> float:
        self.cache_released.append(list(self.log))  # what was released before it
        return 0.002

    def _view(self, tag: str) -> torch.Tensor:
        mine = [(s, e) for s, e, t in self._records if t == tag]  # a pool of several records
        return self.buf[min(mine)[0] - self.base : max(mine)[1] - self.base]


class FusedWorker(Worker):
    def __init__(
        self, overlap: bool = True, fail_at: str | None = None, split_kv: bool = False
    ) -> None:
        super().__init__(demotable=False)
        if overlap:
            self.pools = OverlappingPools(self.pools)
            self._hotswap_st.backend = self.pools
        if split_kv:  # the KV pool as two records: the KV cache alone, the block table's
            b = self.pools.base
            self.pools._records[1:] = [
                (b + 32 * 1024, b + 48 * 1024, KV_CACHE),
                (b + 48 * 1024, b + 64 * 1024, KV_CACHE),
            ]
        self.fail_at = fail_at
        self.seen: list[str] = []

    def _hotswap_fault(self, point: str) -> None:
        self.seen.append(point)
        if point == self.fail_at:
            self.fail_at = None  # once
            raise RuntimeError(f"injected at {point}")


def _truth(w: Worker) -> dict[str, Any]:
    info = w.hotswap_info()
    keys = ("phase", "phase_level", "transitions", "suspended", "snapshot_held", "level")
    return {k: info[k] for k in keys}


def test_at_level_2_nothing_is_copied_and_the_prepare_is_not_reported_as_under_copies() -> None:
    """`overlapped` says the prepare ran under copies (the backend's answer), not that the
    backend could: at level 2 nothing is offloaded, so it ran alone before the release."""
    w = FusedWorker()
    out = w.hotswap_sleep(2)
    assert out["ok"], out
    assert not [e for e in w.pools.log if e.startswith("copy ") and e != "copy the rest"]
    assert out["overlapped"] is False
    assert out["offloaded_bytes"] == {WEIGHTS: 0, KV_CACHE: 0}


def test_the_prepare_runs_under_the_copies_and_nothing_is_released_before_it() -> None:
    w = FusedWorker()
    before = w.weights_bytes()
    out = w.hotswap_sleep(1)
    assert out["ok"], out
    assert w.pools.log == [
        "copy weights",
        "copy the rest",  # called by the prepare, once its protected copies are queued
        "prepared",
        "release weights",
        "release kv_cache",
    ]
    assert w.seen == ["suspend", "prepare"]  # the prepare's point inside the backend's call
    assert out["overlapped"] is True
    assert out["kv"] == "discard"
    assert out["tags"] == [WEIGHTS, KV_CACHE]
    assert out["freed_bytes"] == {WEIGHTS: 32 * 1024, KV_CACHE: 32 * 1024}
    assert out["fingerprinted"] > 0
    assert out["protection"] == "ranges"
    assert "failed_step" not in out
    assert {"prepare_s", "suspend_s", "answer_s", "sleep_s", "records_s", "snapshot_s"} <= set(
        out["timings"]
    )
    truth = _truth(w)
    assert (truth["phase"], truth["phase_level"], truth["level"]) == ("suspended", 1, 1)
    assert truth["suspended"] == {WEIGHTS: OFFLOADED, KV_CACHE: DISCARDED}
    assert truth["snapshot_held"] is True
    v = w.hotswap_wake()
    assert v["ok"], v
    assert v["verified"] == out["fingerprinted"]
    assert torch.equal(w.weights_bytes(), before)
    assert w.hotswap_info()["phase"] == "awake_verified"


def test_a_prepare_by_range_runs_no_audit_pass_and_answers_its_at_risk(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The range plan names what the level loses: the prepare answers the audit's at_risk
    without walking the records a second time (ownership.judge) on the sleep's path."""
    from worker_ext import ownership

    w = FusedWorker()
    audit = w.hotswap_audit(1)
    assert audit["at_risk"]

    def no_audit(*_a: Any, **_k: Any) -> Any:
        raise AssertionError("an audit pass inside the sleep's prepare")

    monkeypatch.setattr(ownership, "judge", no_audit)
    out = w.hotswap_sleep(1)
    assert out["ok"], out
    assert out["at_risk"] == sorted(audit["at_risk"])


def test_the_snapshot_is_taken_of_the_bytes_before_any_release() -> None:
    """A byte the sleep loses (the KV pool's block table, protected by range) comes back:
    the prepare inside the fused sleep copied it before the KV cache was released."""
    w = FusedWorker()
    table = w.model_runner.block_table.clone()
    assert w.hotswap_sleep(1)["ok"]
    assert not torch.equal(w.model_runner.block_table, table)  # released: junk now
    assert w.hotswap_wake()["ok"]
    assert torch.equal(w.model_runner.block_table, table)


def test_a_failed_prepare_releases_nothing_and_moves_no_phase() -> None:
    w = FusedWorker(fail_at="prepare")
    before = w.buf.clone()
    truth = _truth(w)
    out = w.hotswap_sleep(1)
    assert out["ok"] is False
    assert out["failed_step"] == "prepare"
    assert "injected at prepare" in out["error"]
    assert w.pools.log == ["copy weights", "wait copies, release nothing"]  # never the rest
    assert torch.equal(w.buf, before)  # every pool still mapped, every byte in place
    assert w.pools.host == {}  # the queued copy given up
    assert _truth(w) == truth  # no memory step, no snapshot held
    again = w.hotswap_sleep(1)  # a new sleep (the controller's would be after a restart)
    assert again["ok"], again
    assert w.hotswap_wake()["ok"]


def test_a_failed_release_leaves_the_rank_failed() -> None:
    w = FusedWorker()
    w.pools.release_fails = True
    out = w.hotswap_sleep(1)
    assert out["ok"] is False
    assert out["failed_step"] == "suspend"
    assert "unmap failed" in out["error"]
    assert w.hotswap_info()["phase"] == "failed"


def test_a_refusal_at_the_suspend_point_moves_nothing() -> None:
    w = FusedWorker(fail_at="suspend")
    truth = _truth(w)
    out = w.hotswap_sleep(1)
    assert out["ok"] is False
    assert out["failed_step"] == "suspend"
    assert w.pools.log == []  # nothing queued
    assert _truth(w)["phase"] == truth["phase"] == "awake_verified"
    assert _truth(w)["transitions"] == truth["transitions"]


@pytest.mark.parametrize("level", [1, 2])
def test_without_overlap_the_prepare_runs_first_and_the_wake_verifies(level: int) -> None:
    w = FusedWorker(overlap=False)
    before = w.weights_bytes()
    out = w.hotswap_sleep(level)
    assert out["ok"], out
    assert w.seen == ["prepare", "suspend"]
    assert out["overlapped"] is False
    assert w.hotswap_info()["phase_level"] == level
    if level == 1:
        assert w.hotswap_wake()["ok"]
    else:
        v = w.wake(2)
        assert v["ok"], v
        assert w.reloads == 1
    assert torch.equal(w.weights_bytes(), before)


def test_a_fused_sleep_is_refused_asleep_or_at_a_bad_level() -> None:
    w = FusedWorker()
    bad = w.hotswap_sleep(3)
    assert bad["ok"] is False
    assert "level" in bad["error"]
    assert w.hotswap_sleep(1)["ok"]
    truth = _truth(w)
    again = w.hotswap_sleep(1)
    assert again["ok"] is False
    assert "already suspended" in again["error"]
    assert _truth(w) == truth


def test_the_first_stage_holds_the_first_share_of_the_weights_bytes() -> None:
    """cumem.coded.cut: how many records (in order) the fused sleep's first copies take: the
    fewest that hold the tuning's sleep_stage_share of the bytes, at least one; all of them
    at a share of 1."""
    from worker_ext.cumem.coded import cut as _cut
    from worker_ext.settings import Tuning

    assert 0.0 < Tuning().sleep_stage_share < 1.0
    with pytest.raises(ValueError, match="sleep_stage_share"):
        Tuning(sleep_stage_share=0.0)
    assert _cut(0.3, [10, 10, 10, 10]) == 2
    assert _cut(0.3, [100, 1, 1]) == 1
    assert _cut(0.3, [1, 1, 100]) == 3
    assert _cut(0.3, []) == 0
    assert _cut(1.0, [5, 5]) == 2
    assert _cut(0.3, [0, 0]) == 1


# -- tensor parallel: the ranks agree before the first release (contracts §1) ------------


class _Done:
    def wait(self) -> None:
        return None


class FakeGroup:
    """Rank 0's side of a two-rank gloo group: the other rank's prepare outcome, or a
    timeout (it never arrives); records what this rank sent."""

    def __init__(self, other_ok: bool | None) -> None:
        self.other_ok = other_ok
        self.sent: list[list[int]] = []

    def allreduce(self, tensors: list[torch.Tensor], opts: Any) -> _Done:
        self.sent.append(tensors[0].tolist())
        assert opts.timeout.total_seconds() > 0  # always bounded
        if self.other_ok is None:
            raise RuntimeError("Timed out waiting 1000ms for recv operation to complete")
        tensors[0][1] += 0 if self.other_ok else 1
        return _Done()


class FakeWorld:
    world_size, rank_in_group, ranks = 2, 0, [0, 1]

    def __init__(self, other_ok: bool | None) -> None:
        self.cpu_group = FakeGroup(other_ok)


def _two_ranks(w: FusedWorker, other_ok: bool | None) -> FakeGroup:
    world = FakeWorld(other_ok)
    w._hotswap_st.quiescer.world = world
    return world.cpu_group


@pytest.mark.parametrize("overlap", [True, False])
def test_a_prepare_failed_on_another_rank_releases_nothing_here(overlap: bool) -> None:
    """Rank 1's prepare failed: rank 0's succeeded, yet it releases nothing (the old fused
    sleep went on and rank 0 slept alone: FAILED, a restart)."""
    w = FusedWorker(overlap=overlap)
    group = _two_ranks(w, other_ok=False)
    before = w.buf.clone()
    truth = _truth(w)
    out = w.hotswap_sleep(1)
    assert out["ok"] is False, out
    assert out["failed_step"] == "prepare"
    assert out["failed_ranks"] == [1]
    assert "ranks [1]" in out["error"]
    assert group.sent == [[0, 0]]  # this rank said its prepare was done
    assert torch.equal(w.buf, before)  # every pool still mapped, every byte in place
    if overlap:  # its copies all queued (the prepare was done), waited for, none released
        assert w.pools.log == ["copy weights", "copy the rest", "wait copies, release nothing"]
    assert _truth(w) == truth
    w._hotswap_st.quiescer.world = FakeWorld(other_ok=True)
    assert w.hotswap_sleep(1)["ok"]  # a later sleep the ranks agree on goes ahead
    assert w.hotswap_wake()["ok"]


def test_a_prepare_failed_here_is_told_to_the_other_ranks() -> None:
    w = FusedWorker(fail_at="prepare")
    group = _two_ranks(w, other_ok=True)
    out = w.hotswap_sleep(1)
    assert out["ok"] is False
    assert out["failed_ranks"] == [0]
    assert "injected at prepare" in out["error"]
    assert group.sent == [[1, 0]]  # rank 0's flag: failed


def test_an_agreement_that_times_out_releases_nothing_and_poisons_the_group() -> None:
    w = FusedWorker()
    _two_ranks(w, other_ok=None)
    before = w.buf.clone()
    out = w.hotswap_sleep(1)
    assert out["ok"] is False
    assert out["failed_step"] == "prepare"
    assert "agreement timed out" in out["error"]
    assert torch.equal(w.buf, before)
    assert w.hotswap_info()["poisoned"] is True


def test_the_host_is_trimmed_once_everything_is_released(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sleep ends by handing back what the host need not keep asleep (worker_ext.trim:
    torch's cached pinned blocks, the heap's free pages), after the last release."""
    from worker_ext import trim

    w = FusedWorker()
    seen: list[list[str]] = []

    def release() -> dict[str, Any]:
        seen.append(list(w.pools.log))
        return {"pinned_cache": None, "malloc_trim": True, "s": 0.001}

    monkeypatch.setattr(trim, "release_host_memory", release)
    out = w.hotswap_sleep(1)
    assert out["ok"], out
    assert seen == [w.pools.log]  # once, when nothing more was released after it
    assert seen[0][-1] == "release kv_cache"
    assert out["host_trim"] == {"pinned_cache": None, "malloc_trim": True, "s": 0.001}
    assert out["timings"]["host_trim_s"] == 0.001


def test_the_device_cache_is_released_again_once_the_suspend_has_returned() -> None:
    """What the suspend's own scratch freed after its trim (the codec's encode buffers: two
    whole free 66 MiB segments on the H200's 8B sleeper) is handed back at the RPC's end,
    after the last release, so neither a level-1 sleeper nor a deep sleep's checkpoint
    keeps it; both sleep RPCs."""
    w = FusedWorker()
    out = w.hotswap_sleep(1)
    assert out["ok"], out
    assert w.pools.cache_released == [w.pools.log]  # once, after the last release
    assert w.pools.log[-1] == "release kv_cache"
    assert out["timings"]["cache_release_s"] == 0.002
    assert w.hotswap_wake()["ok"]
    w.pools.log.clear()
    w.pools.cache_released.clear()
    assert w.hotswap_prepare(1)["ok"]
    out = w.hotswap_suspend(1)
    assert out["ok"], out
    assert w.pools.cache_released == [w.pools.log]
    assert out["timings"]["cache_release_s"] == 0.002


def test_the_kv_records_that_hold_only_the_kv_cache_go_before_the_prepare() -> None:
    """The KV cache first (the tuning's kv_early): once a prepare has planned the ranges, the
    next fused sleep releases the KV record it protected nothing in right after the first
    copies are queued, before the prepare; the block table's record waits for it."""
    w = FusedWorker(split_kv=True)
    kv_only = w.pools.records()[1][0]
    assert w.hotswap_sleep(1)["ok"]
    assert "release early" not in w.pools.log  # nothing planned before the first prepare
    assert w.hotswap_wake()["ok"]
    w.pools.log.clear()
    table = w.model_runner.block_table.clone()
    out = w.hotswap_sleep(1)
    assert out["ok"], out
    assert w.pools.log[:3] == ["copy weights", "release early", "copy the rest"]
    assert w.pools.log[3:] == ["prepared", "release weights", "release kv_cache"]
    assert w._hotswap_early_kv() == (kv_only,)
    v = w.hotswap_wake()
    assert v["ok"], v
    assert torch.equal(w.model_runner.block_table, table)  # protected, written back
    off = dataclasses.replace(w._hotswap_st.settings.tuning, kv_early=False)
    w._hotswap_st.use_settings(dataclasses.replace(w._hotswap_st.settings, tuning=off))
    w.pools.log.clear()
    assert w.hotswap_sleep(1)["ok"]
    assert "release early" not in w.pools.log  # tuning kv_early off: after the prepare


def test_a_prepare_that_fails_after_the_early_release_maps_it_back_and_stays_awake() -> None:
    w = FusedWorker(split_kv=True)
    assert w.hotswap_sleep(1)["ok"]
    assert w.hotswap_wake()["ok"]
    w.pools.log.clear()
    w.fail_at = "prepare"
    truth = _truth(w)
    out = w.hotswap_sleep(1)
    assert out["ok"] is False
    assert out["failed_step"] == "prepare"
    assert w.pools.log == [
        "copy weights",
        "release early",
        "wait copies, release nothing",
        "map early again",
    ]
    assert _truth(w) == truth  # awake and verified as before: no byte of it was lost
    assert w.hotswap_sleep(1)["ok"]
    assert w.hotswap_wake()["ok"]


def test_protected_bytes_in_a_record_released_early_fail_the_rank() -> None:
    """A KV record released first that the prepare's plan then protects something in
    (here: the block table's, named releasable by a stale note) lost bytes: failed."""
    w = FusedWorker(split_kv=True)
    assert w.hotswap_sleep(1)["ok"]
    assert w.hotswap_wake()["ok"]
    st = w._hotswap_st
    assert st.kv_droppable is not None
    spans = st.kv_droppable[0]
    st.kv_droppable = (spans, tuple(s for s, _e in spans))  # both KV records, wrongly
    out = w.hotswap_sleep(1)
    assert out["ok"] is False
    assert out["failed_step"] == "suspend"
    assert "bytes lost" in out["error"]
    assert w.hotswap_info()["phase"] == "failed"
