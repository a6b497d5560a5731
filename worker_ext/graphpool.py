"""vLLM's CUDA-graph pool as a CuMem pool that sleeps with the KV cache (docs/contracts.md §1.2).

vLLM 0.26 captures every CUDA graph into one private pool of torch's caching allocator
(`current_platform.get_global_graph_pool()`), which no sleep releases: a sleeper keeps it
and a deep sleep's checkpoint copies it. `install()`, run when the extension is imported
into a process (a worker, before its model loads), makes the first `get_global_graph_pool()`
of a rank with vLLM's CuMemAllocator (sleep mode on) at world size 1 answer with a pool of
that allocator's own pluggable allocator, kept beside vLLM's (`allocator_and_pools`), so
the captures' allocations become CuMem records. The backend's records (worker_ext.cumem)
know them by the pool's own segments: they are released without a copy whenever the KV
cache is and mapped back empty with it. Nothing here raises: a rank where it cannot be done
keeps vLLM's pool, and `describe()` says why.
"""

from __future__ import annotations

import sys
from typing import Any

from worker_ext.pools import GRAPHS

# Whether the first ask made the CuMem pool ("cumem") or left vLLM's ("vllm", with why);
# "unasked" until vLLM asks (eager engines never do).
_STATE: dict[str, Any] = {"pool": "unasked", "reason": None, "installed": False}


def describe() -> dict[str, Any]:
    """hotswap_info's `graph_pool`: {`pool`, `reason`, `installed`} (plain values)."""
    return dict(_STATE)


def install() -> bool:
    """Route the global graph pool through `make_pool` on this process's CUDA platform,
    once; False where there is none (no vLLM loaded yet, or not CUDA)."""
    platforms = sys.modules.get("vllm.platforms")
    if platforms is None:
        return False
    try:
        platform = platforms.current_platform
        if not platform.is_cuda():
            return False
        cls = type(platform)
    except Exception:
        return False
    if getattr(cls.get_global_graph_pool, "_hotswap", False):
        return True

    def get_global_graph_pool(self: Any) -> Any:
        klass = self.__class__
        if klass._global_graph_pool is None:
            pool, reason = make_pool()
            _STATE.update(pool="cumem" if pool is not None else "vllm", reason=reason)
            klass._global_graph_pool = pool if pool is not None else self.graph_pool_handle()
        return klass._global_graph_pool

    get_global_graph_pool._hotswap = True  # type: ignore[attr-defined]
    cls.get_global_graph_pool = get_global_graph_pool
    _STATE["installed"] = True
    return True


def _world_size() -> int:
    from vllm.distributed.parallel_state import get_world_group

    return int(get_world_group().world_size)


def _in_worker() -> bool:
    """Whether this process's vLLM worker has the extension: vLLM mixes the extension class
    into its Worker class's bases, `HotSwapWorker` subclasses it (a process that only
    imported the package, or a fork of one, keeps vLLM's pool). Known by the extension's own
    method, not its class: the extension's package imports this one."""
    from vllm.v1.worker.gpu_worker import Worker

    classes = [Worker, *Worker.__subclasses__()]
    return any(callable(getattr(c, "hotswap_info", None)) for c in classes)


def make_pool() -> tuple[Any, str | None]:
    """A MemPool of vLLM's CuMemAllocator's pluggable allocator, kept in its
    `allocator_and_pools` (released at exit in vLLM's order), and its id; or None and why."""
    from worker_ext.settings import WorkerSettings

    if WorkerSettings.from_env().graph_pool == "keep":
        return None, "HOTSWAP_GRAPH_POOL=keep"
    try:
        from vllm.device_allocator import cumem

        alloc = cumem.CuMemAllocator.instance
        if not cumem.cumem_available or alloc is None:
            return None, "no CuMemAllocator in this process (sleep mode off)"
        if not _in_worker():
            return None, "the extension is not in this process's vLLM worker"
        world = _world_size()
        if world != 1:
            # vLLM's custom all-reduce shares graph buffers by CUDA IPC with the other
            # ranks: a remapped pool would leave their handles stale
            return None, f"world size {world}: graph buffers are shared between ranks"
        import torch

        pluggable = cumem.get_pluggable_allocator(
            alloc.python_malloc_callback, alloc.python_free_callback
        )
        pool = torch.cuda.memory.MemPool(pluggable._allocator)
        alloc.allocator_and_pools[GRAPHS] = (pool, pluggable)
        return pool.id, None
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def pool_segments(alloc: Any) -> frozenset[int] | None:
    """The base addresses of the graph pool's segments (its CuMem records), or None when
    this allocator holds no graph pool or cannot say."""
    entry = getattr(alloc, "allocator_and_pools", {}).get(GRAPHS)
    if not entry:
        return None
    try:
        return frozenset(int(seg["address"]) for seg in entry[0].snapshot())
    except Exception:
        return None
