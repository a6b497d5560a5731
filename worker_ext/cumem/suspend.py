"""One suspend's copies to the host: the weights coded (or raw) into their buffer, a kept
KV cache raw into its own, queued in two stages when a prepare runs under them, and each
record released as soon as its own copies are done."""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Generic, TypeVar

from worker_ext import codec
from worker_ext.cudart import HostBuffer
from worker_ext.cudriver import Driver
from worker_ext.cumem.coded import CodedCopies, Queued, cut
from worker_ext.cumem.kvlend import Lending
from worker_ext.cumem.records import ranges, size
from worker_ext.cumem.streams import CopyStreams
from worker_ext.pools import DISCARDED, KV_CACHE, WEIGHTS

log = logging.getLogger(__name__)
T = TypeVar("T")


class Offload:
    """The copies of the pools a suspend offloads (`offload`: tag -> its records), queued
    in two stages: the records holding the first `share` of the bytes, then the rest."""

    def __init__(
        self,
        coded: CodedCopies,
        streams: CopyStreams,
        host_for: Callable[[str, int], HostBuffer],
        offload: dict[str, list[tuple[int, Any]]],
        timings: dict[str, float],
        share: float,
    ) -> None:
        self._coded = coded
        self._streams = streams
        self._host_for = host_for
        self._offload = offload
        self._timings = timings
        self._share = share
        self.events: list[Queued] = []
        # ptr -> (host buffer address, offset, size) of every record copied raw
        self.layout: dict[int, tuple[int, int, int]] = {}
        self._rest: list[Callable[[], list[Queued]]] = []
        self._queued_all = False
        # The codec codes the weights' copy; a kept KV cache goes raw into its own buffer.
        self._weights = offload.get(WEIGHTS, [])
        self._gc = coded.get_codec() if self._weights else None
        self.plan: codec.Plan | None = None
        self._stale: Any = None  # a reused plan's check: (pinned flag, event after it)
        self._how = "fresh"
        self._why: str | None = None
        self._plan_before = coded.plan

    def _plan_codec(self) -> None:
        """The reused plan (its check queued) or a fresh one; none if planning fails (this
        sleep then copies raw bytes: nothing is queued yet)."""
        gc = self._gc
        if gc is None:
            return
        t = time.perf_counter()
        spans = ranges(self._weights)
        try:
            self.plan, self._stale = self._coded.reused_plan(gc, spans)
            self._how = "reused" if self.plan is not None else self._how
            if self.plan is None:
                self.plan = gc.plan(spans)
        except Exception as exc:
            log.warning("hotswap: host codec plan failed, raw copy: %s", exc)
            self._coded.report = {"error": f"{type(exc).__name__}: {exc}"}
            self.plan, self._stale = None, None
        self._timings["codec_plan_s"] = time.perf_counter() - t

    def queue_first(self) -> bool:
        """Queue the first stage's copies; whether any are on their way."""
        self._plan_codec()
        raw = dict(self._offload)
        if self._gc is not None and self.plan is not None:
            first, more = self._coded.queue_sleep(
                self._gc, self.plan, self._weights, self._weights_host, self._timings, self._share
            )
            self.events.extend(first)
            self._rest.append(more)
            del raw[WEIGHTS]
        if raw:
            self._queue_raw(raw)
        return bool(self.events)

    def _weights_host(self, nbytes: int) -> HostBuffer:
        return self._host_for(WEIGHTS, nbytes)

    def _queue_raw(self, raw: dict[str, list[tuple[int, Any]]]) -> None:
        """The raw copies: each pool into its own buffer, record after record."""
        timings = self._timings
        t = time.perf_counter()
        hosts = {tag: self._host_for(tag, sum(size(d) for _, d in rs)) for tag, rs in raw.items()}
        timings["host_wait_s"] = timings.get("host_wait_s", 0.0) + time.perf_counter() - t
        streams = self._streams.all()
        self._streams.after_current(streams)
        pos = {"k": 0}  # the copies' round-robin position, across the two stages

        def queue_raw(items: list[tuple[str, int, Any, int]]) -> list[Queued]:
            t = time.perf_counter()
            out = []
            for tag, ptr, data, off in items:
                n, host = size(data), hosts[tag]
                pos["k"] = self._streams.queue(ptr, host.ptr, off, n, True, pos["k"])
                self.layout[ptr] = (host.ptr, off, n)
                out.append((ptr, data, [s.record_event() for s in streams]))
            timings["queue_s"] = timings.get("queue_s", 0.0) + time.perf_counter() - t
            return out

        items: list[tuple[str, int, Any, int]] = []
        for tag, rs in raw.items():
            off = 0
            for ptr, data in rs:
                items.append((tag, ptr, data, off))
                off += size(data)
        first_n = cut(self._share, [size(it[2]) for it in items])
        self.events.extend(queue_raw(items[:first_n]))
        self._rest.append(lambda: queue_raw(items[first_n:]))

    def go_on(self) -> None:
        """Queue the copies of the rest (once)."""
        if not self._queued_all:
            self._queued_all = True
            for fn in self._rest:
                self.events.extend(fn())

    def abandon(self) -> None:
        """Wait for everything queued and forget this suspend's coded pieces: nothing was
        released."""
        self._coded.abandon(self._weights, self._plan_before)

    def check_reused_plan(self) -> None:
        """Before anything is released: a reused plan proven by its check, else every copy
        waited for and the weights coded again with a fresh plan."""
        gc, stale = self._gc, self._stale
        if stale is None or gc is None or self.plan is None:
            return
        t = time.perf_counter()
        self._why = self._coded.plan_refused(stale)
        self._timings["codec_check_s"] = time.perf_counter() - t
        if self._why is None:
            return
        log.warning("hotswap: the reused codec plan does not fit (%s): planning anew", self._why)
        self._how = "stale"
        self.abandon()
        t = time.perf_counter()
        self.plan = gc.plan(ranges(self._weights))
        self._timings["codec_replan_s"] = time.perf_counter() - t
        kept_kv = [e for e in self.events if e[0] in self.layout]  # a kept KV cache's copies
        again, more = self._coded.queue_sleep(
            gc, self.plan, self._weights, self._weights_host, self._timings
        )
        self.events = [*again, *more(), *kept_kv]

    def release_copied(self, release: Callable[[Any], None]) -> None:
        """Release each record as soon as its own copies are done."""
        if not self.events:
            return
        t = time.perf_counter()
        waited = 0.0
        for _ptr, data, done in self.events:
            w = time.perf_counter()
            for ev in done:
                ev.synchronize()
            waited += time.perf_counter() - w
            release(data)
        self._timings["copy_unmap_s"] = time.perf_counter() - t
        self._timings["copy_wait_s"] = waited

    def finish(self) -> None:
        """The coded copy's last piece on the host, its plan kept, its report completed."""
        if self.plan is not None:
            self._coded.finish_sleep(self._timings, self._how, self._why)


def release_early(
    ptrs: Sequence[int],
    recs: dict[str, list[tuple[int, Any]]],
    plan: dict[str, str],
    lending: Lending,
    timings: dict[str, float],
    t0: float,
    how: Callable[[Any], None] | None = None,
) -> list[tuple[int, Any]]:
    """The KV cache first (docs/contracts.md §1): release the KV records at `ptrs` (the
    extension names those holding nothing its prepare protects) where this suspend
    discards the KV pool, before the prepare, each lent to a rank waking on this device
    where one listens (`lending`: kvlend), by `how` (None: the backend's release); the
    records released, timed."""
    if not ptrs or plan.get(KV_CACHE) != DISCARDED:
        return []
    want = set(ptrs)
    early = [(p, d) for p, d in recs.get(KV_CACHE, []) if p in want and not d.is_asleep]
    if early:
        t = time.perf_counter()
        release = lending.lender(how)
        for _ptr, data in early:
            release(data)
        release.send(timings)
        timings["kv_early_s"] = time.perf_counter() - t
        timings["at_kv_early_s"] = time.perf_counter() - t0
        timings["kv_early_bytes"] = float(sum(size(d) for _, d in early))
        timings["kv_early_records"] = float(len(early))
    return early


class _Unbound(RuntimeError):
    """A release thread could not bind the device's context: it released nothing."""


class Beside(Generic[T]):
    """`run` now, or on a thread of its own (`threaded`: the tuning's kv_thread) whose
    driver calls drop the GIL, so the work of the suspend's thread (the copies' queueing,
    the prepare, the weights' releases) goes on beside it; `join` waits for it and raises
    its error again (the rank is failed), but runs `instead` there where the thread could
    not bind the device's context (it released nothing)."""

    def __init__(
        self, run: Callable[[], T], threaded: bool, instead: Callable[[], T] | None = None
    ) -> None:
        self._run = run
        self._instead = instead
        self._out: T | None = None
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        if threaded:
            self._thread = threading.Thread(target=self._body, name="hotswap-release")
            self._thread.start()
        else:
            self._out = run()

    def _body(self) -> None:
        try:
            self._out = self._run()
        except BaseException as e:  # raised again by join, on the suspend's thread
            self._error = e

    def join(self, timings: dict[str, float], waited: str) -> T:
        """Its answer, once it is done (the time waited for it in `timings[waited]`)."""
        thread, self._thread = self._thread, None
        if thread is not None:
            t = time.perf_counter()
            thread.join()
            timings[waited] = time.perf_counter() - t
        if self._error is not None:
            error, self._error = self._error, None
            if isinstance(error, _Unbound) and self._instead is not None:
                log.warning("hotswap: %s: released on the sleep's thread instead", error)
                timings["release_thread_unbound"] = 1.0
                return self._instead()
            raise error
        return self._out  # type: ignore[return-value]


class Unlocked:
    """A record's release through `driver` (cuMemUnmap, cuMemRelease), each call dropping
    the GIL where vLLM's release holds it, for the KV cache's releases on threads of their
    own (the tuning's kv_thread); `run` starts one, the device's context bound there."""

    def __init__(self, driver: Driver) -> None:
        self._driver = driver

    def __call__(self, data: Any) -> None:
        self._driver.unmap_release(data.handle)
        self._driver.forget(int(data.handle[2]))
        data.is_asleep = True

    def run(self, fn: Callable[[], T], instead: Callable[[], T]) -> Beside[T]:
        """`fn` on a thread, or `instead` at the join if that thread cannot bind the
        device's context (before any export or release)."""

        def body() -> T:
            try:
                self._driver.bind_context()
            except Exception as e:
                raise _Unbound(f"no device context on the release thread: {e}") from e
            return fn()

        return Beside(body, threaded=True, instead=instead)


class FreeLater:
    """A record's release whose memory an exported descriptor keeps alive (the tuning's
    free_later, for the KV and graph pools' records): the record is unmapped and its
    handle released at once (cheap: the driver frees nothing yet), and the descriptor is
    closed on a thread of its own, where the driver frees the memory, beside the suspend's
    thread; `join` waits until every one is closed (the memory free). A record whose
    handle cannot be exported is released as usual (its memory freed there)."""

    def __init__(
        self, export: Callable[[Any], tuple[int, int]], release: Callable[[Any], None]
    ) -> None:
        self._export = export
        self._release = release
        self._fds: queue.SimpleQueue[int | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._count = 0
        self._close_s = 0.0
        self.failed = 0  # records released as usual (not exportable)

    def __call__(self, data: Any) -> None:
        fd = None
        try:
            fd, _n = self._export(data.handle)
        except Exception:
            self.failed += 1
        try:
            self._release(data)
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        if fd is not None:
            self._count += 1
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._closer, name="hotswap-free", daemon=True
                )
                self._thread.start()
            self._fds.put(fd)

    def _closer(self) -> None:
        while (fd := self._fds.get()) is not None:
            t = time.perf_counter()
            with contextlib.suppress(OSError):
                os.close(fd)
            self._close_s += time.perf_counter() - t

    def join(self, timings: dict[str, float]) -> None:
        """Once every descriptor so far is closed (their memory free); timed."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        t = time.perf_counter()
        self._fds.put(None)
        thread.join()
        timings["free_later_wait_s"] = timings.get("free_later_wait_s", 0.0) + (
            time.perf_counter() - t
        )
        timings["free_later_close_s"] = self._close_s
        timings["free_later_records"] = float(self._count)
        if self.failed:
            timings["free_later_not_exported"] = float(self.failed)


def map_again(early: list[tuple[int, Any]], mapper: Callable[[], Driver]) -> None:
    """Map back the records a sleep whose prepare failed released early (fresh memory:
    nothing in them is verified); a driver error is raised (the rank is failed)."""
    if not early:
        return
    driver = mapper()
    for _ptr, data in early:
        if data.is_asleep:
            driver.create_and_map(data.handle)
            data.is_asleep = False
