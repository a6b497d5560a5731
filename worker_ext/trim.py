"""What a sleeping engine need not keep alive in host memory (docs/contracts.md §1, a sleep's
host trim): torch inductor's compile-worker pool, a subprocess and one worker per core, each
a few hundred MB, kept by torch for the next compile (vLLM 0.26 sets
TORCHINDUCTOR_COMPILE_THREADS=1 at its import, so its engines usually have none); torch's
cached pinned host blocks; the C heap's free pages. Once the engine is compiled and warm (its
first sleep) the pool goes; a later compile starts a new one (torch clears its cache)."""

from __future__ import annotations

import ctypes
import functools
import sys
import time
from typing import Any


def release_compile_workers() -> int:
    """Shut down inductor's compile-worker pools of this process; how many there were."""
    mod = sys.modules.get("torch._inductor.async_compile")
    pools = getattr(mod, "_pool_set", None)
    if mod is None or not pools:
        return 0
    n = len(pools)
    mod.shutdown_compile_workers()
    return n


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def heap(libc: Any) -> dict[str, int] | None:
    """What the C heap holds now (glibc's mallinfo2); None where there is no mallinfo2."""
    info = getattr(libc, "mallinfo2", None)
    if info is None:
        return None
    info.restype = _MallInfo2
    m = info()
    return {
        "arena": int(m.arena),
        "mmap": int(m.hblkhd),
        "in_use": int(m.uordblks) + int(m.hblkhd),
        "free": int(m.fordblks),
    }


@functools.cache
def _libc() -> Any:
    """This process's C library, loaded once (None where it cannot be)."""
    try:
        return ctypes.CDLL(None)
    except OSError:
        return None


def release_host_memory(torch: Any = None, libc: Any = None) -> dict[str, Any]:
    """After a sleep: torch's host allocator gives its cached free pinned blocks back (the
    driver unpins and frees them; blocks in use stay), then glibc's `malloc_trim(0)` hands
    the heap's free pages back to the kernel, and what the heap holds after (`heap`). Never
    raises: {`pinned_cache`, `malloc_trim` (each: true when done, false when released
    nothing, null when not there), `heap`, `s`} or with `error`. `torch`, `libc`: seams
    for tests (default: torch if imported, this process's C library)."""
    t = time.perf_counter()
    out: dict[str, Any] = {"pinned_cache": None, "malloc_trim": None}
    errors = []
    try:
        torch = sys.modules.get("torch") if torch is None else torch
        empty = getattr(getattr(torch, "_C", None), "_host_emptyCache", None)
        if empty is not None:
            empty()
            out["pinned_cache"] = True
    except Exception as exc:
        errors.append(f"pinned_cache: {type(exc).__name__}: {exc}")
    try:
        libc = _libc() if libc is None else libc
        trim = getattr(libc, "malloc_trim", None)
        if trim is not None:
            out["malloc_trim"] = bool(trim(0))
    except Exception as exc:
        errors.append(f"malloc_trim: {type(exc).__name__}: {exc}")
    try:
        out["heap"] = heap(libc)
    except Exception as exc:
        out["heap"] = None
        errors.append(f"heap: {type(exc).__name__}: {exc}")
    if errors:
        out["error"] = "; ".join(errors)
    out["s"] = time.perf_counter() - t
    return out
