"""Test-only worker extension: HotSwapExtension plus read-only probes the GPU tests need.

Loaded by the engine as `tests.gpu.gpu_ext.GpuTestExtension` (the repo root on PYTHONPATH).
"""

from __future__ import annotations

from typing import Any

import torch

from worker_ext.extension import HotSwapExtension, rpc

SCALE_NAMES = (
    "embed_scale",
    "embed_scale_per_layer",
    "per_layer_input_scale",
    "per_layer_projection_scale",
)


class GpuTestExtension(HotSwapExtension):
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
