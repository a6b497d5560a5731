"""What every part of the extension stands on: the rank's state (made at its first RPC),
the backend it drives, the model's tensors, and the test seams."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from worker_ext import ownership, snapshot, vllmcompat
from worker_ext.barrier import Quiescer
from worker_ext.hostpools import HostBackend
from worker_ext.phase import RankPhase
from worker_ext.pools import PoolBackend
from worker_ext.settings import WorkerSettings


@dataclass
class HotswapState:
    settings: WorkerSettings
    backend: PoolBackend
    quiescer: Quiescer = field(default_factory=Quiescer)
    snap: snapshot.Snapshot | None = None
    level: int | None = None
    phase: RankPhase = field(default_factory=RankPhase)
    # The prepare run once ahead of time (HOTSWAP_WARM_PREPARE): its outcome, None until then.
    warm_prepare: dict[str, Any] | None = None
    # The KV records the last prepare's range plan protects nothing in, for the KV records
    # it saw: ((start, end) of each KV record, addresses of those releasable first).
    kv_droppable: tuple[tuple[tuple[int, int], ...], tuple[int, ...]] | None = None

    def use_settings(self, settings: WorkerSettings) -> None:
        """Tests and benches that change a variable in a live worker: the new settings."""
        self.settings = self.backend.settings = settings


def cumem_active() -> bool:
    """CUDA with vLLM's CuMemAllocator holding allocations (started with sleep mode)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except Exception:
        return False
    inst = getattr(CuMemAllocator, "instance", None)
    return inst is not None and bool(getattr(inst, "pointer_to_data", None))


def mem_value(mem: dict[str, int]) -> int:
    return int(mem.get("free", mem.get("rss", 0)))


class ExtensionBase:
    """Mixed into vLLM's Worker with the RPC parts; `self` is the Worker (model_runner,
    rank, reload_weights). `__init__` never runs, so the state is made at first use."""

    # Set on the Worker by _hotswap_state(); a class default keeps reads safe before that.
    _hotswap_st: HotswapState | None = None

    def _hotswap_state(self) -> HotswapState:
        st = self._hotswap_st
        if st is None:
            vllmcompat.require()  # an untested vLLM: every RPC answers why (contracts §1.6)
            settings = WorkerSettings.from_env()  # read once for this worker's life
            st = HotswapState(settings, self._hotswap_make_backend(settings))
            self._hotswap_st = st
        return st

    def _hotswap_make_backend(self, settings: WorkerSettings) -> PoolBackend:
        if torch.cuda.is_available():
            if not cumem_active():
                raise RuntimeError(
                    "CUDA worker without an active CuMemAllocator: start vLLM with "
                    "--enable-sleep-mode"
                )
            from worker_ext.cumem import CuMemBackend  # CUDA only: vLLM's allocator

            return CuMemBackend(self, settings)
        return HostBackend(self, settings)

    def _hotswap_model(self) -> Any:
        runner = cast(Any, self).model_runner
        return runner.get_model() if runner is not None else None

    def _hotswap_records(self) -> list[ownership.TensorRecord]:
        return ownership.walk(self._hotswap_model(), cast(Any, self).model_runner)

    @contextlib.contextmanager
    def _hotswap_step(self, step: str) -> Iterator[RankPhase]:
        """A memory step under way: any error inside it leaves the rank failed."""
        ph = self._hotswap_state().phase
        try:
            yield ph
        except BaseException as e:
            ph.failed(f"{step}: {type(e).__name__}: {e}")
            raise

    def _hotswap_demotable(self, snap: snapshot.Snapshot) -> bool:
        """hotswap_demote can follow a sleep on this snapshot: asleep at level 1, and where
        the backend maps in place, with the level-2 protection by range held."""
        b = self._hotswap_state().backend
        if snap.level != 1 or not callable(getattr(b, "demote", None)):
            return False
        if not b.in_place:
            return True  # the host backend copies the at-risk tensors when it demotes
        return snap.protection is not None and snap.protection.level >= 2

    def _hotswap_fault(self, point: str) -> None:
        """Test seam: subclasses raise here to prove failures stay inside the RPC."""

    def _hotswap_before_barrier(self) -> None:
        """Test seam: subclasses delay here to hold a rank past the barrier timeout."""

    def _hotswap_before_verify(self) -> None:
        """Test seam: between the write-back and the fingerprints (a corruption there must
        fail the wake)."""
