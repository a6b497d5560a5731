"""One resume's copies back: each record mapped, then its bytes queued at once (coded: into
a staging slot and decoded into place), so that mapping overlaps the transfer; and the
side effects of vLLM's own wake_up that this path owes the runner."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from worker_ext import codec
from worker_ext.cudart import HostBuffer
from worker_ext.cudriver import Driver, Lent
from worker_ext.cumem.coded import CodedCopies
from worker_ext.cumem.records import size
from worker_ext.cumem.streams import CopyStreams
from worker_ext.pools import KV_CACHE, OFFLOADED, WEIGHTS


class Onload:
    """Maps records back and queues their copies; `start` is the CUDA event before the
    first copy, once one is queued."""

    def __init__(
        self,
        coded: CodedCopies,
        streams: CopyStreams,
        layout: dict[int, tuple[int, int, int]],
        weights_host: Callable[[], HostBuffer | None],
    ) -> None:
        self._coded = coded
        self._streams = streams
        self._layout = layout
        self._weights_host = weights_host
        self.start: Any = None
        self._k = 0  # the raw copies' round-robin position
        # ptr -> (host buffer address, offset, size) of every record copied back raw here
        self.raw_done: dict[int, tuple[int, int, int]] = {}
        self.wq: codec.WakeQueue | None = None

    def map_back(
        self, records: list[tuple[int, Any]], mode: str, driver: Driver, lent: Lent | None = None
    ) -> int:
        """Map every asleep record of one pool (`mode`: how it slept) and queue its copy
        back if it was offloaded; the bytes mapped. Each record's copies are queued as soon
        as it is mapped (mapping every record first and then copying measured slower:
        docs/benchmarks.md). `lent`: memory lent by a sleeping rank, imported in place of
        a create where a descriptor of the record's size is there (kvlend)."""
        mapped = 0
        for ptr, data in records:
            if not data.is_asleep:
                continue
            driver.create_and_map(data.handle, lent)
            data.is_asleep = False
            mapped += size(data)
            if mode == OFFLOADED:
                self._copy_back(ptr)
        return mapped

    def _copy_back(self, ptr: int) -> None:
        if self.start is None:
            self.start = self._streams.start()
        pieces = self._coded.pieces.pop(ptr, None)
        if pieces is not None:  # coded: H2D into a slot, decode into place
            if self.wq is None:
                host, plan = self._weights_host(), self._coded.plan
                assert host is not None
                assert plan is not None
                self.wq = self._coded.wake_queue(plan, host)
            for piece in pieces:
                self.wq.queue(piece)
            return
        base, off, n = self.raw_done[ptr] = self._layout.pop(ptr)
        self._k = self._streams.queue(ptr, base, off, n, False, self._k)


def vllm_side_effects(worker: Any, restored: dict[str, int], was_level: int | None) -> list[str]:
    """The side effects of vLLM 0.26's Worker.wake_up that this path skips, by feature.

    - V2 runner `post_kv_cache_wake_up` rebuilds the block-table pointer/size tensors
      whose storage lives in the kv_cache pool (undefined after a discard): called.
    - V1 runner `post_kv_cache_wake_up` (= init_fp8_kv_scales) only acts on a quantized
      KV cache, where it zeroes the discarded KV and resets calibrated k/v scales to 1.0,
      scales that level 1 restores and the snapshot protects: not called.
    - level 2: the draft model's fused KV metadata buffers are rebuilt, as vLLM does.
    """
    done: list[str] = []
    runner = getattr(worker, "model_runner", None)
    if KV_CACHE in restored and restored[KV_CACHE] and runner is not None:
        v1_fp8_reset = hasattr(runner, "init_fp8_kv_scales")
        if hasattr(runner, "post_kv_cache_wake_up") and not v1_fp8_reset:
            runner.post_kv_cache_wake_up()
            done.append("post_kv_cache_wake_up")
    if WEIGHTS in restored and restored[WEIGHTS] and was_level == 2:
        get_draft = getattr(worker, "get_draft_model", None)
        draft = get_draft() if callable(get_draft) else None
        inner = getattr(draft, "model", None) if draft is not None else None
        if inner is not None and hasattr(inner, "_build_fused_kv_buffers"):
            inner._build_fused_kv_buffers()
            done.append("draft._build_fused_kv_buffers")
    return done
