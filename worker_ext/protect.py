"""What a sleep level loses, by memory range: the pools' records against the object walk.

A pool discarded at a level loses every byte its records hold. The level's own mechanism
brings some of them back (the reload refills the parameters at level 2) or needs none of
them (the KV cache, whose content is dropped on purpose; the CUDA graphs' pool outside the
tensors the walk finds there, scratch that every replay writes before it reads); every
other byte is protected:
copied to host before the sleep, written back in place after the wake, fingerprinted. The
object walk names what it can; the rest are unnamed ranges, protected and verified all the
same, reported with the nearest named tensor (docs/contracts.md §1.2).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from worker_ext import ranges
from worker_ext.ownership import TensorRecord, restored_by
from worker_ext.pools import DISCARDED, GRAPHS, KV_CACHE, WEIGHTS, policy

PoolRecord = tuple[int, int, str]  # (start, end, tag) of one allocation


@dataclass(frozen=True)
class Protection:
    level: int
    protect: list[PoolRecord]  # copied to host and written back, exact to the byte
    unnamed: list[PoolRecord]  # protected bytes no named tensor holds
    named: ranges.Named  # every named storage, for reports
    pools: dict[str, dict[str, int]] = field(default_factory=dict)
    # the named tensors a sleep at `level` would lose (ownership.judge's `at_risk`)
    at_risk: frozenset[str] = frozenset()

    @property
    def protected_bytes(self) -> int:
        return sum(e - s for s, e, _ in self.protect)

    @property
    def unnamed_bytes(self) -> int:
        return sum(e - s for s, e, _ in self.unnamed)

    def describe(self, rng: tuple[int, int], pool: str) -> dict[str, Any]:
        """A range as reports show it: addresses, size, pool, nearest named tensor."""
        near = self.named.nearest(rng)
        return {
            "start": rng[0],
            "end": rng[1],
            "bytes": rng[1] - rng[0],
            "range": f"{rng[0]:#x}-{rng[1]:#x}",
            "pool": pool,
            "nearest": near[0] if near else None,
            "nearest_distance": near[1] if near else None,
        }


def storage_range(rec: TensorRecord) -> tuple[int, int]:
    st = rec.tensor.untyped_storage()
    start = int(st.data_ptr())
    return start, start + int(st.nbytes())


def plan(
    level: int,
    records: Sequence[PoolRecord],
    tensors: Sequence[TensorRecord],
    tag_of: Callable[[int, int], str],
    free: Sequence[tuple[int, int]] = (),
    align: int = 8,
) -> Protection:
    """The ranges a sleep at `level` must protect, from the pools' records and the walk.

    `free`: ranges no allocation holds (the caching allocator's free blocks), left out.
    Protected bytes are exact; unnamed ranges (what the fingerprints read as ranges) start
    on `align` bytes where they can: an unaligned head is its own small range."""
    spans = {id(t): storage_range(t) for t in tensors if t.nbytes}
    pool_of = {
        id(t): tag_of(s, e - s) for t in tensors if id(t) in spans for s, e in [spans[id(t)]]
    }
    named = ranges.Named.of((*spans[id(t)], t.name) for t in tensors if id(t) in spans)
    at_risk = frozenset(t.name for t in tensors if _lost(level, pool_of.get(id(t)), t))
    protect: list[PoolRecord] = []
    unnamed: list[PoolRecord] = []
    summary: dict[str, dict[str, int]] = {}
    for tag in sorted({r[2] for r in records}):
        recs = [(s, e) for s, e, t in records if t == tag]
        total = ranges.total(recs)
        row = {"records": len(recs), "bytes": total, "protected_bytes": 0, "unnamed_bytes": 0}
        row["discarded"] = int(policy(level, tag) == DISCARDED)
        if not row["discarded"]:
            row["restored_bytes"] = total  # offloaded whole: the mechanism brings it back
            summary[tag] = row
            continue
        mine = [t for t in tensors if pool_of.get(id(t)) == tag]
        back = [spans[id(t)] for t in mine if t.is_kv or restored_by(level, tag, t.kind)]
        if tag == GRAPHS:  # scratch every replay writes first: only what is held is kept
            back = ranges.subtract(recs, [spans[id(t)] for t in mine])
        kept = ranges.protect(recs, back)
        unused = ranges.total(kept)
        kept = ranges.protect(kept, free)
        gaps = ranges.subtract(kept, [spans[id(t)] for t in mine])
        row["free_bytes"] = unused - ranges.total(kept)
        row["restored_bytes"] = total - unused
        row["protected_bytes"] = ranges.total(kept)
        row["unnamed_bytes"] = ranges.total(gaps)
        protect.extend((s, e, tag) for s, e in kept)
        unnamed.extend((s, e, tag) for s, e in _split_heads(gaps, align))
        summary[tag] = row
    return Protection(level, protect, unnamed, named, summary, at_risk)


def _lost(level: int, pool: str | None, t: TensorRecord) -> bool:
    """ownership.judge's `at_risk` for one tensor in `pool` (None: it holds no bytes)."""
    if pool not in (WEIGHTS, KV_CACHE, GRAPHS) or t.is_kv:
        return False
    return policy(level, pool) == DISCARDED and not restored_by(level, pool, t.kind)


def _split_heads(gaps: list[tuple[int, int]], align: int) -> list[tuple[int, int]]:
    out = []
    for s, e in gaps:
        body = (s + align - 1) // align * align
        if s < body < e:
            out.append((s, body))
            out.append((body, e))
        else:
            out.append((s, e))
    return out
