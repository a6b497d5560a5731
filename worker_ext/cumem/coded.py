"""The coded copies: the weights' level-1 host copy coded on the GPU (worker_ext/codec.py),
encoded into staging slots before each piece's copy to the host and decoded into place
after each piece's copy back; the plan a later sleep of the same records reuses, proven
by a check over every chunk before it is trusted."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from worker_ext import codec
from worker_ext.cudart import HostBuffer
from worker_ext.cumem.streams import CopyStreams
from worker_ext.settings import WorkerSettings

log = logging.getLogger(__name__)

# (ptr, record, [events after its last copy]) of a record whose copies are queued
Queued = tuple[int, Any, Any]


def cut(share: float, sizes: list[int]) -> int:
    """How many of `sizes`, in order, hold the first `share` of their sum (at least one
    when there are any; all of them at a share of 1 or more)."""
    if share >= 1.0 or not sizes:
        return len(sizes)
    want, seen = share * sum(sizes), 0
    for i, n in enumerate(sizes):
        seen += n
        if seen >= want:
            return i + 1
    return len(sizes)


class CodedCopies:
    """The codec, its staging and the pieces each record's host copy is made of."""

    def __init__(
        self,
        torch: Any,
        device: Any,
        streams: CopyStreams,
        settings: Callable[[], WorkerSettings],
    ) -> None:
        self._torch = torch
        self._device = device
        self._streams = streams
        self._settings = settings
        self._gc: codec.GpuCodec | None = None
        self.warm: dict[str, Any] | None = None  # the kernels' proof, once made
        self.pieces: dict[int, list[codec.Piece]] = {}  # ptr -> its pieces in the host copy
        self.plan: codec.Plan | None = None
        # The plan a later coded sleep of the same records reuses (the tuning's
        # codec_plan_reuse): made ahead of time while awake (plan_ahead), then each coded
        # sleep's own; kept on the host (its rows and maps), checked before it is trusted.
        self._plan_keep: codec.Plan | None = None
        self._check_stream: Any = None
        self._scratch = False  # the codec's staging buffers are held
        self.report: dict[str, Any] | None = None
        # benchmarks.wake sets profile: timing events around every piece of a coded wake,
        # summed into describe()["last_wake"] once its copies are waited for
        self.profile = False
        self._wake_queue: codec.WakeQueue | None = None
        self.last_wake: dict[str, Any] | None = None

    def get_codec(self) -> codec.GpuCodec | None:
        """The GPU codec when the host codec is `exp` and its kernels proved themselves."""
        settings = self._settings()
        if settings.host_codec != "exp":
            return None
        if self._gc is None and self.warm is None:
            chunks = settings.tuning.codec_piece_mib * (1 << 20) // (2 * codec.CHUNK_WORDS)
            self._gc, self.warm = codec.warm(
                self._device, max(1, chunks), slots=settings.tuning.codec_slots
            )
            if self._gc is None:
                log.warning("hotswap: host codec off: %s", self.warm.get("error"))
        return self._gc

    @property
    def made(self) -> codec.GpuCodec | None:
        """The codec if it was made (whatever the setting says now)."""
        return self._gc

    def describe(self) -> dict[str, Any]:
        return {
            "setting": self._settings().host_codec,
            "warm": self.warm,
            "last_suspend": self.report,
            "last_wake": self.last_wake,
        }

    def plan_ahead(self, ranges: list[tuple[int, int]]) -> int | None:
        """Plan the coded copy of `ranges` now (awake), kept for the next sleep to reuse;
        its size, or None where there is no codec or the planning failed."""
        gc = self.get_codec()
        if gc is None:
            return None
        try:
            plan = gc.plan(ranges)
            plan.keep_on_host()
            plan.meta = plan.inv = None  # the device's copies: a reuse makes its own
        except Exception as exc:  # the suspend plans again and reports
            log.warning("hotswap: planning the coded host copy failed: %s", exc)
            return None
        self._plan_keep = plan
        return plan.total

    def sleep_queue(self, gc: codec.GpuCodec, plan: codec.Plan, host: HostBuffer) -> Any:
        """A sleep's queue: encodes on the first copy stream, copies on the second, both
        after the worker's current stream."""
        enc, dma = self._streams.all()[:2]
        self._scratch = True
        # ordered after the current stream by the queue, once its scratch is zeroed there
        after = self._streams.current()
        return codec.SleepQueue(gc, plan, self._streams.copier(host.ptr), enc, dma, after)

    def wake_queue(self, plan: codec.Plan, host: HostBuffer, track: bool = True) -> codec.WakeQueue:
        """A wake's queue: copies from the host on the first copy stream, decodes on the
        second; `track`: a profiled one is summed up by `waited()`."""
        assert self._gc is not None
        dma, dec = self._streams.all()[:2]
        wq = codec.WakeQueue(
            self._gc,
            plan,
            self._streams.copier(host.ptr),
            dma,
            dec,
            profile=self.profile,
            after=self._streams.current(),
        )
        self._scratch = True
        if track:
            self._wake_queue = wq if self.profile else None
        return wq

    def release_scratch(self) -> float:
        """Give the codec's staging buffers back to the device (after every copy is done)."""
        if not self._scratch or self._gc is None:
            return 0.0
        t = time.perf_counter()
        self._gc.release()
        self._torch.cuda.empty_cache()
        self._scratch = False
        return time.perf_counter() - t

    def queue_sleep(
        self,
        gc: codec.GpuCodec,
        plan: codec.Plan,
        offload: list[tuple[int, Any]],
        host_for: Callable[[int], HostBuffer],
        timings: dict[str, float],
        share: float = 1.0,
    ) -> tuple[list[Queued], Callable[[], list[Queued]]]:
        """Encode each piece into a staging slot and copy it to the host while the next
        encodes; (ptr, record, [event after its last encode]) per record queued now: the
        records holding the first `share` of the bytes; and the function that queues the
        rest (the same for them)."""
        t = time.perf_counter()
        host = host_for(plan.total)
        timings["host_wait_s"] = time.perf_counter() - t
        t = time.perf_counter()
        q = self.sleep_queue(gc, plan, host)
        first_n = cut(share, [int(d.handle[1]) for _p, d in offload])

        def queue(pieces: list[codec.Piece]) -> list[Queued]:
            t = time.perf_counter()
            last: dict[int, Any] = {}
            coded: dict[int, list[codec.Piece]] = {}
            for piece in pieces:
                last[piece.rng] = q.queue(piece)
                coded.setdefault(offload[piece.rng][0], []).append(piece)
            self.pieces.update(coded)
            timings["queue_s"] = timings.get("queue_s", 0.0) + time.perf_counter() - t
            return [(p, d, [last[r]]) for r, (p, d) in enumerate(offload) if r in last]

        self.plan = plan
        timings["queue_s"] = timings.get("queue_s", 0.0) + time.perf_counter() - t
        first = queue([p for p in plan.pieces if p.rng < first_n])
        self.report = {
            "raw_bytes": plan.raw_total,
            "coded_bytes": plan.total,
            "ratio": plan.ratio(),
            "chunks_by_k": {str(k): v for k, v in sorted(plan.by_k.items())},
            "pieces": len(plan.pieces),
            "scratch_bytes": gc.scratch_bytes(plan, slots=codec.SLEEP_SLOTS),
        }
        return first, lambda: queue([p for p in plan.pieces if p.rng >= first_n])

    def reused_plan(
        self, gc: codec.GpuCodec, ranges: list[tuple[int, int]]
    ) -> tuple[codec.Plan | None, Any]:
        """The kept plan for exactly these ranges (the tuning's codec_plan_reuse), with its
        check queued on a stream of its own: (plan, (pinned flag, event)); (None, None) when
        there is none to reuse. The check reads the bytes beside the encodes (nothing
        writes them)."""
        keep = self._plan_keep
        reuse = self._settings().tuning.codec_plan_reuse
        if not reuse or keep is None or keep.ranges != ranges:
            return None, None
        try:
            plan = gc.reuse(keep)
        except ValueError:
            return None, None
        torch = self._torch
        if self._check_stream is None:
            self._check_stream = torch.cuda.Stream(self._device)
        cs = self._check_stream
        cs.wait_stream(self._streams.current())
        flag = torch.ones(1, dtype=torch.bool, pin_memory=True)  # stale until proven
        with torch.cuda.stream(cs):
            bad = gc.check(plan)
            flag.copy_(bad.view(1), non_blocking=True)
            done = cs.record_event()
        return plan, (flag, done, bad)

    @staticmethod
    def plan_refused(stale: Any) -> str | None:
        """Why the reused plan must not be trusted (None: every chunk's escapes fit)."""
        flag, done, _bad = stale
        try:
            done.synchronize()
            if bool(flag[0]):
                return "a chunk's bytes have more escapes than the plan laid out"
        except Exception as exc:  # a check that did not run proves nothing
            return f"the check failed: {type(exc).__name__}: {exc}"
        return None

    def abandon(self, weights_off: list[tuple[int, Any]], plan: codec.Plan | None) -> None:
        """Every copy and encode queued so far waited for, this suspend's coded pieces
        forgotten and the codec's staging given back: nothing was released."""
        self._streams.synchronize()
        for ptr, _data in weights_off:
            self.pieces.pop(ptr, None)
        self.plan = plan
        self.release_scratch()

    def finish_sleep(self, timings: dict[str, float], how: str, why: str | None) -> None:
        """The last piece on the host: the plan kept for the next sleep of these records,
        the staging given back, the sleep's report completed."""
        t = time.perf_counter()
        self._streams.all()[1].synchronize()  # the last piece is on the host
        timings["codec_drain_s"] = time.perf_counter() - t
        if self.plan is not None:  # decoding reads the pieces' own rows
            t = time.perf_counter()
            self.plan.keep_on_host()  # the next sleep of these records reuses it
            self._plan_keep = self.plan
            self.plan.meta = self.plan.inv = None
            timings["codec_keep_s"] = time.perf_counter() - t
        timings["codec_release_s"] = self.release_scratch()
        if self.report is not None:
            self.report["timings"] = dict(timings)
            self.report["plan"] = how
            self.report["plan_check"] = why

    def forget(self, ptrs: list[int]) -> None:
        """The host copy of these records is gone (a demotion)."""
        for ptr in ptrs:
            self.pieces.pop(ptr, None)
        self.plan = None

    def waited(self) -> None:
        """Every copy is done: a profiled wake's events can be read, and with no coded copy
        left on the host the staging goes back."""
        if self._wake_queue is not None:
            wq, self._wake_queue = self._wake_queue, None
            self.last_wake = wq.profile_summary()
        if not self.pieces:
            self.release_scratch()
