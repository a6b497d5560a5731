"""HotSwapExtension: the hotswap_* RPC methods vLLM mixes into every worker.

Rules this class lives by (docs/contracts.md §1):
- every name starts with `hotswap_`/`_hotswap_` (a name the Worker already has aborts start);
- every method returns one plain dict (`ok`, `rank`, `elapsed_s`, `error` when not ok) and
  never raises: with TP>1 a raise desyncs vLLM's reply queues;
- `__init__` never runs (vLLM 0.26/0.32 mix the class into the Worker's bases), so the
  state is created lazily on first use.
"""

from __future__ import annotations

import time
from typing import Any, cast

import torch

from worker_ext import graphpool, vllmcompat
from worker_ext.extension.base import ExtensionBase
from worker_ext.extension.hostmem import HostMemoryRPCs
from worker_ext.extension.rpc import log, plain, rank_of, rpc
from worker_ext.extension.sleeping import SleepRPCs
from worker_ext.extension.waking import WakeRPCs
from worker_ext.pools import KV_CACHE


class HotSwapExtension(SleepRPCs, WakeRPCs, HostMemoryRPCs, ExtensionBase):
    """Mixed into vLLM's Worker; `self` is the Worker (model_runner, rank, reload_weights)."""

    @rpc
    def hotswap_info(self) -> dict[str, Any]:
        self._hotswap_fault("info")
        st = self._hotswap_state()
        self._hotswap_warm_prepare()
        model = self._hotswap_model()
        try:
            from vllm.distributed.parallel_state import get_world_group

            world_size = int(get_world_group().world_size)
        except Exception:
            world_size = int(getattr(cast(Any, self).parallel_config, "world_size", 1))
        return {
            "world_size": world_size,
            "platform": "cuda" if torch.cuda.is_available() else "cpu",
            "backend": st.backend.name,
            "vllm_version": vllmcompat.vllm_version(),
            "model": type(model).__name__ if model is not None else None,
            # the name it serves (vLLM's model_config): the sidecar checks it is its model's
            "served_model_name": _served_name(getattr(self, "model_config", None)),
            "pools": st.backend.pools(),
            "device_memory": st.backend.memory(),
            "suspended": st.backend.suspended(),
            "allocator_asleep": vllmcompat.allocator_asleep(),  # vLLM's own sleep shows here
            "vllm_sleep": vllmcompat.vllm_sleep(self),  # vLLM's sleep through our backend
            "resident": st.backend.resident(),
            "graph_pool": graphpool.describe(),
            "level": st.level,
            "poisoned": st.quiescer.poisoned,
            **st.phase.report(),
            "snapshot_held": st.snap is not None,
            "host_backup_bytes": st.backend.host_backup_bytes(),
            "wake_scratch_bytes": st.backend.wake_scratch_bytes(),
            "warm_prepare": st.warm_prepare,
            # the cumem backend's host buffer, verify kernel and mapping (plain values)
            "backend_detail": st.backend.describe(),
        }

    def _hotswap_warm_prepare(self) -> None:
        """Once per process, on an awake rank with no snapshot: a level-1 prepare whose
        snapshot is dropped at once, so that its first-call costs (allocator blocks, pinned
        host blocks, kernel variants for these tensors) are paid here and not by the first
        sleep. It moves no memory and changes neither phase nor transitions; a failure is
        only reported (`warm_prepare` in hotswap_info)."""
        st = self._hotswap_state()
        if not st.settings.warm_prepare or st.warm_prepare is not None:
            return
        if st.snap is not None or st.backend.suspended() or self._hotswap_model() is None:
            return
        t0 = time.perf_counter()
        try:
            snap, _cover, _at_risk, _timings = self._hotswap_take_snapshot(1, keep=False)
            st.warm_prepare = {
                "ok": True,
                "s": time.perf_counter() - t0,
                "fingerprinted": len(snap.entries) + len(snap.unnamed),
            }
            del snap
        except Exception as exc:  # reported, never raised: the real prepare will say more
            log.warning("hotswap: the prepare ahead of time failed: %s", exc)
            st.warm_prepare = {
                "ok": False,
                "s": time.perf_counter() - t0,
                "error": f"{type(exc).__name__}: {exc}",
            }

    @rpc
    def hotswap_quiesce(self, timeout_s: float) -> dict[str, Any]:
        self._hotswap_fault("quiesce")
        st = self._hotswap_state()
        return st.quiescer.run(
            float(timeout_s), rank_of(self), before_barrier=self._hotswap_before_barrier
        )


__all__ = ["KV_CACHE", "HotSwapExtension", "plain", "rpc"]


def _served_name(model_config: Any) -> str | None:
    """vLLM's `served_model_name` (a string, or the first of a list), else None."""
    name = getattr(model_config, "served_model_name", None)
    if isinstance(name, list | tuple):
        name = name[0] if name else None
    return name if isinstance(name, str) and name else None
