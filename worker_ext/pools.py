"""Tagged memory pools: the interface the extension drives, one backend per platform.

- `cumem` (CUDA, worker_ext/cumem/): vLLM's CuMemAllocator records, engine started with
  --enable-sleep-mode. Pools are the allocator's tags (`weights`, `kv_cache`).
- `host` (CPU, worker_ext/hostpools.py): vLLM's CPU worker ignores sleep, so the backend
  frees tensor storage itself and re-makes it on resume.

Level semantics every backend implements:
- level 1: `weights` kept (CUDA: offloaded to host and copied back), `kv_cache` discarded;
- level 2: both discarded; weights come back through the reload (vLLM's reload_weights);
- an explicit `tags` list suspends only those pools (e.g. ["kv_cache"]), with the level's
  policy for each (weights: offload at level 1, discard at level 2; kv_cache: discard).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

from worker_ext.settings import WorkerSettings

WEIGHTS = "weights"
KV_CACHE = "kv_cache"
UNPOOLED = "unpooled"
ALL_TAGS = (WEIGHTS, KV_CACHE)
# CUDA: the CUDA graphs' pool when captured into a CuMem pool (worker_ext.graphpool). Not a
# tag callers name: it sleeps with the KV cache, released without a copy and mapped back
# empty (every replay writes what it reads); only named tensors in it are protected.
GRAPHS = "cudagraph"

OFFLOADED = "offloaded"  # bytes kept on the host, copied back on resume
DISCARDED = "discarded"  # bytes dropped; content undefined after resume


def policy(level: int, tag: str, keep_kv: bool = False) -> str:
    """What suspending `tag` at `level` does to its bytes; `keep_kv` (level 1 only): the KV
    cache is kept like the weights (docs/contracts.md §1.3)."""
    if level == 1 and (tag == WEIGHTS or (keep_kv and tag == KV_CACHE)):
        return OFFLOADED
    return DISCARDED


# hotswap_sleep's prepare, as a backend's suspend calls it: given the function that queues
# the rest of the offload copies, it returns the ranges the snapshot writes back.
During = Callable[[Callable[[], None]], Sequence[tuple[int, int]]]


class PoolBackend(Protocol):
    name: str
    # True when resume maps every pool back at its old addresses (CUDA): then a sleep can
    # protect bytes by address range (worker_ext.protect); False: by object only.
    in_place: bool
    device: Any  # the torch device the pools live on
    settings: WorkerSettings  # read once (worker_ext/settings.py)

    def records(self) -> list[tuple[int, int, str]]:
        """Every allocation the pools hold, as (start, end, tag), sorted by start."""
        ...

    def free_ranges(self) -> list[tuple[int, int]]:
        """Ranges inside the records that no tensor can hold now (the caching allocator's
        free blocks and the unused ends of its blocks): nobody reads them, nothing protects
        them."""
        ...

    def pools(self) -> dict[str, int]:
        """Bytes held by each tag (asleep or not)."""
        ...

    def tag_of(self, data_ptr: int, nbytes: int) -> str:
        """The tag of the pool holding [data_ptr, data_ptr+nbytes), or UNPOOLED."""
        ...

    def suspend(
        self,
        level: int,
        tags: list[str],
        keep_kv: bool = False,
        rewritten: Sequence[tuple[int, int]] = (),
        during: During | None = None,
        early_kv: Sequence[int] = (),
    ) -> dict[str, Any]:
        """Release the given pools per `policy` (`keep_kv`: the KV pool kept, level 1).
        `rewritten`: (start, end) ranges the snapshot writes back after the wake (level 2:
        the weights records' protected bytes), which a disk tier's key leaves out.
        `during` (hotswap_sleep's prepare): called before anything is released (a backend
        with `overlaps_prepare` calls it once its first offload copies are queued) with a
        function that queues the rest (the prepare calls it once its own small copies are
        queued ahead of them; the backend calls it after, if not); its answer replaces
        `rewritten`; if it raises, nothing is released and the error propagates.
        `early_kv`: KV records (addresses) a backend that overlaps the prepare may release
        before `during`, mapped back if it raises (others ignore it).
        Returns {"freed_bytes": {tag: n}, "offloaded_bytes": {tag: n}}. Suspending a pool
        that is already asleep is an error."""
        ...

    def prepare_kv_keep(self) -> None:
        """Start what keeping the KV pool needs, before its suspend (CUDA: pin its host
        buffer in the background)."""
        ...

    def kv_keep_refusal(self) -> str | None:
        """Why this backend cannot keep the KV pool across a level-1 sleep now (host memory
        for its copy); None: it can."""
        ...

    def resident(self) -> dict[str, Any]:
        """What this process holds on its device now (hotswap_info's `resident`)."""
        ...

    def release_cached(self) -> float:
        """At a suspend's end, once its own scratch is freed: the device allocator's cached
        free blocks back to the driver; the seconds it took (0.0 where there is none)."""
        ...

    def host_backup_bytes(self) -> int:
        """Host RAM kept now for the pools' copies (CUDA: the pinned buffers kept for the
        next sleep); 0 where none is kept."""
        ...

    def drop_backup(self) -> dict[str, int]:
        """Awake: release the kept host copies; the bytes freed by pool."""
        ...

    def wake_scratch_bytes(self) -> int:
        """Device bytes the next wake takes for a while beyond the pools it maps back (the
        codec's staging); 0 while awake or where a wake needs none."""
        ...

    def resume(self, tags: list[str]) -> dict[str, Any]:
        """Map the given (asleep) pools back at the same addresses where the platform allows,
        copying offloaded bytes back. Returns {"restored_bytes": {tag: n}}."""
        ...

    def suspended(self) -> dict[str, str]:
        """Tags asleep now -> OFFLOADED | DISCARDED."""
        ...

    def memory(self) -> dict[str, int]:
        """Device memory (CUDA: cudaMemGetInfo "free"/"total") or host ("rss") of this worker."""
        ...

    def describe(self) -> dict[str, Any]:
        """The backend's own state for hotswap_info's `backend_detail` (plain values)."""
        ...

    def refresh(self) -> None:
        """Re-read what the pools hold (called while nothing is suspended)."""
        ...

    def after_reload(self) -> list[str]:
        """Whatever a reload of the weights leaves undone, done now; the layers touched."""
        ...

    def unready(self) -> list[str]:
        """Why the awake pools cannot serve yet (empty: they can); verify refuses until then."""
        ...

    def tier_restored(self) -> dict[str, Any] | None:
        """Whether the last resume brought the weights back from the level-2 disk tier (then
        the reload is skipped): its report, taken once ({"used": bool, ...}); None when no
        tier was tried."""
        ...
