"""The CUDA graphs' pool across a sleep (worker_ext.graphpool): released without a copy
whenever the KV cache is suspended, mapped back empty at the same addresses when it is
resumed, before anything runs; with HOTSWAP_GRAPH_POOL=poison filled with 0xFF bytes
first, so that a replay reading what the pool held before the sleep would show."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from worker_ext.cudriver import Driver
from worker_ext.cumem.records import Records, size
from worker_ext.pools import GRAPHS
from worker_ext.settings import WorkerSettings

POISON = 0xFF  # a bf16 or fp16 word of these bytes is a NaN


class GraphPart:
    """The graph pool's records for the backend's suspend and resume."""

    def __init__(
        self,
        records: Records,
        settings: Callable[[], WorkerSettings],
        fill: Callable[[int, int, int], None],
    ) -> None:
        """`fill(address, nbytes, value)`: set device bytes (the poison)."""
        self._records = records
        self._settings = settings
        self._fill = fill

    def release(self, release: Callable[[Any], None], timings: dict[str, float]) -> int:
        """Release every mapped record of the pool (no copy); the bytes released."""
        recs = [d for _p, d in self._records.of(GRAPHS) if not d.is_asleep]
        t = time.perf_counter()
        for data in recs:
            release(data)
        if recs:
            timings["cudagraph_release_s"] = time.perf_counter() - t
        return sum(size(d) for d in recs)

    def map_back(self, driver: Driver, timings: dict[str, float]) -> int:
        """Map every released record back at its address (fresh memory; poisoned when
        asked); the bytes mapped."""
        recs = [(p, d) for p, d in self._records.of(GRAPHS) if d.is_asleep]
        if not recs:
            return 0
        t = time.perf_counter()
        for _p, data in recs:
            driver.create_and_map(data.handle)
            data.is_asleep = False
        if self._settings().graph_pool == "poison":
            for p, data in recs:
                self._fill(p, size(data), POISON)
            timings["cudagraph_poisoned"] = 1.0
        timings["cudagraph_s"] = time.perf_counter() - t
        return sum(size(d) for _p, d in recs)
