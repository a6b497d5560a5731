"""Test-only worker extension: HotSwapExtension plus read-only probes the GPU tests need.

Loaded by the engine as `tests.gpu.gpu_ext.GpuTestExtension` (the repo root on PYTHONPATH).
"""

from __future__ import annotations

from typing import Any

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
