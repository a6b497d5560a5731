"""Protection by memory range, end to end on host memory (no engine, no GPU).

One host buffer stands in for the device: two "records" (a weights and a kv_cache
allocation), named tensors made over parts of it (parameters, a buffer, the KV cache), and
bytes no tensor names (what a module global or a closure would hold). A sleep is the whole
buffer zeroed (the pools discarded), the reload writes the parameters back; the snapshot
must bring every other byte back and fingerprint it.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from worker_ext import protect, ranges, snapshot
from worker_ext.ownership import BUFFER, PARAMETER, RUNNER, TensorRecord
from worker_ext.rawmem import raw_bytes

KIB = 1024
CPU = torch.device("cpu")


class Pools:
    def __init__(self) -> None:
        self.buf = torch.randint(0, 256, (64 * KIB,), dtype=torch.uint8)
        self.base = int(self.buf.data_ptr())
        self.records = [
            (self.base, self.base + 32 * KIB, "weights"),
            (self.base + 32 * KIB, self.base + 64 * KIB, "kv_cache"),
        ]
        self.tensors = [
            self._t("model.p1", 0, 4096, PARAMETER),
            self._t("model.p2", 8192, 1000, PARAMETER),  # ends on 8 bytes + 0: 1000 % 8 == 0
            self._t(
                "model.p3", 12288, 998, PARAMETER
            ),  # an odd end: the gap after it is not aligned
            self._t("model.b1", 16384, 256, BUFFER),
            self._t("runner.kv_caches.0", 32 * KIB, 16 * KIB, RUNNER, kv=True),
            self._t("runner.meta", 50000, 128, RUNNER),
        ]
        self.global_w = (self.base + 20000, self.base + 20512)  # unnamed, weights pool
        self.global_kv = (self.base + 52000, self.base + 52300)  # unnamed, kv_cache pool

    def _t(self, name: str, off: int, n: int, kind: str, kv: bool = False) -> TensorRecord:
        return TensorRecord(name, raw_bytes(self.base + off, n, CPU), kind, is_kv=kv)

    def tag_of(self, ptr: int, n: int) -> str:
        return ranges.owner(self.records, ptr) or "unpooled"

    def params(self) -> list[tuple[TensorRecord, torch.Tensor]]:
        return [(t, t.tensor.clone()) for t in self.tensors if t.kind == PARAMETER]

    def at(self, rng: tuple[int, int]) -> torch.Tensor:
        return self.buf[rng[0] - self.base : rng[1] - self.base]

    def kv(self) -> tuple[int, int]:
        return self.base + 32 * KIB, self.base + 48 * KIB


def _sleep_and_wake(p: Pools, level: int, saved: list[tuple[TensorRecord, torch.Tensor]]) -> None:
    before_w = p.buf[: 32 * KIB].clone()
    p.buf[32 * KIB :].zero_()  # kv_cache discarded at every level
    if level == 2:
        p.buf[: 32 * KIB].zero_()  # weights discarded, then the reload refills the parameters
        for t, value in saved:
            t.tensor.copy_(value)
    else:
        assert torch.equal(p.buf[: 32 * KIB], before_w)  # level 1: offloaded and copied back


def _prepare(p: Pools, level: int, **kw: Any) -> snapshot.Snapshot:
    cover = protect.plan(level, p.records, p.tensors, p.tag_of, **kw)
    return snapshot.prepare(level, p.tensors, set(), False, cover, CPU)


@pytest.mark.parametrize("level", [1, 2])
def test_every_byte_but_the_kv_cache_comes_back(level: int) -> None:
    p = Pools()
    original = p.buf.clone()
    saved = p.params()
    snap = _prepare(p, level)
    cov = snap.protection
    assert cov is not None
    kv_w = 16 * KIB
    if level == 1:
        assert [r[2] for r in cov.protect] == ["kv_cache"]  # the KV cache opens the record
        assert cov.protected_bytes == 32 * KIB - kv_w
    else:
        params = 4096 + 1000 + 998
        assert cov.protected_bytes == (32 * KIB - params) + (32 * KIB - kv_w)
        assert cov.pools["weights"]["restored_bytes"] == params
    assert cov.pools["kv_cache"]["restored_bytes"] == kv_w
    # unnamed = protected minus named (b1 and runner.meta are named inside the ranges)
    named_inside = (256 if level == 2 else 0) + 128
    assert cov.unnamed_bytes == cov.protected_bytes - named_inside
    assert all(e > s for s, e, _ in cov.unnamed)
    _sleep_and_wake(p, level, saved)
    assert snapshot.restore(snap) == len(cov.protect)
    checked, bad, bad_ranges = snapshot.verify(snap)
    assert (bad, bad_ranges) == ([], [])
    assert checked == len(snap.entries) + len(cov.unnamed)
    kv = p.kv()
    keep = torch.ones(p.buf.numel(), dtype=torch.bool)
    keep[kv[0] - p.base : kv[1] - p.base] = False
    assert torch.equal(p.buf[keep], original[keep])  # every byte outside the KV cache


@pytest.mark.parametrize("level", [1, 2])
def test_the_plan_names_what_the_audit_names_at_risk(level: int) -> None:
    """The range plan's `at_risk` is ownership.judge's, so a prepare by range needs no
    audit pass of its own."""
    from worker_ext.ownership import judge

    p = Pools()
    cover = protect.plan(level, p.records, p.tensors, p.tag_of)
    audit = {r["name"] for r in judge(p.tensors, level, p.tag_of) if r["at_risk"]}
    assert cover.at_risk == audit
    assert "runner.meta" in audit  # a runner tensor in the discarded KV pool
    assert ("model.b1" in audit) == (level == 2)  # a buffer: the reload does not refill it


@pytest.mark.parametrize(
    ("level", "where", "pool"), [(1, "global_kv", "kv_cache"), (2, "global_w", "weights")]
)
def test_a_corrupted_unnamed_range_is_reported_by_address(
    level: int, where: str, pool: str
) -> None:
    p = Pools()
    saved = p.params()
    snap = _prepare(p, level)
    _sleep_and_wake(p, level, saved)
    snapshot.restore(snap)
    rng = getattr(p, where)
    hit = rng[0] + 77
    p.buf[hit - p.base] ^= 0x10  # after the write-back, before the fingerprints
    _, bad, bad_ranges = snapshot.verify(snap)
    assert len(bad_ranges) == 1, bad_ranges
    (r,) = bad_ranges
    assert r["pool"] == pool
    assert r["start"] <= hit < r["end"]
    assert r["range"] == f"{r['start']:#x}-{r['end']:#x}"
    assert r["nearest"] in {t.name for t in p.tensors}
    assert bad == [f"<unnamed {pool} {r['range']} ({r['bytes']} bytes, near {r['nearest']})>"]


def test_a_named_tensor_in_a_protected_range_is_named() -> None:
    p = Pools()
    saved = p.params()
    snap = _prepare(p, 2)
    _sleep_and_wake(p, 2, saved)
    snapshot.restore(snap)
    p.tensors[3].tensor[5] ^= 1  # model.b1
    _, bad, bad_ranges = snapshot.verify(snap)
    assert (bad, bad_ranges) == (["model.b1"], [])


def test_by_object_the_unnamed_bytes_are_lost_unseen() -> None:
    """What the range protection fixes: object protection verifies clean and loses them."""
    p = Pools()
    saved = p.params()
    want_w, want_kv = p.at(p.global_w).clone(), p.at(p.global_kv).clone()
    snap = snapshot.prepare(2, p.tensors, {"model.b1", "runner.meta"}, False)
    _sleep_and_wake(p, 2, saved)
    snapshot.restore(snap)
    assert snapshot.verify(snap)[1:] == ([], [])
    assert not torch.equal(p.at(p.global_w), want_w)
    assert not torch.equal(p.at(p.global_kv), want_kv)


def test_free_blocks_are_left_out() -> None:
    p = Pools()
    free = [(p.base + 24 * KIB, p.base + 28 * KIB), (p.base + 60 * KIB, p.base + 64 * KIB)]
    full = protect.plan(2, p.records, p.tensors, p.tag_of)
    cut = protect.plan(2, p.records, p.tensors, p.tag_of, free=free)
    assert cut.protected_bytes == full.protected_bytes - 8 * KIB
    assert cut.pools["weights"]["free_bytes"] == cut.pools["kv_cache"]["free_bytes"] == 4 * KIB
    assert not ranges.subtract(
        [(s, e) for s, e, _ in cut.protect], [(s, e) for s, e, _ in full.protect]
    )
    for s, e in free:
        assert not any(a < e and s < b for a, b, _ in cut.protect)


def test_unaligned_unnamed_heads_are_split_off() -> None:
    p = Pools()
    cov = protect.plan(2, p.records, p.tensors, p.tag_of)
    p3_end = p.base + 12288 + 998
    assert (p3_end, p3_end + 2, "weights") in cov.unnamed  # 2 bytes up to the next word
    assert all(s % 8 == 0 for s, e, _ in cov.unnamed if e - s >= 8)


def test_empty_and_untouched_pools() -> None:
    p = Pools()
    assert protect.plan(1, [], p.tensors, p.tag_of).protect == []
    cov = protect.plan(1, p.records[:1], p.tensors, p.tag_of)  # only weights: offloaded
    assert cov.protect == []
    assert cov.pools["weights"] == {
        "records": 1,
        "bytes": 32 * KIB,
        "protected_bytes": 0,
        "unnamed_bytes": 0,
        "discarded": 0,
        "restored_bytes": 32 * KIB,
    }


@pytest.mark.parametrize("level", [1, 2])
def test_the_graph_pool_protects_only_the_tensors_held_in_it(level: int) -> None:
    """The CUDA graphs' pool (worker_ext.graphpool) is scratch every replay writes before it
    reads: a plan protects only the named tensors in it (someone holds them across forwards),
    not its unnamed bytes, where any other discarded pool protects every unnamed byte."""
    p = Pools()
    graph = (p.base + 48 * KIB, p.base + 64 * KIB)
    p.records[1] = (p.base + 32 * KIB, graph[0], "kv_cache")
    p.records.append((*graph, "cudagraph"))
    held = p._t("runner.graph_output", 56 * KIB, 512, RUNNER)
    p.tensors = [t for t in p.tensors if t.name != "runner.meta"] + [held]
    cover = protect.plan(level, p.records, p.tensors, p.tag_of)
    in_graphs = [(s, e) for s, e, tag in cover.protect if tag == "cudagraph"]
    assert in_graphs == [protect.storage_range(held)]
    assert not [r for r in cover.unnamed if r[2] == "cudagraph"]
    row = cover.pools["cudagraph"]
    assert (row["discarded"], row["protected_bytes"], row["unnamed_bytes"]) == (1, 512, 0)
    assert row["restored_bytes"] == 16 * KIB - 512  # dropped on purpose, as the KV tensors
