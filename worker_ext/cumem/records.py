"""vLLM's CuMemAllocator records, read at every call: the pools, a tensor's pool by address,
and what no tensor holds inside them (from torch's allocator snapshot)."""

from __future__ import annotations

import bisect
import logging
from typing import Any

from worker_ext import graphpool
from worker_ext.pools import ALL_TAGS, GRAPHS, KV_CACHE, UNPOOLED

log = logging.getLogger(__name__)


def size(data: Any) -> int:
    """A record's bytes (its handle's aligned size)."""
    return int(data.handle[1])


def ranges(recs: list[tuple[int, Any]]) -> list[tuple[int, int]]:
    """(start, size) of each record."""
    return [(p, size(d)) for p, d in recs]


class Records:
    """The allocator's `pointer_to_data`: one cuMem segment per record, with its tag
    (`weights` while the model loads, `kv_cache` while the KV cache is set up) and its
    `is_asleep`, which the backend keeps truthful. The CUDA graphs' records (the segments
    of worker_ext.graphpool's pool) are the pool GRAPHS here; in vLLM's allocator they are
    tagged `kv_cache` when first seen, so vLLM's own sleep and wake treat them as the KV
    cache (discarded, mapped back with it)."""

    def __init__(self, alloc: Any, torch: Any) -> None:
        self._alloc = alloc
        self._torch = torch
        self._index_key: tuple[int, int] = (-1, -1)
        self._starts: list[int] = []
        self._sizes: list[int] = []
        self._graph_key: tuple[int, int] = (-1, -1)
        self._graphs: frozenset[int] = frozenset()

    def all(self) -> dict[int, Any]:
        return self._alloc.pointer_to_data  # type: ignore[no-any-return]

    def graphs(self, key: tuple[int, int] | None = None) -> frozenset[int]:
        """The addresses of the graph pool's records (read again when the records change:
        `key`, their count and address sum, when the caller has it), each tagged
        `kv_cache` in vLLM's allocator."""
        recs = self.all()
        key = (len(recs), sum(recs)) if key is None else key
        if key != self._graph_key:
            segs = graphpool.pool_segments(self._alloc) or frozenset()
            self._graphs = frozenset(p for p in segs if p in recs)
            self._graph_key = key
            for p in self._graphs:
                if recs[p].tag != KV_CACHE:
                    recs[p].tag = KV_CACHE
        return self._graphs

    def _tagged(self) -> list[tuple[int, Any, str]]:
        graphs = self.graphs()
        return [(p, d, GRAPHS if p in graphs else str(d.tag)) for p, d in self.all().items()]

    def of(self, tag: str) -> list[tuple[int, Any]]:
        """The records of `tag` (GRAPHS: the graph pool's), by address."""
        return sorted((p, d) for p, d, t in self._tagged() if t == tag)

    def pools(self) -> dict[str, int]:
        out = dict.fromkeys(ALL_TAGS, 0)
        for _p, data, tag in self._tagged():
            out[tag] = out.get(tag, 0) + size(data)
        return out

    def spans(self) -> list[tuple[int, int, str]]:
        """(start, end, tag) of every record, by address."""
        return sorted((p, p + size(d), t) for p, d, t in self._tagged())

    def _rebuild_index(self) -> None:
        recs = self.all()
        self._starts = sorted(recs)
        self._sizes = [size(recs[p]) for p in self._starts]
        self._index_key = (len(recs), sum(recs))

    def tag_of(self, data_ptr: int, nbytes: int) -> str:
        """The pool holding [data_ptr, data_ptr + nbytes), or UNPOOLED."""
        recs = self.all()
        key = (len(recs), sum(recs))
        graphs = self.graphs(key)
        if self._index_key != key:
            self._rebuild_index()
        for attempt in range(2):
            i = bisect.bisect_right(self._starts, data_ptr) - 1
            if i >= 0:
                start, n = self._starts[i], self._sizes[i]
                rec = recs.get(start)
                if rec is not None and size(rec) == n:
                    if data_ptr + max(nbytes, 1) <= start + n:
                        return GRAPHS if start in graphs else str(rec.tag)
                    return UNPOOLED
            if attempt == 0:
                self._rebuild_index()  # an entry went stale under the same key: look again
        return UNPOOLED

    def free_ranges(self) -> list[tuple[int, int]]:
        """What no tensor can hold inside the records, from torch's snapshot of its caching
        allocator (every pool): inactive blocks, and the end of an allocated block past the
        size it was asked for (a storage never reaches past its request; large blocks are
        handed out whole). Nothing when the snapshot cannot be read."""
        try:
            segments = self._torch.cuda.memory_snapshot()
        except Exception as exc:  # an older or newer torch: protect the free blocks too
            log.warning("hotswap: no allocator snapshot, free blocks protected: %s", exc)
            return []
        recs = self.all()
        out: list[tuple[int, int]] = []
        for seg in segments:
            base = int(seg.get("address", 0))
            if base not in recs:
                continue
            pos = base
            for block in seg.get("blocks", []):
                n = int(block.get("size", 0))
                pos = int(block.get("address", pos))
                state = block.get("state")
                if state == "inactive":
                    out.append((pos, pos + n))
                elif state == "active_allocated":
                    asked = int(block.get("requested_size", n))
                    if 0 <= asked < n:
                        out.append((pos + asked, pos + n))
                pos += n
        return out
