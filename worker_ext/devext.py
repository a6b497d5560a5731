"""Bench-only worker extension: HotSwapExtension plus the RPCs that redraw the weights,
switch the host codec and swap in an earlier prepare (a before/after on one engine).

Loaded by the benches' HTTP engines as `worker_ext.devext.RealWeightsExtension`, so a server
started with vLLM's dummy loader can be given weights drawn like a trained model's
(worker_ext.devmodels.realistic_fill_model_) before it is measured: the host codec's ratio,
and so a coded wake's bytes, depend on them. Never for serving.
"""

from __future__ import annotations

from typing import Any

import torch

from worker_ext import fingerprint
from worker_ext.devmodels import realistic_fill_model_
from worker_ext.extension import HotSwapExtension, rpc
from worker_ext.settings import Tuning


class RealWeightsExtension(HotSwapExtension):
    @rpc
    def hotswap_bench_realistic_weights(self, seed: int = 1) -> dict[str, Any]:
        """Redraw every floating parameter (awake only), then size the host buffer again
        for the new weights' coded copy (it was pinned for the dummy weights' at start)."""
        st = self._hotswap_state()
        if st.backend.suspended():
            raise RuntimeError("asleep: the weights are not mapped")
        model = self._hotswap_model()
        n = realistic_fill_model_(model.named_parameters(), seed=int(seed))
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        warm = getattr(st.backend, "warm_host", None)
        described: dict[str, Any] = {}
        if callable(warm):
            warm(wait=True)  # joins a pinning already running for the old size
            described = warm(wait=True)  # pins anew if the coded copy grew
        return {"filled_bytes": n, "host": described}

    @rpc
    def hotswap_bench_codec(self, codec: str) -> dict[str, Any]:
        """Awake: this worker's HOTSWAP_HOST_CODEC becomes `codec` (exp | none), and the
        host buffer is pinned again for that copy's size (a raw copy needs a bigger one),
        so one engine is measured with both in one run."""
        import dataclasses

        st = self._hotswap_state()
        if st.backend.suspended():
            raise RuntimeError("asleep: switch the codec while awake")
        if codec not in ("exp", "none"):
            raise ValueError(f"codec {codec!r}: expected exp or none")
        st.use_settings(dataclasses.replace(st.settings, host_codec=codec))
        warm = getattr(st.backend, "warm_host", None)
        described: dict[str, Any] = {}
        if callable(warm):
            warm(wait=True)
            described = warm(wait=True)
        return {"codec": st.settings.host_codec, "host": described}

    @rpc
    def hotswap_bench_variant(self, name: str) -> dict[str, Any]:
        """Bench-only, awake: `storagepass` adds back the prepare's per-storage eager pass
        over every byte beside the kernel's baseline (what the code did before the kernel
        read each storage as its own range); `rebuild` builds and proves the kernel check
        anew in every prepare (what the code did before checks were kept for their ranges);
        `kvlate` the fused sleep's KV cache released after its prepare (the tuning's
        `kv_early` off, as before the KV cache first); `share50` / `share70` / `share100`
        the fused sleep's first stage of copies at 50% / 70% of the weights' bytes / all
        of them (the tuning's `sleep_stage_share`, 30% by default); `kvthread` the KV
        records released first, and after the prepare the discarded pools, on threads of
        their own (the tuning's `kv_thread`, off by default); `freelater` the KV and graph
        pools' records' memory freed as their exported descriptors close on a thread (the
        tuning's `free_later`, off by default); `freelater50` that with the first stage at
        50%; `base` the code as it is: before/after on one engine."""
        import dataclasses

        if name not in VARIANTS:
            raise ValueError(f"variant {name!r}: expected one of {sorted(VARIANTS)}")
        fingerprint.Plan.baseline = VARIANTS[name]  # type: ignore[method-assign,assignment]
        st = self._hotswap_state()
        share = SHARES.get(name, Tuning().sleep_stage_share)
        thread = Tuning().kv_thread or name == "kvthread"
        later = Tuning().free_later or name.startswith("freelater")
        tuning = dataclasses.replace(
            st.settings.tuning,
            kv_early=name != "kvlate",
            sleep_stage_share=share,
            kv_thread=thread,
            free_later=later,
        )
        st.use_settings(dataclasses.replace(st.settings, tuning=tuning))
        return {
            "variant": name,
            "kv_early": tuning.kv_early,
            "sleep_stage_share": share,
            "kv_thread": thread,
            "free_later": later,
        }


_BASELINE = fingerprint.Plan.baseline


def _with_storage_pass(plan: fingerprint.Plan) -> fingerprint.Baseline:
    base = _BASELINE(plan)
    fingerprint._run_items(plan._items)  # the pass, read and thrown away
    return base


def _rebuilt(plan: fingerprint.Plan) -> fingerprint.Baseline:
    fingerprint.forget_checks()  # no check kept: this one is built and proven anew
    return _BASELINE(plan)


VARIANTS = {
    "base": _BASELINE,
    "storagepass": _with_storage_pass,
    "rebuild": _rebuilt,
    "kvlate": _BASELINE,
    "share50": _BASELINE,
    "share70": _BASELINE,
    "share100": _BASELINE,
    "kvthread": _BASELINE,
    "freelater": _BASELINE,
    "freelater50": _BASELINE,
}
SHARES = {
    "share50": 0.5,
    "share70": 0.7,
    "share100": 1.0,
    "freelater50": 0.5,
}  # the fused sleep's first stage, by variant
