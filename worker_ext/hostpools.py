"""The CPU backend: vLLM's CPU worker ignores sleep, so this backend frees memory itself.

Pools by ownership:
- `kv_cache`: the storage under `model_runner.kv_caches` (one backing allocation on 0.32);
- `weights`: every storage reachable from the model (parameters, buffers, plain tensor
  attributes), plus, at level 2, the packed GEMM kernels vLLM-CPU keeps in `layer.cpu_linear`
  closures (oneDNN handles hold the real linear weights there; see docs/cpu-backend.md).

Suspend frees a storage with `untyped_storage().resize_(0)`: tensor objects and views stay
valid, only their bytes go. Resume re-allocates (a new address: CPU memory cannot be mapped
back in place) and zeroes, so the pages are resident again. Level 1 keeps the weights where
they are (host memory already; an offload copy would free nothing), and so the KV cache
when a sleep keeps it (the prefix cache across a sleep: docs/contracts.md §1.3).
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import logging
from collections.abc import Sequence
from typing import Any

import torch

from worker_ext import ownership
from worker_ext.pools import DISCARDED, KV_CACHE, OFFLOADED, UNPOOLED, WEIGHTS, During, policy
from worker_ext.settings import WorkerSettings

log = logging.getLogger(__name__)

_libc: Any = None


def malloc_trim() -> bool:
    """Hand freed heap pages back to the OS (glibc keeps small frees in its arenas)."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    if not _libc or not hasattr(_libc, "malloc_trim"):
        return False
    return bool(_libc.malloc_trim(0))


def rss_bytes() -> int:
    """Resident set size of this process (VmRSS)."""
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _suspended_linear(x: Any, weight: Any, bias: Any) -> Any:
    raise RuntimeError("hotswap: linear weights are suspended (level 2); reload them first")


def packed_linears(model: Any) -> list[tuple[str, Any]]:
    """Modules whose forward goes through vLLM-CPU's `cpu_linear` closure."""
    return [(n, m) for n, m in model.named_modules() if "cpu_linear" in vars(m)]


def unpacked_layers(model: Any) -> list[str]:
    """Layers still waiting for a reload to re-pack their linear kernel."""
    return [n for n, m in packed_linears(model) if vars(m)["cpu_linear"] is _suspended_linear]


def repack_moe_experts(model: Any) -> list[str]:
    """Redo the CPU experts' prepack a reload skipped; returns the layers repacked.

    vllm-cpu 0.32 treats a reload of an unquantized MoE layer as a weight update: it copies
    the checkpoint's layout into the (prepacked) storage and skips the experts' own
    `process_weights_after_loading`, which is where CPU prepacks into its grouped-GEMM
    layout, so the kernel reads unpacked bytes (vLLM's own level 2 then serves other
    tokens). Running that step once brings the layout of the first load back; the
    verification still compares every byte with the pre-sleep fingerprints."""
    done: list[str] = []
    for name, mod in model.named_modules():
        kernel = getattr(getattr(mod, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        step = getattr(experts, "process_weights_after_loading", None)
        if callable(step) and hasattr(experts, "isa") and hasattr(mod, "w13_weight"):
            step(mod)
            done.append(name)
    return done


class _Storage:
    __slots__ = ("name", "nbytes", "storage", "tensor")

    def __init__(self, name: str, tensor: Any) -> None:
        self.name = name
        self.tensor = tensor
        self.storage = tensor.untyped_storage()
        self.nbytes = int(self.storage.nbytes())


class HostBackend:
    name = "host"
    in_place = False  # resume re-allocates: new addresses, so protection is by object

    def __init__(self, worker: Any, settings: WorkerSettings | None = None) -> None:
        self._worker = worker
        self.settings = settings if settings is not None else WorkerSettings.from_env()
        self.device = torch.device("cpu")
        self._members: dict[str, list[_Storage]] = {}
        self._asleep: dict[str, str] = {}
        self._dropped_kernels = 0
        self._ranges: list[tuple[int, int, str]] | None = None

    # membership -------------------------------------------------------------

    def _runner(self) -> Any:
        return self._worker.model_runner

    def _scan(self) -> None:
        """Recompute pool membership from ownership (only while nothing is asleep)."""
        runner = self._runner()
        members: dict[str, list[_Storage]] = {WEIGHTS: [], KV_CACHE: []}
        model = runner.get_model() if runner is not None else None
        for rec in ownership.walk(model, runner):
            if rec.is_kv:
                members[KV_CACHE].append(_Storage(rec.name, rec.tensor))
            elif rec.kind != ownership.RUNNER and rec.nbytes:
                members[WEIGHTS].append(_Storage(rec.name, rec.tensor))
        self._members = members

    def refresh(self) -> None:
        """Re-read membership (the model may have gained tensors); only while all awake."""
        if not self._asleep:
            self._scan()
        self._ranges = None

    def _pool(self, tag: str) -> list[_Storage]:
        if not self._members:
            self._scan()
        return self._members.get(tag, [])

    def _range_table(self) -> list[tuple[int, int, str]]:
        if self._ranges is None:
            table = []
            for tag in (KV_CACHE, WEIGHTS):
                for s in self._pool(tag):
                    base = int(s.storage.data_ptr())
                    if base:
                        table.append((base, base + s.nbytes, tag))
            self._ranges = sorted(table)
        return self._ranges

    # PoolBackend ------------------------------------------------------------

    def pools(self) -> dict[str, int]:
        return {tag: sum(s.nbytes for s in self._pool(tag)) for tag in (WEIGHTS, KV_CACHE)}

    def tag_of(self, data_ptr: int, nbytes: int) -> str:
        table = self._range_table()
        i = bisect.bisect_right(table, (data_ptr, 1 << 64, "")) - 1
        if i >= 0:
            base, end, tag = table[i]
            if base <= data_ptr and data_ptr + nbytes <= end:
                return tag
        return UNPOOLED

    def records(self) -> list[tuple[int, int, str]]:
        return list(self._range_table())

    def free_ranges(self) -> list[tuple[int, int]]:
        return []

    def suspended(self) -> dict[str, str]:
        return dict(self._asleep)

    def memory(self) -> dict[str, int]:
        return {"rss": rss_bytes()}

    def prepare_kv_keep(self) -> None:
        """Nothing to make: the KV cache stays where it is."""

    def kv_keep_refusal(self) -> str | None:
        return None  # kept in place: host memory already, nothing more is needed

    def resident(self) -> dict[str, Any]:
        """No device: a CPU engine leaves nothing on one (its RSS is in hotswap_info)."""
        return {"bytes": 0, "source": "none"}

    def release_cached(self) -> float:
        return 0.0  # no device allocator

    def host_backup_bytes(self) -> int:
        return 0  # level 1 keeps the weights in place: no copy is ever kept beside them

    def drop_backup(self) -> dict[str, int]:
        return {WEIGHTS: 0, KV_CACHE: 0}

    def wake_scratch_bytes(self) -> int:
        return 0

    def suspend(
        self,
        level: int,
        tags: list[str],
        keep_kv: bool = False,
        rewritten: Sequence[tuple[int, int]] = (),  # no disk tier here: nothing keys by it
        during: During | None = None,
        early_kv: Sequence[int] = (),  # nothing released before the prepare here
    ) -> dict[str, Any]:
        for tag in tags:
            if tag not in (WEIGHTS, KV_CACHE):
                raise ValueError(f"unknown pool {tag!r}")
            if tag in self._asleep:
                raise RuntimeError(f"pool {tag!r} is already suspended")
        if during is not None:  # no copies to run it under: before anything is released
            during(lambda: None)
        if not self._asleep:
            self._scan()
        self._ranges = None
        freed: dict[str, int] = {}
        offloaded: dict[str, int] = {}
        for tag in tags:
            how = policy(level, tag, keep_kv)
            members = self._members.get(tag, [])
            if how == OFFLOADED:
                # Host memory already: keeping the bytes in place is the offload.
                offloaded[tag] = sum(s.nbytes for s in members)
                freed[tag] = 0
            else:
                freed[tag] = 0
                for s in members:
                    s.storage.resize_(0)
                    freed[tag] += s.nbytes
                if tag == WEIGHTS:
                    self._drop_kernels()
            self._asleep[tag] = how
        malloc_trim()
        return {"freed_bytes": freed, "offloaded_bytes": offloaded}

    def demote_refusal(self) -> str | None:
        """Why this sleep cannot become level 2 (None: it can)."""
        if self._asleep.get(WEIGHTS) != OFFLOADED:
            return f"demote: the weights are not kept asleep ({self._asleep})"
        return None

    def demote(self) -> dict[str, Any]:
        """A level-1 sleep becomes level 2: the weights kept in place are freed (and their
        packed kernels dropped); a wake then reloads them from the checkpoint."""
        if self._asleep.get(WEIGHTS) != OFFLOADED:
            raise RuntimeError(f"demote: the weights are not kept asleep ({self._asleep})")
        freed = 0
        for s in self._members.get(WEIGHTS, []):
            s.storage.resize_(0)
            freed += s.nbytes
        self._drop_kernels()
        self._asleep[WEIGHTS] = DISCARDED
        self._ranges = None
        malloc_trim()
        return {"freed_bytes": {WEIGHTS: freed}}

    def _drop_kernels(self) -> None:
        """Release packed linear kernels; vLLM's reload re-packs them from the checkpoint."""
        runner = self._runner()
        model = runner.get_model() if runner is not None else None
        if model is None:
            return
        for _, mod in packed_linears(model):
            if vars(mod)["cpu_linear"] is not _suspended_linear:
                mod.cpu_linear = _suspended_linear
                self._dropped_kernels += 1

    def resume(self, tags: list[str]) -> dict[str, Any]:
        restored: dict[str, int] = {}
        for tag in tags:
            how = self._asleep.get(tag)
            if how is None:
                continue
            members = self._members.get(tag, [])
            n = 0
            if how == DISCARDED:
                for s in members:
                    s.storage.resize_(s.nbytes)
                    # Touch every page now: the pool is resident again, as on the device.
                    raw = torch.empty(0, dtype=torch.uint8)
                    raw.set_(s.storage, 0, (s.nbytes,), (1,))
                    raw.zero_()
                    n += s.nbytes
            else:
                n = sum(s.nbytes for s in members)
            restored[tag] = n
            del self._asleep[tag]
        self._ranges = None  # re-allocated storages live at new addresses
        return {"restored_bytes": restored}

    def describe(self) -> dict[str, Any]:
        return {}

    def _model(self) -> Any:
        runner = self._runner()
        return runner.get_model() if runner is not None else None

    def after_reload(self) -> list[str]:
        """vllm-cpu 0.32's reload skips the CPU experts' prepack: redo it."""
        return repack_moe_experts(self._model())

    def tier_restored(self) -> dict[str, Any] | None:
        return None  # no disk tier on CPU: a level-2 wake reloads

    def unready(self) -> list[str]:
        missing = unpacked_layers(self._model())
        return [f"linear kernels not re-packed (reload missing?): {missing}"] if missing else []
