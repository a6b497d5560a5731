"""What this process holds on its device (NVML's figure, else the allocators' segments and
the context measured at start) and the device's free memory."""

from __future__ import annotations

import gc as pygc
import importlib
import os
import time
from typing import Any, Protocol

from worker_ext.cumem.records import Records, size

_NVML: list[Any] = []  # the NVML module once initialised; [None] when there is none


def nvml_process_bytes(pid: int) -> int | None:
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


LAYOUT_TOP = 12  # the default pool's segments with free bytes `resident.layout` lists
LIVE_TOP = 8  # the live blocks' sizes `resident.layout` lists per pool, the most bytes first


def _live(block: dict[str, Any]) -> bool:
    return str(block.get("state", "")).startswith("active")


def _count_live(into: dict[int, int], seg: dict[str, Any]) -> None:
    """Count the segment's live blocks by the size asked for (torch's `requested_size`)."""
    for b in seg.get("blocks", []):
        if _live(b):
            n = int(b.get("requested_size", b.get("size", 0)))
            into[n] = into.get(n, 0) + 1


def _top_live(sizes: dict[int, int]) -> list[list[int]]:
    """[size asked for, blocks] rows, the most bytes first, at most LIVE_TOP."""
    rows = sorted(sizes.items(), key=lambda kv: (-kv[0] * kv[1], -kv[0]))
    return [[n, k] for n, k in rows[:LIVE_TOP]]


_STACK_SIZE = 0  # cudaLimitStackSize
# The per-thread stack a sleeper's context keeps (its local-memory reserve is this times
# every thread the device can hold); a kernel that needs more grows it again at its launch.
ASLEEP_STACK_BYTES = 16


class Limits(Protocol):
    """cudaDeviceGetLimit / cudaDeviceSetLimit (worker_ext.cudart.CudaRT)."""

    def get_limit(self, limit: int) -> int: ...

    def set_limit(self, limit: int, value: int) -> None: ...


class Residency:
    """The device's memory as this process sees it."""

    def __init__(
        self,
        torch: Any,
        device: Any,
        records: Records,
        limits: Limits | None = None,
    ) -> None:
        """`limits`: the runtime's limit calls (the stack's shrink asleep; none: no shrink)."""
        self._torch = torch
        self._device = device
        self._records = records
        self._limits = limits
        self._stack_awake: int | None = None  # the stack size a shrink took down, to restore
        self.stack: dict[str, Any] = {}  # the last shrink's ("sleep") and restore's ("wake")
        self._other_at_start = self._non_torch_bytes()  # the estimate's context share

    def memory(self) -> dict[str, int]:
        free, total = self._torch.cuda.mem_get_info(self._device)
        return {"free": int(free), "total": int(total)}

    def segments(self) -> dict[str, int]:
        """torch's segments outside vLLM's pools, by kind, and the pools' mapped bytes (a
        CuMem graph pool's among the graph pools)."""
        return self._scan()[0]

    def _scan(self, top: int = LAYOUT_TOP) -> tuple[dict[str, int], dict[str, Any]]:
        """`segments`, and where torch's segments outside the pools are (`layout`): per
        private pool (by its id) the segments, their bytes and the bytes in use; the default
        pool's segments that hold free bytes, the `top` most free first: each one's total,
        in use, live blocks and largest live block (free bytes in a segment that also holds
        a live block are what `empty_cache` cannot give back); and per pool (the default's
        and each private one's) its live blocks by the size they were asked for, the most
        bytes first (LIVE_TOP rows of [size, blocks]: a tensor's size says what it is)."""
        recs = self._records.all()
        graphs = self._records.graphs()  # a CuMem graph pool (worker_ext.graphpool)
        out = {"pools_mapped": 0, "torch_allocated": 0, "torch_cached": 0, "graph_pools": 0}
        for ptr, data in recs.items():
            if not data.is_asleep:
                out["graph_pools" if ptr in graphs else "pools_mapped"] += size(data)
        try:
            segments = self._torch.cuda.memory_snapshot()
        except Exception:
            return out, {}
        private: dict[str, list[int]] = {}
        split: list[list[int]] = []
        # the live blocks by the size asked for: what holds the bytes (a tensor's size names it)
        by_size: dict[str, dict[int, int]] = {}
        for seg in segments:
            if int(seg.get("address", 0)) in recs:
                continue
            total, used = int(seg.get("total_size", 0)), int(seg.get("allocated_size", 0))
            pool = tuple(seg.get("segment_pool_id") or (0, 0))
            _count_live(by_size.setdefault(f"{pool[0]},{pool[1]}", {}), seg)
            if pool != (0, 0):
                out["graph_pools"] += total  # a graph replays into its free blocks too
                row = private.setdefault(f"{pool[0]},{pool[1]}", [0, 0, 0])
                row[0], row[1], row[2] = row[0] + 1, row[1] + total, row[2] + used
                continue
            out["torch_allocated"] += used
            out["torch_cached"] += total - used
            live = [int(b.get("size", 0)) for b in seg.get("blocks", []) if _live(b)]
            if total > used:
                split.append([total, used, len(live), max(live, default=0)])
        split.sort(key=lambda r: r[1] - r[0])
        default_live = by_size.pop("0,0", {})
        layout = {
            "private_pools": private,  # id: [segments, bytes, in use]
            "default_free": split[:top],  # [total, in use, live blocks, largest live]
            "default_free_segments": len(split),
            "default_live": _top_live(default_live),  # [size asked for, blocks]
            "private_live": {k: _top_live(v) for k, v in by_size.items()},
        }
        return out, layout

    def _non_torch_bytes(self) -> int:
        """The device's used bytes no allocator of this process accounts for now (the CUDA
        context, module images, communicators; other processes' too, on a shared device)."""
        try:
            mem = self.memory()
            seg = self.segments()
        except Exception:
            return 0
        return max(0, mem["total"] - mem["free"] - sum(seg.values()))

    def resident(self, lent: int = 0) -> dict[str, Any]:
        """What this process holds on its device now: NVML's per-process figure where NVML
        sees this pid, else the allocators' segments plus what no allocator accounted for
        when the backend was made (the context), with the parts beside it. `lent`: the
        bytes this process ever lent to another (cumem.kvlend), which NVML may still count
        as its own while the borrower maps them: taken out of NVML's figure, never below
        that estimate (nor above NVML's)."""
        seg, layout = self._scan()
        nvml = nvml_process_bytes(os.getpid())
        mine = sum(seg.values())
        stack = {"stack": dict(self.stack), "layout": layout}
        other = self._other_at_start
        if nvml is not None:
            own = min(nvml, max(nvml - lent, mine + other)) if lent else nvml
            out = {**seg, "bytes": own, "source": "nvml", "other": max(0, own - mine), **stack}
            return {**out, "nvml_bytes": nvml, "lent_bytes": lent} if lent else out
        return {**seg, "bytes": mine + other, "source": "estimate", "other": other, **stack}

    def trim(self) -> float:
        """Give torch's cached free blocks back to the driver (as vLLM's own sleep does):
        what verify's and the codec's scratch left cached; then the stack's shrink where it
        can be (`shrink_stack`). vLLM's pools are not released (their MemPools stay
        referenced). Not torch's cuBLAS workspaces: vLLM's warm-up runs eager on the
        capture stream before each capture, so a graph may replay into the workspace that
        stream's key holds. Returns the seconds it took."""
        t = time.perf_counter()
        pygc.collect()
        self._torch.cuda.empty_cache()
        self.shrink_stack()
        return time.perf_counter() - t

    def release_cached(self) -> float:
        """torch's cached free blocks back to the driver again at the end of a suspend's
        RPC: the suspend's `trim` runs while its own scratch (the codec's encode buffers,
        the prepare's) is still held, and what that scratch frees after it stays cached
        (whole free segments a sleeper would keep and a checkpoint copy); no gc, no stack
        change. Returns the seconds it took."""
        t = time.perf_counter()
        self._torch.cuda.empty_cache()
        return time.perf_counter() - t

    def shrink_stack(self) -> dict[str, Any]:
        """Asleep: the context's per-thread stack down to ASLEEP_STACK_BYTES, so its
        local-memory reserve (the stack times every thread the device holds: hundreds of
        MiB) goes back to the driver: a sleeper holds less and a process checkpoint does not
        copy it. Never raises: {`from`, `to`, `s`} or {`error`}; {} without the runtime's
        calls."""
        if self._limits is None:
            return {}
        t = time.perf_counter()
        try:
            now = self._limits.get_limit(_STACK_SIZE)
            if now > ASLEEP_STACK_BYTES:
                self._limits.set_limit(_STACK_SIZE, ASLEEP_STACK_BYTES)
                if self._stack_awake is None:
                    self._stack_awake = now
            out: dict[str, Any] = {
                "from": now,
                "to": ASLEEP_STACK_BYTES,
                "s": time.perf_counter() - t,
            }
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        self.stack["sleep"] = out
        return out

    def restore_stack(self, timings: dict[str, float] | None = None) -> dict[str, Any]:
        """Awake again: the stack size a shrink took down, before any kernel of the wake
        (a kernel would grow it anyway; a graph's replay is not left to that); its seconds
        in `timings` as `stack_restore_s`. Never raises: {`to`, `s`} or {`error`} (the
        stack is then grown as kernels need it); {} when nothing was shrunk."""
        if self._limits is None or self._stack_awake is None:
            return {}
        t = time.perf_counter()
        want, self._stack_awake = self._stack_awake, None
        try:
            self._limits.set_limit(_STACK_SIZE, want)
            out: dict[str, Any] = {"to": want, "s": time.perf_counter() - t}
            if timings is not None:
                timings["stack_restore_s"] = out["s"]
        except Exception as exc:
            out = {"error": f"{type(exc).__name__}: {exc}"}
        self.stack["wake"] = out
        return out
