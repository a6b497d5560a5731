"""CUDA pool backend on vLLM's CuMemAllocator (engine started with --enable-sleep-mode).

Pools are the allocator's tags: every `pointer_to_data` record is one cuMem segment with
its tag (`weights` while the model loads, `kv_cache` while the KV cache is set up). The
backend releases and re-maps records itself, per record, because vLLM 0.26's
`CuMemAllocator.sleep` cannot release one tag alone and its `wake_up` does not check
`is_asleep`: it releases with vLLM's `unmap_and_release` and maps with the same driver calls
as vLLM's `create_and_map`, made through ctypes (worker_ext/cudriver.py,
HOTSWAP_MAP_IMPL=driver, the default): vLLM's call asks for fabric-exportable memory on
every record and, where the driver refuses (the lent H200s), asks again with a POSIX fd,
at 1-2 ms per record; cudriver asks once, gets the same memory, and times each call.
Each record's `is_asleep` is kept truthful. Do not mix this backend with vLLM's own /sleep
and /wake_up on one engine.

The fast path (why it is faster than vLLM's sleep/wake, which copy one record at a time
with a synchronous cudaMemcpy into a power-of-two rounded pinned tensor per record):

- one host buffer of exactly the weights' bytes (anonymous mmap, page-locked with
  cudaHostRegister in REGISTER_BYTES pieces), one slice per record, so host RAM held by
  a sleeping model is its weights and nothing more;
- the buffer is made ahead of time in a background thread (HOTSWAP_PIN_HOST_BACKUP=early,
  the default: when the backend is created) or at the first level-1 suspend (`lazy`);
- copies are cudaMemcpyAsync of at most CHUNK_BYTES on N_STREAMS streams, never crossing a
  registration; suspend unmaps each record as soon as its copies are done; resume maps
  each record and queues its copies at once, so mapping overlaps the transfer;
- resume returns with the copies ordered before any later work on the worker's current
  stream (no host wait); `synchronize()` waits for them, and every later backend call does
  so first: mapping KV during the weights copy slows the copy down (H200, 8B shape, vLLM's
  mapping call: wake 0.37-0.40 s waiting, 0.46 s with HOTSWAP_RESUME_KV=overlap);
- resume reports its steps in `timings` (map and queue per tag with the thread's CPU time
  and, with the driver map, the time in each driver call; the host wait for earlier
  copies, their GPU time from CUDA events, vLLM's side effects).

A level-1 sleep that keeps the KV cache (the prefix cache across a sleep, docs/contracts.md
§1.3) offloads the `kv_cache` pool the same way into a second pinned buffer of exactly the
KV pool's bytes, made in the background at the first prepare that asks for it.

Every suspend ends by giving torch's cached free blocks back (gc + empty_cache, as vLLM's
own sleep does): what stays on the device is reported by `resident()` (hotswap_info).

After a wake the host buffers are kept for the next sleep unless HOTSWAP_KEEP_HOST_BACKUP=0.
The backend also compiles and proves verify's Triton check when it is made (fpkernel.warm),
so that the first sleep's prepare does not pay the compile.
"""

from __future__ import annotations

import bisect
import gc as pygc  # `gc` names the codec in this module
import hashlib
import importlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from worker_ext import codec, disktier, fpkernel
from worker_ext import ranges as byteranges
from worker_ext.cudart import CHUNK_BYTES, REGISTER_BYTES, CudaRT, HostBuffer
from worker_ext.cudriver import Driver
from worker_ext.pools import (
    ALL_TAGS,
    DISCARDED,
    KV_CACHE,
    OFFLOADED,
    UNPOOLED,
    WEIGHTS,
    During,
    policy,
)
from worker_ext.rawmem import raw_bytes
from worker_ext.settings import WorkerSettings

log = logging.getLogger(__name__)

N_STREAMS = 2
_NVML: list[Any] = []  # the NVML module once initialised; [None] when there is none


def _meminfo(key: str) -> int | None:
    """A /proc/meminfo value in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _nvml_process_bytes(pid: int) -> int | None:
    """Device memory NVML counts for `pid`, over every device; None where NVML is missing
    or does not list the pid (another pid namespace)."""
    if not _NVML:
        try:
            try:
                pynvml: Any = importlib.import_module("pynvml")
            except ImportError:
                pynvml = importlib.import_module("vllm.third_party.pynvml")
            pynvml.nvmlInit()
            _NVML.append(pynvml)
        except Exception:
            _NVML.append(None)
    nvml = _NVML[0]
    if nvml is None:
        return None
    try:
        seen, total = False, 0
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            for p in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                if int(p.pid) == pid and p.usedGpuMemory is not None:
                    seen, total = True, total + int(p.usedGpuMemory)
        return total if seen else None
    except Exception:
        return None


# hotswap_sleep: the share of the weights' bytes whose copies are queued before the prepare
# starts (its protected copies queue behind only these; the rest follow them); the link
# moves it in about as long as the prepare's host work before those copies takes (8B, H200).
STAGE_SHARE = 0.3


def _cut(share: float, sizes: list[int]) -> int:
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


class CuMemBackend:
    """pools.PoolBackend over vLLM's CuMemAllocator records, with the fast copy path."""

    name = "cumem"
    in_place = True
    # suspend(..., during=) runs a prepare while the offload copies are on the link
    overlaps_prepare = True

    def __init__(self, worker: Any, settings: WorkerSettings | None = None) -> None:
        import torch
        from vllm.device_allocator.cumem import CuMemAllocator, unmap_and_release

        self._torch = torch
        self._worker = worker
        # read once (the environment when not given): docs in worker_ext/settings.py
        self.settings = settings if settings is not None else WorkerSettings.from_env()
        self._alloc = CuMemAllocator.get_instance()
        self._unmap_and_release = unmap_and_release
        device = getattr(worker, "device", None)
        self._device = device if device is not None else torch.device("cuda", 0)
        self.device = self._device
        self._cudart = CudaRT()
        self._streams: list[Any] = []
        self._suspended: dict[str, str] = {}
        self._level: int | None = None
        # ptr -> (host buffer address, offset, size) of every record offloaded now
        self._offloaded_layout: dict[int, tuple[int, int, int]] = {}
        self._index_key: tuple[int, int] = (-1, -1)
        self._starts: list[int] = []
        self._sizes: list[int] = []
        self._pending: list[Any] = []  # streams whose queued copies nobody has waited for
        self._dma_events: tuple[Any, list[Any]] | None = None  # (start, end per stream)
        self.last_dma_s: float | None = None  # GPU time of the last resume's copies
        self._release_host_after_pending = False
        self._host: HostBuffer | None = None
        self._host_lock = threading.Lock()
        self._host_thread: threading.Thread | None = None
        self._host_error: str | None = None
        self._host_pin_s: float | None = None
        # The KV pool's own pinned buffer, made at the first prepare that keeps the KV cache.
        self._kv_host: HostBuffer | None = None
        self._kv_thread: threading.Thread | None = None
        self._kv_error: str | None = None
        self._kv_pin_s: float | None = None
        self._other_at_start = self._non_torch_bytes()  # the estimate's context share
        self._kernel_warm: dict[str, Any] | None = None
        self._drivers: dict[bool, Driver] = {}  # by exportable (always: as vLLM asks)
        # HOTSWAP_HOST_CODEC=exp: the host copy coded on the GPU (worker_ext/codec.py)
        self._codec: codec.GpuCodec | None = None
        self._codec_warm: dict[str, Any] | None = None  # the kernels' proof, once made
        self._coded: dict[int, list[codec.Piece]] = {}  # ptr -> its pieces in the host copy
        self._codec_plan: codec.Plan | None = None
        # The plan a later coded sleep of the same records reuses (HOTSWAP_CODEC_PLAN_REUSE):
        # made ahead of time while awake (_host_need), then each coded sleep's own; kept on
        # the host (its rows and maps), checked against the bytes before it is trusted.
        self._plan_keep: codec.Plan | None = None
        self._check_stream: Any = None
        self._codec_scratch = False  # the codec's staging buffers are held
        self._codec_report: dict[str, Any] | None = None
        # benchmarks.wake sets codec_profile: timing events around every piece of a coded
        # wake, summed into describe()["codec"]["last_wake"] once its copies are waited for
        self.codec_profile = False
        self._wake_queue: codec.WakeQueue | None = None
        self._codec_wake: dict[str, Any] | None = None
        # HOTSWAP_DISK_DIR: the level-2 disk tier (worker_ext/disktier.py)
        self._tier_key: disktier.Key | None = None  # the weights a level-2 sleep put away
        self._tier_spans: list[tuple[int, int]] = []  # the bytes its key digests
        self._tier_writer: threading.Thread | None = None
        self._tier_cancel = threading.Event()  # asks the writer to stop (a bounded join)
        # what this engine wrote (file name -> its header's hash and digest): no other
        # file is accepted (docs/contracts.md §1.4)
        self._tier_records: dict[str, disktier.Record] = {}
        self._tier_report: dict[str, Any] = {}  # the last write and the last restore
        self._tier_sweep()
        self._tier_restored: dict[str, Any] | None = None
        self._get_codec()
        if self.settings.pin_early:
            self.warm_host(wait=False)
        # verify's Triton check compiled now, not inside the first sleep's prepare
        if self.settings.verify_kernel != "off":
            self._kernel_warm = fpkernel.warm(self._device)

    # -- reading the records -------------------------------------------------------------

    def _records(self) -> dict[int, Any]:
        return self._alloc.pointer_to_data  # type: ignore[no-any-return]

    def _tag_records(self, tag: str) -> list[tuple[int, Any]]:
        return sorted((p, d) for p, d in self._records().items() if d.tag == tag)

    def pools(self) -> dict[str, int]:
        out = dict.fromkeys(ALL_TAGS, 0)
        for data in self._records().values():
            out[data.tag] = out.get(data.tag, 0) + int(data.handle[1])
        return out

    def _rebuild_index(self) -> None:
        recs = self._records()
        self._starts = sorted(recs)
        self._sizes = [int(recs[p].handle[1]) for p in self._starts]
        self._index_key = (len(recs), sum(recs))

    def tag_of(self, data_ptr: int, nbytes: int) -> str:
        recs = self._records()
        if self._index_key != (len(recs), sum(recs)):
            self._rebuild_index()
        for attempt in range(2):
            i = bisect.bisect_right(self._starts, data_ptr) - 1
            if i >= 0:
                start, size = self._starts[i], self._sizes[i]
                rec = recs.get(start)
                if rec is not None and int(rec.handle[1]) == size:
                    if data_ptr + max(nbytes, 1) <= start + size:
                        return str(rec.tag)
                    return UNPOOLED
            if attempt == 0:
                self._rebuild_index()  # an entry went stale under the same key: look again
        return UNPOOLED

    def records(self) -> list[tuple[int, int, str]]:
        return sorted((p, p + int(d.handle[1]), str(d.tag)) for p, d in self._records().items())

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
        recs = self._records()
        out: list[tuple[int, int]] = []
        for seg in segments:
            base = int(seg.get("address", 0))
            if base not in recs:
                continue
            pos = base
            for block in seg.get("blocks", []):
                size = int(block.get("size", 0))
                pos = int(block.get("address", pos))
                state = block.get("state")
                if state == "inactive":
                    out.append((pos, pos + size))
                elif state == "active_allocated":
                    asked = int(block.get("requested_size", size))
                    if 0 <= asked < size:
                        out.append((pos + asked, pos + size))
                pos += size
        return out

    def suspended(self) -> dict[str, str]:
        return dict(self._suspended)

    def memory(self) -> dict[str, int]:
        free, total = self._torch.cuda.mem_get_info(self._device)
        return {"free": int(free), "total": int(total)}

    def refresh(self) -> None:
        """Nothing to re-read: the allocator's records are read at every call."""

    def after_reload(self) -> list[str]:
        return []

    def unready(self) -> list[str]:
        return []

    def tier_restored(self) -> dict[str, Any] | None:
        out, self._tier_restored = self._tier_restored, None
        return out

    def describe(self) -> dict[str, Any]:
        """Host-buffer state for hotswap_info (plain values)."""
        state = "none"
        if self._host_thread is not None and self._host_thread.is_alive():
            state = "pinning"
        elif self._host is not None:
            state = "ready"
        return {
            "kv_host_backup_bytes": self._kv_host.nbytes if self._kv_host is not None else 0,
            "kv_host_backup_pin_s": self._kv_pin_s,
            "kv_host_backup_error": self._kv_error,
            "host_backup_bytes": self._host.nbytes if self._host is not None else 0,
            "host_backup_state": state,
            "host_backup_pin_s": self._host_pin_s,
            "host_backup_error": self._host_error,
            "records": len(self._records()),
            "verify_kernel_warm": self._kernel_warm,
            "tier": self._tier_describe(),
            "codec": {
                "setting": self.settings.host_codec,
                "warm": self._codec_warm,
                "last_suspend": self._codec_report,
                "last_wake": self._codec_wake,
            },
            "map": {
                "impl": "driver",
                "drivers": {
                    d.handle_type: {"fabric_refused": d.fabric_refused, "rdma": d.rdma}
                    for d in self._drivers.values()
                },
            },
        }

    # -- the host buffer -----------------------------------------------------------------

    def _make_host(self, nbytes: int) -> None:
        try:
            self._cudart.set_device(self._device.index or 0)
            buf = HostBuffer(nbytes, self._cudart, self._device.index or 0)
            try:
                pin_s = buf.pin(self.settings.tuning.pin_threads)
            except Exception:
                buf.free()
                raise
            self._join_tier_writer()
            with self._host_lock:
                old, self._host = self._host, buf
                self._host_pin_s = pin_s
                self._host_error = None
            if old is not None:
                old.free()
        except Exception as exc:  # reported through describe(); suspend retries in the foreground
            self._host_error = f"{type(exc).__name__}: {exc}"
            log.warning("hotswap: pinning the host backup failed: %s", self._host_error)

    def warm_host(self, wait: bool = False) -> dict[str, Any]:
        """Start (or join) pinning a host buffer of exactly the weights' bytes, or of their
        coded size (planned now, on the device, when the codec is on and they are awake)."""
        need = self._host_need()
        with self._host_lock:
            have = self._host.nbytes if self._host is not None else 0
            running = self._host_thread is not None and self._host_thread.is_alive()
            if need > 0 and have < need and not running:
                self._host_thread = threading.Thread(
                    target=self._make_host, args=(need,), name="hotswap-pin", daemon=True
                )
                self._host_thread.start()
        if wait:
            self._join_host()
        return self.describe()

    def _host_need(self) -> int:
        need = self.pools().get(WEIGHTS, 0)
        gc = self._get_codec()
        recs = self._tag_records(WEIGHTS)
        if gc is None or not recs or any(d.is_asleep for _, d in recs):
            return need
        try:
            plan = gc.plan([(p, int(d.handle[1])) for p, d in recs])
            plan.keep_on_host()
            plan.meta = plan.inv = None  # the device's copies: a reuse makes its own
        except Exception as exc:  # the suspend plans again and reports
            log.warning("hotswap: planning the coded host copy failed: %s", exc)
            return need
        self._plan_keep = plan
        return plan.total

    def _get_codec(self) -> codec.GpuCodec | None:
        """The GPU codec when HOTSWAP_HOST_CODEC=exp and its kernels proved themselves here."""
        if self.settings.host_codec != "exp":
            return None
        if self._codec is None and self._codec_warm is None:
            chunks = self.settings.tuning.codec_piece_mib * (1 << 20) // (2 * codec.CHUNK_WORDS)
            self._codec, self._codec_warm = codec.warm(
                self._device, max(1, chunks), slots=self.settings.tuning.codec_slots
            )
            if self._codec is None:
                log.warning("hotswap: host codec off: %s", self._codec_warm.get("error"))
        return self._codec

    def _copier(self, host: int) -> Any:
        """The codec's copy between its staging and the host buffer at `host`, cut where
        the buffer's registrations meet (no copy spans two)."""
        memcpy = self._cudart.memcpy_async

        def copy(host_off: int, dev: int, n: int, to_host: bool, stream: int) -> None:
            pos = 0
            while pos < n:
                off = host_off + pos
                m = min(n - pos, (off // REGISTER_BYTES + 1) * REGISTER_BYTES - off)
                if to_host:
                    memcpy(host + off, dev + pos, m, stream)
                else:
                    memcpy(dev + pos, host + off, m, stream)
                pos += m

        return copy

    def _new_wake_queue(self) -> codec.WakeQueue:
        """The coded wake's queue: H2D on the first copy stream, decodes on the second."""
        assert self._codec is not None
        assert self._codec_plan is not None
        assert self._host is not None
        dec = self._get_streams()[1]
        wq = codec.WakeQueue(
            self._codec,
            self._codec_plan,
            self._copier(self._host.ptr),
            self._get_streams()[0],
            dec,
            profile=self.codec_profile,
        )
        self._codec_scratch = True
        self._wake_queue = wq if self.codec_profile else None
        return wq

    def _release_codec_scratch(self) -> float:
        """Give the codec's staging buffers back to the device (after every copy is done)."""
        if not self._codec_scratch or self._codec is None:
            return 0.0
        t = time.perf_counter()
        self._codec.release()
        self._torch.cuda.empty_cache()
        self._codec_scratch = False
        return time.perf_counter() - t

    def _suspend_coded(
        self,
        gc: codec.GpuCodec,
        plan: codec.Plan,
        offload: list[tuple[int, Any]],
        timings: dict[str, float],
        share: float = 1.0,
    ) -> tuple[list[tuple[int, Any, Any]], Callable[[], list[tuple[int, Any, Any]]]]:
        """Encode each piece into a staging slot and copy it to the host while the next
        encodes; (ptr, record, [event after its last encode]) per record queued now: the
        records holding the first `share` of the bytes; and the function that queues the
        rest (the same for them)."""
        t = time.perf_counter()
        host = self._host_for(plan.total)
        timings["host_wait_s"] = time.perf_counter() - t
        t = time.perf_counter()
        enc, dma = self._get_streams()[:2]
        current = self._torch.cuda.current_stream(self._device)
        enc.wait_stream(current)
        dma.wait_stream(current)
        self._codec_scratch = True
        q = codec.SleepQueue(gc, plan, self._copier(host.ptr), enc, dma)
        cut = _cut(share, [int(d.handle[1]) for _p, d in offload])

        def queue(pieces: list[codec.Piece]) -> list[tuple[int, Any, Any]]:
            t = time.perf_counter()
            last: dict[int, Any] = {}
            coded: dict[int, list[codec.Piece]] = {}
            for piece in pieces:
                last[piece.rng] = q.queue(piece)
                coded.setdefault(offload[piece.rng][0], []).append(piece)
            self._coded.update(coded)
            timings["queue_s"] = timings.get("queue_s", 0.0) + time.perf_counter() - t
            return [(p, d, [last[r]]) for r, (p, d) in enumerate(offload) if r in last]

        self._codec_plan = plan
        timings["queue_s"] = timings.get("queue_s", 0.0) + time.perf_counter() - t
        first = queue([p for p in plan.pieces if p.rng < cut])
        self._codec_report = {
            "raw_bytes": plan.raw_total,
            "coded_bytes": plan.total,
            "ratio": plan.ratio(),
            "chunks_by_k": {str(k): v for k, v in sorted(plan.by_k.items())},
            "pieces": len(plan.pieces),
            "scratch_bytes": gc.scratch_bytes(plan, slots=codec.SLEEP_SLOTS),
        }
        return first, lambda: queue([p for p in plan.pieces if p.rng >= cut])

    # -- the level-2 disk tier -------------------------------------------------------------

    def _tier_dir(self) -> Path | None:
        if not self.settings.disk_dir or self._get_codec() is None:
            return None
        return Path(self.settings.disk_dir)

    def _tier_describe(self) -> dict[str, Any]:
        directory = self._tier_dir()
        usage = None
        if directory is not None and directory.is_dir():
            usage = disktier.usage(directory)
        writing = self._tier_writer is not None and self._tier_writer.is_alive()
        return {
            "dir": self.settings.disk_dir or None,
            "budget_bytes": self.settings.disk_budget_bytes,
            "usage_bytes": usage,
            "writing": writing,
            # the file the next level-2 wake reads (its key: these weights' bytes), or None
            "pending": self._tier_key.filename() if self._tier_key is not None else None,
            "last": dict(self._tier_report),
        }

    def _tier_sweep(self) -> None:
        """At start: what a writer killed mid-write left (its temporary file) goes."""
        if self.settings.disk_dir:
            try:
                directory = Path(self.settings.disk_dir)
                disktier.ensure_dir(directory)
                self._tier_report["swept"] = disktier.sweep(directory)
            except Exception as exc:  # the tier is an optimisation: its writes report it
                log.warning("hotswap: disk tier not swept: %s", exc)

    def _join_tier_writer(self) -> None:
        writer = self._tier_writer
        if writer is not None and writer is not threading.current_thread():
            disktier.join_writer(writer, self._tier_cancel)

    def _keyed_spans(
        self, ranges: list[tuple[int, int]], rewritten: Sequence[tuple[int, int]]
    ) -> list[tuple[int, int]]:
        """The (start, end) spans of `ranges` (start, size) that the tier file alone brings
        back, the parameters, from word boundaries. Left out: the allocator's free blocks
        (no tensor holds them; a level-2 wake maps fresh memory under them) and
        `rewritten`, the bytes the snapshot writes back after the wake (buffers and other
        tensors, some of which serving changes: on the H200 a key over them differed
        between two sleeps of the same weights, so every level-2 sleep wrote a new file).
        What the file holds of those is overwritten, then verified. Taken at the sleep; the
        wake digests the same spans (the key's record sizes hold them in place)."""
        return byteranges.left_over(
            [(p, p + n) for p, n in ranges], [*self.free_ranges(), *rewritten], word=8
        )

    def _spans_digest(self, spans: list[tuple[int, int]]) -> str:
        """A digest of the bytes of `spans` on the device (verify's kernel sums, in order)."""
        sums = fpkernel.SpanCheck([(s, e - s) for s, e in spans], self._device).sums()
        return hashlib.sha256(json.dumps(sums).encode()).hexdigest()

    def _tier_key_for(self, ranges: list[tuple[int, int]], fingerprint: str) -> disktier.Key:
        config = getattr(self._worker, "model_config", None)
        model = str(getattr(config, "model", None) or type(self._worker).__name__)
        try:
            import vllm

            version = str(getattr(vllm, "__version__", "unknown"))
        except Exception:
            version = "unknown"
        rank = int(getattr(self._worker, "rank", 0) or 0)
        return disktier.Key(model, version, rank, tuple(n for _, n in ranges), fingerprint)

    def _tier_put_away(
        self,
        recs: list[tuple[int, Any]],
        timings: dict[str, float],
        rewritten: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Before a level-2 sleep discards the weights: the key of their bytes, and unless
        the tier holds that file already, their coded pieces on the host and a background
        thread that writes them (the sleep does not wait for the disk)."""
        self._tier_key = None
        directory = self._tier_dir()
        if directory is None or self._codec is None or not recs:
            return
        gc = self._codec
        t = time.perf_counter()
        try:
            ranges = [(p, int(d.handle[1])) for p, d in recs]
            spans = self._keyed_spans(ranges, rewritten)
            key = self._tier_key_for(ranges, self._spans_digest(spans))
            self._tier_key, self._tier_spans = key, spans
            try:
                disktier.read_header(
                    directory / key.filename(), key, self._tier_records.get(key.filename())
                )
                self._tier_report["write"] = {"written": False, "reason": "already on disk"}
                return
            except disktier.TierRefused:
                pass
            self._join_tier_writer()
            plan = gc.plan(ranges)
            host = self._host_for(plan.total)
            enc, dma = self._get_streams()[:2]
            current = self._torch.cuda.current_stream(self._device)
            enc.wait_stream(current)
            dma.wait_stream(current)
            self._codec_scratch = True
            q = codec.SleepQueue(gc, plan, self._copier(host.ptr), enc, dma)
            for piece in plan.pieces:
                q.queue(piece)
            dma.synchronize()
            self._release_codec_scratch()
            entries = [(p.rng, p.dev_off, p.raw_bytes, p.n_chunks, p.size) for p in plan.pieces]
            offs = [p.host_off for p in plan.pieces]
            view = raw_bytes(host.ptr, plan.total, self._torch.device("cpu"))
            budget = self.settings.disk_budget_bytes
            self._tier_cancel = cancel = threading.Event()

            def write() -> None:
                try:
                    done = disktier.write(
                        directory,
                        key,
                        entries,
                        lambda i: view[offs[i] : offs[i] + entries[i][4]],
                        key.fingerprint,
                        budget,
                        cancel,
                    )
                    record = disktier.Record(done.pop("header_sha256", ""), key.fingerprint)
                    if done.get("written"):
                        self._tier_records[key.filename()] = record
                except Exception as exc:  # reported in describe(); the next wake reloads
                    done = {"written": False, "reason": f"{type(exc).__name__}: {exc}"}
                self._tier_report["write"] = done
                if not done.get("written"):
                    log.warning("hotswap: disk tier not written: %s", done.get("reason"))

            self._tier_writer = threading.Thread(target=write, name="hotswap-tier", daemon=True)
            self._tier_writer.start()
        except Exception as exc:  # the tier is an optimisation: the wake reloads
            self._tier_report["write"] = {
                "written": False,
                "reason": f"{type(exc).__name__}: {exc}",
            }
            log.warning("hotswap: disk tier skipped: %s", self._tier_report["write"]["reason"])
        finally:
            timings["tier_put_away_s"] = time.perf_counter() - t

    def _tier_restore(self, timings: dict[str, float]) -> dict[str, Any]:
        """After a level-2 resume mapped the weights: their bytes from the tier file, checked
        and decoded into place, or why not (then the reload brings them back)."""
        key, self._tier_key = self._tier_key, None
        directory, gc = self._tier_dir(), self._codec
        t = time.perf_counter()
        report: dict[str, Any]
        try:
            if key is None or directory is None or gc is None:
                raise disktier.TierRefused("no tier file for these weights")
            if self._tier_writer is not None and self._tier_writer.is_alive():
                raise disktier.TierRefused("the tier file is still being written")
            ranges = [(p, int(d.handle[1])) for p, d in self._tag_records(WEIGHTS)]
            if tuple(n for _, n in ranges) != key.sizes:
                raise disktier.TierRefused("the weights records changed since the sleep")
            held: dict[str, HostBuffer] = {}

            def alloc(n: int) -> Any:
                held["host"] = self._host_for(n)
                return raw_bytes(held["host"].ptr, n, self._torch.device("cpu"))

            wq: list[codec.WakeQueue] = []  # made at the first piece read

            def queue(header: disktier.Header, i: int, _buf: Any) -> None:
                p = header.pieces[i]
                piece = codec.Piece(
                    p.record,
                    p.dev_off,
                    p.raw_bytes,
                    0,
                    p.n_chunks,
                    p.size,
                    p.file_off - header.payload_off,
                )
                if not wq:
                    plan = codec.Plan(
                        ranges, [], None, None, header.payload_bytes(), sum(key.sizes)
                    )
                    dma, dec = self._get_streams()[:2]
                    current = self._torch.cuda.current_stream(self._device)
                    for s in (dma, dec):
                        s.wait_stream(current)
                    self._codec_scratch = True
                    copy = self._copier(held["host"].ptr)
                    wq.append(codec.WakeQueue(gc, plan, copy, dma, dec, profile=self.codec_profile))
                wq[0].queue(piece)

            def drain() -> None:
                for s in self._all_streams():
                    s.synchronize()
                if wq:
                    self._codec_wake = wq[0].profile_summary()
                self._release_codec_scratch()

            try:
                report = disktier.restore(
                    directory,
                    key,
                    self._tier_records.get(key.filename()),
                    alloc,
                    queue,
                    drain,
                    lambda: self._spans_digest(self._tier_spans),
                    self.settings.tuning.disk_threads,
                )
            finally:  # refused midway: what was queued still reads the host buffer
                if wq:
                    for s in self._all_streams():
                        s.synchronize()
            report["used"] = True
        except Exception as exc:  # refused or failed: the reload brings the weights back
            reason = str(exc) if isinstance(exc, disktier.TierRefused) else repr(exc)
            report = {"used": False, "reason": reason}
            if key is not None and directory is not None and "being written" not in reason:
                path = directory / key.filename()  # refused: the next sleep writes it anew
                self._tier_records.pop(key.filename(), None)
                report["removed"] = path.exists()
                path.unlink(missing_ok=True)
            log.warning("hotswap: disk tier not used, reloading: %s", reason)
        self._release_codec_scratch()
        timings["tier_restore_s"] = time.perf_counter() - t
        self._tier_report["restore"] = report
        return report

    def _join_host(self) -> None:
        thread = self._host_thread
        if thread is not None:
            thread.join()

    def _host_for(self, nbytes: int) -> HostBuffer:
        self._join_host()
        self._join_tier_writer()  # the tier's writer reads the buffer until it is done
        if self._host is None or self._host.nbytes < nbytes:
            self._make_host(nbytes)  # foreground: the first sleep pays the pinning
        if self._host is None or self._host.nbytes < nbytes:
            raise RuntimeError(f"no host backup buffer: {self._host_error}")
        return self._host

    def host_backup_bytes(self) -> int:
        with self._host_lock:
            bufs = (self._host, self._kv_host)
            return sum(b.nbytes for b in bufs if b is not None)

    def drop_backup(self) -> dict[str, int]:
        """Awake: free the kept pinned buffers once the copies a resume queued are done (and
        a background pinning has ended); the next sleep pins anew, in the foreground."""
        if self._suspended or self._offloaded_layout or self._coded:
            raise RuntimeError(f"drop_backup: pools asleep: {sorted(self._suspended)}")
        self.synchronize()
        self._join_host()
        if self._kv_thread is not None:
            self._kv_thread.join()
        with self._host_lock:
            freed = {
                WEIGHTS: self._host.nbytes if self._host is not None else 0,
                KV_CACHE: self._kv_host.nbytes if self._kv_host is not None else 0,
            }
        self._release_host()
        return freed

    def demote_refusal(self) -> str | None:
        """Why this sleep cannot become level 2 (None: it can): the weights must be
        offloaded at level 1, and a kept KV cache must not be (its content and the engine's
        prefix cache would be out of step at level 2)."""
        if self._level != 1 or self._suspended.get(WEIGHTS) != OFFLOADED:
            return f"demote: the weights are not offloaded at level 1 ({self._suspended})"
        if self._suspended.get(KV_CACHE) == OFFLOADED:
            return "demote: the KV cache is kept (offloaded) across this sleep"
        return None

    def demote(self) -> dict[str, Any]:
        """A level-1 sleep becomes level 2: the weights' host copy (coded or raw) and the
        KV cache's kept pinned buffer are released, and the weights pool is marked
        discarded, so the next resume maps it without a copy and the reload (or nothing
        else) refills it. The caller holds the level-2 protection by range."""
        why = self.demote_refusal()
        if why:
            raise RuntimeError(why)
        self.synchronize()
        self._join_host()
        if self._kv_thread is not None:
            self._kv_thread.join()
        for ptr, _data in self._tag_records(WEIGHTS):
            self._coded.pop(ptr, None)
            self._offloaded_layout.pop(ptr, None)
        self._codec_plan = None
        self._tier_key = None  # no tier file for these weights: the wake reloads
        with self._host_lock:
            freed = {
                WEIGHTS: self._host.nbytes if self._host is not None else 0,
                KV_CACHE: self._kv_host.nbytes if self._kv_host is not None else 0,
            }
        self._release_host()
        self._suspended[WEIGHTS] = DISCARDED
        self._level = 2
        return {"freed_bytes": {WEIGHTS: freed[WEIGHTS]}, "freed_host_bytes": freed}

    def wake_scratch_bytes(self) -> int:
        """The codec's staging a wake decodes through: asleep with a coded host copy of the
        weights, or with their level-2 disk tier file's key."""
        gc = self._codec
        if gc is None or WEIGHTS not in self._suspended:
            return 0
        if self._coded or self._tier_key is not None:
            return int(gc.scratch_bytes())
        return 0

    def _release_host(self) -> None:
        self._join_tier_writer()
        with self._host_lock:
            buf, self._host = self._host, None
            kv, self._kv_host = self._kv_host, None
        for b in (buf, kv):
            if b is not None:
                b.free()

    # -- the KV pool's host buffer (a sleep that keeps the prefix cache) ----------------

    def _make_kv_host(self, nbytes: int) -> None:
        try:
            self._cudart.set_device(self._device.index or 0)
            buf = HostBuffer(nbytes, self._cudart, self._device.index or 0)
            try:
                pin_s = buf.pin(self.settings.tuning.pin_threads)
            except Exception:
                buf.free()
                raise
            with self._host_lock:
                old, self._kv_host = self._kv_host, buf
                self._kv_pin_s, self._kv_error = pin_s, None
            if old is not None:
                old.free()
        except Exception as exc:  # reported through describe(); suspend retries in the foreground
            self._kv_error = f"{type(exc).__name__}: {exc}"
            log.warning("hotswap: pinning the KV host buffer failed: %s", self._kv_error)

    def prepare_kv_keep(self) -> None:
        self.warm_kv_host()

    def warm_kv_host(self) -> None:
        """Start pinning a host buffer of exactly the KV pool's bytes (in the background:
        the prepare's fingerprints run meanwhile; the suspend waits for it)."""
        need = self.pools().get(KV_CACHE, 0)
        with self._host_lock:
            have = self._kv_host.nbytes if self._kv_host is not None else 0
            running = self._kv_thread is not None and self._kv_thread.is_alive()
            if need > 0 and have < need and not running:
                self._kv_thread = threading.Thread(
                    target=self._make_kv_host, args=(need,), name="hotswap-pin-kv", daemon=True
                )
                self._kv_thread.start()

    def _kv_host_for(self, nbytes: int) -> HostBuffer:
        thread = self._kv_thread
        if thread is not None:
            thread.join()
        if self._kv_host is None or self._kv_host.nbytes < nbytes:
            self._make_kv_host(nbytes)
        if self._kv_host is None or self._kv_host.nbytes < nbytes:
            raise RuntimeError(f"no host buffer for the KV cache: {self._kv_error}")
        return self._kv_host

    def kv_keep_refusal(self) -> str | None:
        """Host memory for the KV pool's pinned copy, unless a big enough buffer is there or
        on its way: MemAvailable less a margin (2 GiB or 5% of the machine)."""
        need = self.pools().get(KV_CACHE, 0)
        have = self._kv_host.nbytes if self._kv_host is not None else 0
        making = self._kv_thread is not None and self._kv_thread.is_alive()
        if have >= need or making:
            return None
        avail, total = _meminfo("MemAvailable"), _meminfo("MemTotal")
        if avail is None or total is None:
            return None  # no /proc/meminfo: the pinning itself will say if it cannot
        margin = max(2 << 30, total // 20)
        if need - have > avail - margin:
            return (
                f"host memory: need {need - have} bytes for the KV cache's copy, "
                f"MemAvailable {avail} (less a margin of {margin})"
            )
        return None

    # -- what a sleeper leaves on the device ---------------------------------------------

    def _segments(self) -> dict[str, int]:
        """torch's segments outside vLLM's pools, by kind, and the pools' mapped bytes."""
        recs = self._records()
        out = {"pools_mapped": 0, "torch_allocated": 0, "torch_cached": 0, "graph_pools": 0}
        for data in recs.values():
            if not data.is_asleep:
                out["pools_mapped"] += int(data.handle[1])
        try:
            segments = self._torch.cuda.memory_snapshot()
        except Exception:
            return out
        for seg in segments:
            if int(seg.get("address", 0)) in recs:
                continue
            total, used = int(seg.get("total_size", 0)), int(seg.get("allocated_size", 0))
            if tuple(seg.get("segment_pool_id") or (0, 0)) != (0, 0):
                out["graph_pools"] += total  # a graph replays into its free blocks too
            else:
                out["torch_allocated"] += used
                out["torch_cached"] += total - used
        return out

    def _non_torch_bytes(self) -> int:
        """The device's used bytes no allocator of this process accounts for now (the CUDA
        context, module images, communicators; other processes' too, on a shared device)."""
        try:
            mem = self.memory()
            seg = self._segments()
        except Exception:
            return 0
        return max(0, mem["total"] - mem["free"] - sum(seg.values()))

    def resident(self) -> dict[str, Any]:
        """What this process holds on its device now: NVML's per-process figure where NVML
        sees this pid, else the allocators' segments plus what no allocator accounted for
        when the backend was made (the context), with the parts beside it."""
        seg = self._segments()
        nvml = _nvml_process_bytes(os.getpid())
        mine = sum(seg.values())
        if nvml is not None:
            return {**seg, "bytes": nvml, "source": "nvml", "other": max(0, nvml - mine)}
        other = self._other_at_start
        return {**seg, "bytes": mine + other, "source": "estimate", "other": other}

    def trim(self) -> float:
        """Give torch's cached free blocks back to the driver (as vLLM's own sleep does):
        what verify's and the codec's scratch left cached. vLLM's pools are not released
        (their MemPools stay referenced). Returns the seconds it took."""
        t = time.perf_counter()
        pygc.collect()
        self._torch.cuda.empty_cache()
        return time.perf_counter() - t

    # -- copies --------------------------------------------------------------------------

    def _mapper(self) -> Driver:
        """The driver that maps records back (exportable memory, as vLLM asks), its
        per-call times reset."""
        driver = self._drivers.get(True)
        if driver is None:
            index = self._device.index
            device = self._torch.cuda.current_device() if index is None else index
            driver = self._drivers[True] = Driver(device, exportable=True)
        driver.take_spent()
        return driver

    def _start_copies(self) -> Any:
        """Order the copy streams after the worker's current stream; the start event."""
        torch = self._torch
        current = torch.cuda.current_stream(self._device)
        for s in self._all_streams():
            s.wait_stream(current)
        start = torch.cuda.Event(enable_timing=True)
        start.record(self._get_streams()[0])
        return start

    def _get_streams(self) -> list[Any]:
        if not self._streams:
            self._streams = [self._torch.cuda.Stream(self._device) for _ in range(N_STREAMS)]
        return self._streams

    def _all_streams(self) -> list[Any]:
        return self._get_streams()

    def _queue(self, dev: int, host: int, host_off: int, size: int, to_host: bool, k: int) -> int:
        """Queue one record's copies in CHUNK_BYTES pieces (cut at host-offset multiples, so
        no copy spans two registrations) round-robin over the streams; returns the next k."""
        streams = self._get_streams()
        pos = 0
        while pos < size:
            off = host_off + pos
            n = min(size - pos, (off // CHUNK_BYTES + 1) * CHUNK_BYTES - off)
            s = streams[k % len(streams)]
            if to_host:
                self._cudart.memcpy_async(host + off, dev + pos, n, s.cuda_stream)
            else:
                self._cudart.memcpy_async(dev + pos, host + off, n, s.cuda_stream)
            pos += n
            k += 1
        return k

    def synchronize(self) -> None:
        """Wait for copies a resume queued; release the host buffer if so configured."""
        for s in self._pending:
            s.synchronize()
        self._pending = []
        if self._dma_events is not None:  # first copy queued -> last copy done, on the GPU
            start, ends = self._dma_events
            self.last_dma_s = max(start.elapsed_time(e) for e in ends) / 1000.0
            self._dma_events = None
        if self._wake_queue is not None:  # its streams are done: the events can be read
            wq, self._wake_queue = self._wake_queue, None
            self._codec_wake = wq.profile_summary()
        if not self._coded:
            self._release_codec_scratch()
        if self._release_host_after_pending and not self._offloaded_layout and not self._coded:
            self._release_host()
        self._release_host_after_pending = False

    # -- suspend / resume ----------------------------------------------------------------

    def suspend(
        self,
        level: int,
        tags: list[str],
        keep_kv: bool = False,
        rewritten: Sequence[tuple[int, int]] = (),
        during: During | None = None,
    ) -> dict[str, Any]:
        """`during` (hotswap_sleep): called once the copies of the first STAGE_SHARE of the
        weights' bytes are queued and before anything is released, with the function that
        queues the rest (the prepare calls it once its protected copies are queued: they
        then wait behind the first copies only; called after it otherwise); its answer
        replaces `rewritten`. If it raises, every queued copy is waited for, nothing is
        released, and the error is raised again."""
        torch = self._torch
        if level not in (1, 2):
            raise ValueError(f"level must be 1 or 2, not {level!r}")
        tags = list(dict.fromkeys(tags))
        unknown = [t for t in tags if t not in ALL_TAGS]
        if unknown or not tags:
            raise ValueError(f"tags must be a non-empty subset of {list(ALL_TAGS)}: {tags}")
        asleep = [t for t in tags if t in self._suspended]
        if asleep:
            raise RuntimeError(f"already suspended: {asleep}")
        plan = {t: policy(level, t, keep_kv) for t in tags}
        recs = {t: self._tag_records(t) for t in tags}
        stray = [p for t in tags for p, d in recs[t] if d.is_asleep]
        if stray:
            raise RuntimeError(f"{len(stray)} records already asleep (vLLM's own sleep?)")

        t0 = time.perf_counter()
        self.synchronize()
        torch.cuda.synchronize(self._device)
        before = self.memory()["free"]
        timings: dict[str, float] = {}
        # Each offloaded pool has its own host buffer: the weights', the KV cache's.
        offload = {t: recs[t] for t in tags if plan[t] == OFFLOADED}
        events: list[tuple[int, Any, Any]] = []
        layout: dict[int, tuple[int, int, int]] = {}
        # The codec codes the weights' copy; a kept KV cache goes raw into its own buffer.
        weights_off = offload.get(WEIGHTS, [])
        gc = self._get_codec() if weights_off else None
        coded: codec.Plan | None = None
        stale: Any = None  # a reused plan's check: (pinned flag, event after it)
        how = "fresh"
        before_plan = self._codec_plan
        if gc is not None:
            t = time.perf_counter()
            ranges = [(p, int(d.handle[1])) for p, d in weights_off]
            try:
                coded, stale = self._reused_plan(gc, ranges)
                how = "reused" if coded is not None else how
                if coded is None:
                    coded = gc.plan(ranges)
            except Exception as exc:  # nothing queued yet: this sleep copies raw bytes
                log.warning("hotswap: host codec plan failed, raw copy: %s", exc)
                self._codec_report = {"error": f"{type(exc).__name__}: {exc}"}
                coded, stale = None, None
            timings["codec_plan_s"] = time.perf_counter() - t
        raw = dict(offload)
        share = STAGE_SHARE if during is not None else 1.0
        rest: list[Callable[[], list[tuple[int, Any, Any]]]] = []
        if gc is not None and coded is not None:
            events, more = self._suspend_coded(gc, coded, weights_off, timings, share)
            rest.append(more)
            del raw[WEIGHTS]
        if raw:
            t = time.perf_counter()
            hosts = {
                tag: (self._kv_host_for if tag == KV_CACHE else self._host_for)(
                    sum(int(d.handle[1]) for _, d in rs)
                )
                for tag, rs in raw.items()
            }
            timings["host_wait_s"] = timings.get("host_wait_s", 0.0) + time.perf_counter() - t
            t = time.perf_counter()
            current = torch.cuda.current_stream(self._device)
            for s in self._get_streams():
                s.wait_stream(current)
            pos = {"k": 0}  # the copies' round-robin position, across the two stages

            def queue_raw(items: list[tuple[str, int, Any, int]]) -> list[tuple[int, Any, Any]]:
                t = time.perf_counter()
                out = []
                for tag, ptr, data, off in items:
                    size, host = int(data.handle[1]), hosts[tag]
                    pos["k"] = self._queue(ptr, host.ptr, off, size, True, pos["k"])
                    layout[ptr] = (host.ptr, off, size)
                    out.append((ptr, data, [s.record_event() for s in self._get_streams()]))
                timings["queue_s"] = timings.get("queue_s", 0.0) + time.perf_counter() - t
                return out

            items: list[tuple[str, int, Any, int]] = []
            for tag, rs in raw.items():
                off = 0
                for ptr, data in rs:
                    items.append((tag, ptr, data, off))
                    off += int(data.handle[1])
            cut = _cut(share, [int(it[2].handle[1]) for it in items])
            events.extend(queue_raw(items[:cut]))
            rest.append(lambda: queue_raw(items[cut:]))
        overlapped = bool(events)
        queued_all = {"done": False}

        def go_on() -> None:
            """Queue the copies of the rest (once)."""
            if not queued_all["done"]:
                queued_all["done"] = True
                for fn in rest:
                    events.extend(fn())

        if during is not None:
            t = time.perf_counter()
            try:
                rewritten = during(go_on)
            except BaseException:
                self._abandon_copies(weights_off, before_plan)
                raise
            timings["prepare_under_copies_s"] = time.perf_counter() - t
        go_on()
        why = None
        if stale is not None and gc is not None and coded is not None:
            t = time.perf_counter()
            why = self._plan_refused(stale)
            timings["codec_check_s"] = time.perf_counter() - t
            if why is not None:  # nothing released yet: wait, then code it all again, fresh
                log.warning("hotswap: the reused codec plan does not fit (%s): planning anew", why)
                how = "stale"
                self._abandon_copies(weights_off, before_plan)
                t = time.perf_counter()
                coded = gc.plan([(p, int(d.handle[1])) for p, d in weights_off])
                timings["codec_replan_s"] = time.perf_counter() - t
                raw_events = [e for e in events if e[0] in layout]  # a kept KV cache's copies
                again, more = self._suspend_coded(gc, coded, weights_off, timings)
                events = [*again, *more(), *raw_events]
        if level == 2 and WEIGHTS in tags and plan[WEIGHTS] == DISCARDED:
            self._tier_put_away(recs[WEIGHTS], timings, rewritten)
        # Discarded pools need no copy: release them while the offload copies run.
        t = time.perf_counter()
        for tag in tags:
            if plan[tag] == DISCARDED:
                for _ptr, data in recs[tag]:
                    self._unmap_and_release(data.handle)
                    data.is_asleep = True
        timings["discard_s"] = time.perf_counter() - t
        if events:
            t = time.perf_counter()
            for _ptr, data, done in events:  # unmap each record as soon as it is copied
                for ev in done:
                    ev.synchronize()
                self._unmap_and_release(data.handle)
                data.is_asleep = True
            timings["copy_unmap_s"] = time.perf_counter() - t
        if coded is not None:
            t = time.perf_counter()
            self._get_streams()[1].synchronize()  # the last piece is on the host
            timings["codec_drain_s"] = time.perf_counter() - t
            if self._codec_plan is not None:  # decoding reads the pieces' own rows
                t = time.perf_counter()
                self._codec_plan.keep_on_host()  # the next sleep of these records reuses it
                self._plan_keep = self._codec_plan
                self._codec_plan.meta = self._codec_plan.inv = None
                timings["codec_keep_s"] = time.perf_counter() - t
            timings["codec_release_s"] = self._release_codec_scratch()
            if self._codec_report is not None:
                self._codec_report["timings"] = dict(timings)
                self._codec_report["plan"] = how
                self._codec_report["plan_check"] = why
        self._offloaded_layout.update(layout)
        self._suspended.update(plan)
        self._level = level
        timings["trim_s"] = self.trim()
        after = self.memory()["free"]
        freed = {t: sum(int(d.handle[1]) for _, d in recs[t]) for t in tags}
        offloaded = {t: freed[t] if plan[t] == OFFLOADED else 0 for t in tags}
        return {
            "freed_bytes": freed,
            "offloaded_bytes": offloaded,
            "memory_before": before,
            "memory_after": after,
            "backend_s": time.perf_counter() - t0,
            "timings": timings,
            "overlapped": overlapped and during is not None,
            "host_backup_bytes": self._host.nbytes if self._host is not None else 0,
            "kv_host_backup_bytes": self._kv_host.nbytes if self._kv_host is not None else 0,
        }

    def _reused_plan(
        self, gc: codec.GpuCodec, ranges: list[tuple[int, int]]
    ) -> tuple[codec.Plan | None, Any]:
        """The kept plan for exactly these ranges (HOTSWAP_CODEC_PLAN_REUSE), with its check
        queued on a stream of its own: (plan, (pinned flag, event)); (None, None) when there
        is none to reuse. The check reads the bytes beside the encodes (nothing writes them)."""
        keep = self._plan_keep
        if not self.settings.tuning.codec_plan_reuse or keep is None or keep.ranges != ranges:
            return None, None
        try:
            plan = gc.reuse(keep)
        except ValueError:
            return None, None
        torch = self._torch
        if self._check_stream is None:
            self._check_stream = torch.cuda.Stream(self._device)
        cs = self._check_stream
        cs.wait_stream(torch.cuda.current_stream(self._device))
        flag = torch.ones(1, dtype=torch.bool, pin_memory=True)  # stale until proven
        with torch.cuda.stream(cs):
            bad = gc.check(plan)
            flag.copy_(bad.view(1), non_blocking=True)
            done = cs.record_event()
        return plan, (flag, done, bad)

    @staticmethod
    def _plan_refused(stale: Any) -> str | None:
        """Why the reused plan must not be trusted (None: every chunk's escapes fit)."""
        flag, done, _bad = stale
        try:
            done.synchronize()
            if bool(flag[0]):
                return "a chunk's bytes have more escapes than the plan laid out"
        except Exception as exc:  # a check that did not run proves nothing
            return f"the check failed: {type(exc).__name__}: {exc}"
        return None

    def _abandon_copies(self, weights_off: list[tuple[int, Any]], plan: codec.Plan | None) -> None:
        """Every copy and encode queued so far waited for, this suspend's coded pieces
        forgotten and the codec's staging given back: nothing was released."""
        for st in self._all_streams():
            st.synchronize()
        for ptr, _data in weights_off:
            self._coded.pop(ptr, None)
        self._codec_plan = plan
        self._release_codec_scratch()

    def resume(self, tags: list[str]) -> dict[str, Any]:
        torch = self._torch
        want = list(dict.fromkeys(tags))
        unknown = [t for t in want if t not in ALL_TAGS]
        if unknown:
            raise ValueError(f"unknown tags {unknown}; expected a subset of {list(ALL_TAGS)}")
        t0 = time.perf_counter()
        # copies still in flight finish before more is mapped: mapping the KV pool record by
        # record during the weights' copy slowed the copy down (docs/benchmarks.md)
        timings: dict[str, float] = {}
        waited = bool(self._pending)
        t = time.perf_counter()
        self.synchronize()
        if waited:
            timings["wait_copies_s"] = time.perf_counter() - t
            if self.last_dma_s is not None:
                timings["copies_gpu_s"] = self.last_dma_s
        before = self.memory()["free"]
        restored = dict.fromkeys(want, 0)
        # Weights first: their copies start at once and the KV mapping overlaps them.
        ordered = sorted(want, key=lambda t: (t != WEIGHTS, t))
        was_level = self._level
        driver = self._mapper()
        start: Any = None  # CUDA event before the first copy, once one is queued
        k = 0
        wq: codec.WakeQueue | None = None
        for tag in ordered:
            mode = self._suspended.get(tag)
            if mode is None:
                continue
            t, cpu = time.perf_counter(), time.thread_time()
            # Each record's copies are queued as soon as it is mapped. (Mapping every
            # record first and then copying measured slower: docs/benchmarks.md.)
            for ptr, data in self._tag_records(tag):
                if not data.is_asleep:
                    continue
                driver.create_and_map(data.handle)
                data.is_asleep = False
                restored[tag] += int(data.handle[1])
                if mode == OFFLOADED:
                    if start is None:
                        start = self._start_copies()
                    pieces = self._coded.pop(ptr, None)
                    if pieces is not None:  # coded: H2D into a slot, decode into place
                        wq = wq if wq is not None else self._new_wake_queue()
                        for piece in pieces:
                            wq.queue(piece)
                        continue
                    base, off, size = self._offloaded_layout.pop(ptr)
                    k = self._queue(ptr, base, off, size, False, k)
            if wq is not None and self._codec is not None and tag == WEIGHTS:
                timings["codec_scratch_bytes"] = float(self._codec.scratch_bytes(slots=wq.n_slots))
            if tag == WEIGHTS and mode == DISCARDED and self._tier_key is not None:
                self._tier_restored = self._tier_restore(timings)
            timings[f"{tag}_s"] = time.perf_counter() - t
            # this thread's CPU time: far below the wall time means it waited (driver, GIL)
            timings[f"{tag}_cpu_s"] = time.thread_time() - cpu
            for step, spent in driver.take_spent().items():
                timings[f"{tag}_{step}_s"] = spent
            del self._suspended[tag]
        if start is not None:
            current = torch.cuda.current_stream(self._device)
            ends = []
            for s in self._all_streams():
                ends.append(s.record_event(torch.cuda.Event(enable_timing=True)))
                current.wait_stream(s)  # later work on this stream sees the bytes
            self._pending = self._all_streams()
            self._dma_events = (start, ends)
            if not self.settings.keep_host_backup:
                self._release_host_after_pending = True
                self.synchronize()  # the buffer goes back now, so wait for its copies
        t = time.perf_counter()
        side = self._after_resume(restored, was_level)
        timings["after_resume_s"] = time.perf_counter() - t
        if not self._suspended:
            self._level = None
        return {
            "restored_bytes": restored,
            "memory_before": before,
            "memory_after": self.memory()["free"],
            "backend_s": time.perf_counter() - t0,
            "timings": timings,
            "side_effects": side,
        }

    def _after_resume(self, restored: dict[str, int], was_level: int | None) -> list[str]:
        """The side effects of vLLM 0.26's Worker.wake_up that this path skips, by feature.

        - V2 runner `post_kv_cache_wake_up` rebuilds the block-table pointer/size tensors
          whose storage lives in the kv_cache pool (undefined after a discard): called.
        - V1 runner `post_kv_cache_wake_up` (= init_fp8_kv_scales) only acts on a quantized
          KV cache, where it zeroes the discarded KV and resets calibrated k/v scales to 1.0,
          scales that level 1 restores and the snapshot protects: not called.
        - level 2: the draft model's fused KV metadata buffers are rebuilt, as vLLM does.
        """
        done: list[str] = []
        runner = getattr(self._worker, "model_runner", None)
        if KV_CACHE in restored and restored[KV_CACHE] and runner is not None:
            v1_fp8_reset = hasattr(runner, "init_fp8_kv_scales")
            if hasattr(runner, "post_kv_cache_wake_up") and not v1_fp8_reset:
                runner.post_kv_cache_wake_up()
                done.append("post_kv_cache_wake_up")
        if WEIGHTS in restored and restored[WEIGHTS] and was_level == 2:
            get_draft = getattr(self._worker, "get_draft_model", None)
            draft = get_draft() if callable(get_draft) else None
            inner = getattr(draft, "model", None) if draft is not None else None
            if inner is not None and hasattr(inner, "_build_fused_kv_buffers"):
                inner._build_fused_kv_buffers()
                done.append("draft._build_fused_kv_buffers")
        return done
