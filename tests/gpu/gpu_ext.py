"""Test-only worker extension: HotSwapExtension plus read-only probes the GPU tests need.

Loaded by the engine as `tests.gpu.gpu_ext.GpuTestExtension` (the repo root on PYTHONPATH).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch

from worker_ext.extension import HotSwapExtension, rpc

# HOTSWAP_TEST_UNREACHABLE=1 in the engine's environment: while vLLM allocates inside each
# cuMem pool (the weights while the model loads, the kv_cache pool while the KV cache is
# made), three more tensors are allocated there that no ownership walk reaches, one in a
# module global, one in a closure, one in a dict keyed outside the model; the embedding's
# forward multiplies its output by their first elements (1.0: no change), so a lost value
# changes the greedy tokens. Planted before CUDA graphs are captured, so graphs read them.
POOLS = ("weights", "kv_cache")
GLOBALS: dict[str, Any] = {}  # pool tag -> tensor (a module global)
OUTSIDE: dict[str, Any] = {}  # a cache keyed outside the model (by pool tag)
_CLOSURES: dict[str, Callable[[], Any]] = {}  # pool tag -> a closure holding the tensor
_PLANT = os.environ.get("HOTSWAP_TEST_UNREACHABLE") == "1"


def _held(t: Any) -> Callable[[], Any]:
    return lambda: t


def planted() -> dict[str, list[Any]]:
    """Pool tag -> [global, closure, outside] tensors planted so far."""
    return {tag: [GLOBALS[tag], _CLOSURES[tag](), OUTSIDE[tag]] for tag in POOLS if tag in GLOBALS}


def _plant(tag: str) -> None:
    if tag not in POOLS or tag in GLOBALS:
        return  # once per pool (a reload may allocate in a pool again)
    GLOBALS[tag] = torch.ones(256, device="cuda")
    _CLOSURES[tag] = _held(torch.ones(256, device="cuda"))
    OUTSIDE[tag] = torch.ones(256, device="cuda")


def _install() -> None:
    from vllm.device_allocator.cumem import CuMemAllocator
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    use_pool = CuMemAllocator.use_memory_pool
    forward = VocabParallelEmbedding.forward

    @contextlib.contextmanager
    def use_memory_pool(self: Any, tag: str | None = None) -> Iterator[None]:
        with use_pool(self, tag=tag):
            yield
            _plant(str(tag))  # still inside the pool: these allocations carry its tag

    def scaled(self: Any, input_: Any) -> Any:
        out = forward(self, input_)
        k = None
        for ts in planted().values():
            for t in ts:
                k = t[:1] if k is None else k * t[:1]
        return out if k is None else out * k.to(out.dtype)

    CuMemAllocator.use_memory_pool = use_memory_pool  # type: ignore[method-assign]
    VocabParallelEmbedding.forward = scaled  # type: ignore[method-assign]


if _PLANT:
    _install()

SCALE_NAMES = (
    "embed_scale",
    "embed_scale_per_layer",
    "per_layer_input_scale",
    "per_layer_projection_scale",
)


class GpuTestExtension(HotSwapExtension):
    _hotswap_test_mode: str | None = None  # protection forced by hotswap_test_protect
    _hotswap_test_corrupt: tuple[str, int] | None = None  # (pool, which) at verify
    _hotswap_test_flip_armed = False  # hotswap_test_flip() at the next verify

    def _hotswap_protect_mode(self) -> str:
        return self._hotswap_test_mode or super()._hotswap_protect_mode()

    def _hotswap_before_verify(self) -> None:
        flip, self._hotswap_test_flip_armed = self._hotswap_test_flip_armed, False
        if flip:
            self.hotswap_test_flip()  # a weight, after the write-back, before the fingerprints
        armed, self._hotswap_test_corrupt = self._hotswap_test_corrupt, None
        if armed is not None:
            t = planted()[armed[0]][armed[1]]
            t[7:8].add_(3.0)  # after the write-back, before the fingerprints
            torch.cuda.synchronize()

    @rpc
    def hotswap_test_protect(self, mode: str | None) -> dict[str, Any]:
        """Force `ranges` or `objects` protection (None: the extension's own choice)."""
        if mode not in (None, "ranges", "objects"):
            raise ValueError(f"mode {mode!r}")
        self._hotswap_test_mode = mode
        return {"mode": self._hotswap_protect_mode()}

    @rpc
    def hotswap_test_release_mode(self, name: str, on: bool) -> dict[str, Any]:
        """The tuning's kv_thread or free_later (`name`) on or off for later sleeps."""
        import dataclasses

        if name not in ("kv_thread", "free_later"):
            raise ValueError(f"release mode {name!r}")
        st = self._hotswap_state()
        tuning = dataclasses.replace(st.settings.tuning, **{name: bool(on)})
        st.use_settings(dataclasses.replace(st.settings, tuning=tuning))
        return {name: getattr(st.settings.tuning, name)}

    @rpc
    def hotswap_test_planted(self, value: float | None = None) -> dict[str, Any]:
        """The unreachable tensors: per pool, each one's pool (by the allocator's records),
        address, whether the walk reaches it and its sum; `value` fills them first."""
        from worker_ext.ownership import storage_key

        st = self._hotswap_state()
        walked = {storage_key(r.tensor) for r in self._hotswap_records()}
        out: dict[str, Any] = {}
        for tag, ts in planted().items():
            if value is not None:
                for t in ts:
                    t.fill_(float(value))
            out[tag] = [
                {
                    "pool": st.backend.tag_of(int(t.data_ptr()), int(t.nbytes)),
                    "ptr": int(t.data_ptr()),
                    "reached": storage_key(t) in walked,
                    "sum": float(t.sum().item()),
                }
                for t in ts
            ]
        torch.cuda.synchronize()
        return {"planted": out}

    @rpc
    def hotswap_test_corrupt_at_verify(self, pool: str, which: int) -> dict[str, Any]:
        """Arm: the next restore_and_verify changes one planted tensor of `pool` (0 global,
        1 closure, 2 outside) between its write-back and its fingerprints."""
        t = planted()[pool][int(which)]
        self._hotswap_test_corrupt = (pool, int(which))
        return {"ptr": int(t.data_ptr()) + 7 * t.element_size()}

    @rpc
    def hotswap_test_flip_at_verify(self) -> dict[str, Any]:
        """Arm: the next verify finds one weight bit flipped (hotswap_test_flip's), between
        its write-back and its fingerprints (vLLM's own wake has no call in between)."""
        self._hotswap_test_flip_armed = True
        return {}

    @rpc
    def hotswap_test_spoil_host_copy(self, undo: bool = False) -> dict[str, Any]:
        """Asleep at level 1, the weights offloaded: XOR 0x55 into the first data byte of
        the weights' host copy (the first coded piece's first chunk: an s byte or a raw
        one; else the first raw record's), so the wake brings the first byte of that range
        back XORed the same way. `undo` (awake after that wake): both bytes back."""
        import ctypes

        from worker_ext import codec
        from worker_ext.rawmem import raw_bytes

        b = self._hotswap_state().backend
        if undo:
            host, dev = self._hotswap_test_spoiled
            ctypes.c_uint8.from_address(host).value ^= 0x55
            raw_bytes(dev, 1, b.device).bitwise_xor_(0x55)
            torch.cuda.synchronize()
            return {}
        buf = b._host.buf
        if buf is None:
            raise RuntimeError("no host copy of the weights")
        if b._coded.pieces:
            plan = b._coded.plan
            p = plan.pieces[0]
            host = buf.ptr + p.host_off + int(plan.meta_h[p.first][codec.OFF])
            dev = plan.ranges[p.rng][0] + p.dev_off
        else:
            mine = [(off, ptr) for ptr, (base, off, _n) in b._layout.items() if base == buf.ptr]
            off, dev = min(mine)
            host = buf.ptr + off
        ctypes.c_uint8.from_address(host).value ^= 0x55
        self._hotswap_test_spoiled = (host, dev)
        return {"host": host, "device": dev}

    @rpc
    def hotswap_test_checksum(self) -> dict[str, Any]:
        """float64 sum of every parameter: a cheap "did the weights move" probe."""
        model = self._hotswap_model()
        total = sum(float(p.double().sum().item()) for p in model.parameters())
        return {"checksum": total}

    @rpc
    def hotswap_test_flip(self, name: str | None = None) -> dict[str, Any]:
        """XOR one bit of one element in the middle of a weight's storage (the first
        non-KV record of at least 8 KiB, or `name`); call again with its name to undo."""
        from worker_ext.fingerprint import storage_bytes
        from worker_ext.ownership import PARAMETER

        recs = [r for r in self._hotswap_records() if not r.is_kv]
        if name is None:
            rec = next(r for r in recs if r.kind == PARAMETER and r.nbytes >= 8192)
        else:
            rec = next(r for r in recs if r.name == name)
        raw = storage_bytes(rec.tensor)
        raw[raw.numel() // 2 + 3].bitwise_xor_(16)
        torch.cuda.synchronize()
        snap = self._hotswap_state().snap
        plan = snap.plan if snap is not None else None
        return {
            "name": rec.name,
            "records": len(recs),
            "spans": plan.n_spans if plan is not None else None,
            "storages": plan.n_storages if plan is not None else None,
        }

    @rpc
    def hotswap_test_scales(self) -> dict[str, Any]:
        """Gemma3n's plain-attribute scale tensors (not parameters, not buffers) by path."""
        model = self._hotswap_model()
        out: dict[str, Any] = {}
        for mod_name, mod in model.named_modules():
            for attr in SCALE_NAMES:
                t = mod.__dict__.get(attr)
                if t is not None and hasattr(t, "data_ptr"):
                    out[f"{mod_name}.{attr}"] = {
                        "value": float(t.float().item()),
                        "data_ptr": int(t.data_ptr()),
                    }
        return {"scales": out}

    @rpc
    def hotswap_test_kernels(self) -> dict[str, Any]:
        """Which kernels the engine picked: attention backends, linear and MoE quant methods,
        the FP8 MoE backend and its experts class (read-only; for the coverage matrix)."""
        model = self._hotswap_model()
        attention: set[str] = set()
        linear: set[str] = set()
        moe: set[str] = set()
        detail: dict[str, str] = {}
        for name, mod in model.named_modules():
            backend = getattr(mod, "attn_backend", None)
            if backend is not None and hasattr(backend, "get_name"):
                attention.add(str(backend.get_name()))
            qm = getattr(mod, "quant_method", None)
            if qm is None:
                continue
            kind = type(qm).__name__
            is_moe = "MoE" in kind or "Moe" in kind
            (moe if is_moe else linear).add(kind)
            if is_moe and "moe" not in detail:
                for attr in ("fp8_backend", "experts_cls", "moe_kernel", "kernel"):
                    v = getattr(qm, attr, None)
                    if v is None:
                        continue
                    text = getattr(v, "value", None) or getattr(v, "__name__", None)
                    if text is None:
                        inner = getattr(v, "fused_experts", None) or getattr(v, "experts", None)
                        text = type(inner if inner is not None else v).__name__
                    detail[attr] = str(text)
                detail["moe"] = name
        return {
            "attention": sorted(attention),
            "linear": sorted(linear),
            "moe": sorted(moe),
            "detail": detail,
        }

    @rpc
    def hotswap_test_keep_host_copy(self) -> dict[str, Any]:
        """Keep a host copy of every parameter: the level-2 weight source for a model that
        was loaded with load_format="dummy" (no checkpoint to reload from)."""
        model = self._hotswap_model()
        with torch.no_grad():
            copy = [(n, p.detach().to("cpu", copy=True)) for n, p in model.named_parameters()]
        self._hotswap_test_host = copy
        return {"count": len(copy), "bytes": sum(t.numel() * t.element_size() for _, t in copy)}

    @rpc
    def hotswap_test_reload_host(self) -> dict[str, Any]:
        """Level-2 refill from that host copy through vLLM's own Worker.reload_weights."""
        copy = getattr(self, "_hotswap_test_host", None)
        if copy is None:
            raise RuntimeError("call hotswap_test_keep_host_copy first")
        with torch.no_grad():
            self.reload_weights(weights_iterator=iter(copy), is_checkpoint_format=False)  # type: ignore[attr-defined]
        torch.cuda.synchronize()
        return {"count": len(copy)}

    @rpc
    def hotswap_test_lend_inbox(self) -> dict[str, Any]:
        """Listen on this rank's device for lent KV memory (worker_ext.cumem.kvlend) as a
        waking rank would, so that this engine's next fused sleep lends to the test."""
        from worker_ext.cumem import kvlend

        b = self._hotswap_state().backend
        uuid = str(torch.cuda.get_device_properties(b.device).uuid)

        def never(_x: Any) -> Any:
            raise RuntimeError("the test's inbox lends nothing")

        lending = kvlend.Lending(lambda: uuid, lambda: b.settings, never, never)
        lending.open()
        _LENT["lending"] = lending
        return {"listening": lending.inbox is not None}

    @rpc
    def hotswap_test_map_lent(self) -> dict[str, Any]:
        """Map what was lent to the test's inbox as a waking rank's records would be (the
        driver's import: the same size; a larger record with a new allocation after it),
        write and read each, unmap and free them; the inbox closed (what is left goes back
        to the driver)."""
        import ctypes

        from worker_ext.cudriver import Driver
        from worker_ext.rawmem import raw_bytes

        lending = _LENT.pop("lending")
        box = lending.inbox
        box.poll()
        b = self._hotswap_state().backend
        drv = Driver(b.device.index or 0)
        g = drv.granularity
        out: dict[str, Any] = {"received": box.received, "mapped": []}
        for extra in (0, g):
            there = [k for k, fds in box._lent.items() if fds]
            got = box.take(min(there)) if there else None  # the smallest, by its own size
            if got is None:
                break
            fd, n = got
            size = n + extra
            if size <= 0:
                os.close(fd)
                continue
            ptr = drv.reserve(size)
            slot = ctypes.c_uint64(0)
            lent = (fd, n)
            ok = drv._try_lent((0, size, ptr, ctypes.addressof(slot)), lambda _s, got=lent: got)
            row: dict[str, Any] = {"lent": n, "size": size, "mapped": ok}
            if ok:
                view = raw_bytes(ptr, size, b.device)
                view.fill_(0x5A)
                torch.cuda.synchronize()
                row["readback"] = bool((view == 0x5A).all().item())
                del view
                # lent on as it came (export_fd): the descriptor it came with, its own size
                fd2, n2 = drv.export_fd((0, size, ptr, ctypes.addressof(slot)))
                row["lent_on"] = n2
                row["same_memory"] = os.fstat(fd2).st_ino == os.fstat(drv.kept[ptr][0]).st_ino
                os.close(fd2)
                drv.unmap(ptr, size)  # both allocations at once, where two
                drv.release(slot.value)
                drv.forget(ptr)  # the lent descriptor kept for it
            drv.lib.cuMemAddressFree(ctypes.c_uint64(ptr), ctypes.c_size_t(size))
            out["mapped"].append(row)
        lending.close()
        return out


_LENT: dict[str, Any] = {}  # hotswap_test_lend_inbox's Lending, until hotswap_test_map_lent
