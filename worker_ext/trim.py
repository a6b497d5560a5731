"""What a sleeping engine need not keep alive in host memory (docs/contracts.md §2.2, host
PSS): torch inductor's compile-worker pool, a subprocess and one worker per core, each a few
hundred MB, kept by torch for the next compile. Once the engine is compiled and warm (its
first sleep) the pool goes; a later compile starts a new one (torch clears its cache)."""

from __future__ import annotations

import sys


def release_compile_workers() -> int:
    """Shut down inductor's compile-worker pools of this process; how many there were."""
    mod = sys.modules.get("torch._inductor.async_compile")
    pools = getattr(mod, "_pool_set", None)
    if mod is None or not pools:
        return 0
    n = len(pools)
    mod.shutdown_compile_workers()
    return n
