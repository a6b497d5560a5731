"""worker_ext.graphpool: vLLM's global CUDA-graph pool made a CuMem pool on a CUDA rank with
sleep mode at world size 1, and left vLLM's (with the reason) everywhere else; a fake
platform and a fake CuMemAllocator stand in for CUDA."""

from __future__ import annotations

import sys
import types
from typing import Any

import pytest

from worker_ext import graphpool


class _Platform:
    _global_graph_pool: Any = None
    handles = 0

    def is_cuda(self) -> bool:
        return True

    def graph_pool_handle(self) -> Any:
        type(self).handles += 1
        return ("torch", type(self).handles)

    def get_global_graph_pool(self) -> Any:  # vLLM 0.26's own
        if type(self)._global_graph_pool is None:
            type(self)._global_graph_pool = self.graph_pool_handle()
        return type(self)._global_graph_pool


@pytest.fixture
def platform(monkeypatch: pytest.MonkeyPatch) -> _Platform:
    cls = type("CudaPlatform", (_Platform,), {"_global_graph_pool": None, "handles": 0})
    plat = cls()
    monkeypatch.setitem(sys.modules, "vllm.platforms", types.SimpleNamespace(current_platform=plat))
    monkeypatch.setattr(
        graphpool, "_STATE", {"pool": "unasked", "reason": None, "installed": False}
    )
    return plat


def test_the_first_ask_gets_the_cumem_pool_once(
    platform: _Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    made: list[int] = []
    monkeypatch.setattr(graphpool, "make_pool", lambda: (made.append(1), (("cumem", 7), None))[1])
    assert graphpool.describe()["pool"] == "unasked"
    assert graphpool.install()
    assert graphpool.install()
    assert platform.get_global_graph_pool() == ("cumem", 7)
    assert platform.get_global_graph_pool() == ("cumem", 7)
    assert made == [1]
    assert graphpool.describe() == {"pool": "cumem", "reason": None, "installed": True}


def test_where_it_cannot_be_done_vllms_pool_is_used_and_why_is_said(
    platform: _Platform, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(graphpool, "make_pool", lambda: (None, "HOTSWAP_GRAPH_POOL=keep"))
    graphpool.install()
    assert platform.get_global_graph_pool() == ("torch", 1)
    assert graphpool.describe()["pool"] == "vllm"
    assert graphpool.describe()["reason"] == "HOTSWAP_GRAPH_POOL=keep"


def test_nothing_is_installed_without_a_cuda_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "vllm.platforms", raising=False)
    assert graphpool.install() is False
    cpu = types.SimpleNamespace(is_cuda=lambda: False)
    monkeypatch.setitem(sys.modules, "vllm.platforms", types.SimpleNamespace(current_platform=cpu))
    assert graphpool.install() is False


class _Alloc:
    def __init__(self) -> None:
        self.allocator_and_pools: dict[str, Any] = {}
        self.python_malloc_callback = object()
        self.python_free_callback = object()


def _fake_cumem(monkeypatch: pytest.MonkeyPatch, alloc: _Alloc | None) -> None:
    from vllm.device_allocator import cumem

    monkeypatch.setattr(cumem, "cumem_available", True, raising=False)
    monkeypatch.setattr(cumem.CuMemAllocator, "instance", alloc)


def test_the_pool_is_refused_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_GRAPH_POOL", "keep")
    assert graphpool.make_pool() == (None, "HOTSWAP_GRAPH_POOL=keep")
    monkeypatch.delenv("HOTSWAP_GRAPH_POOL")
    _fake_cumem(monkeypatch, None)
    assert graphpool.make_pool() == (None, "no CuMemAllocator in this process (sleep mode off)")
    alloc = _Alloc()
    _fake_cumem(monkeypatch, alloc)  # type: ignore[arg-type]
    monkeypatch.setattr(graphpool, "_in_worker", lambda: False)
    assert graphpool.make_pool() == (None, "the extension is not in this process's vLLM worker")
    monkeypatch.setattr(graphpool, "_in_worker", lambda: True)
    monkeypatch.setattr(graphpool, "_world_size", lambda: 2)
    pool, why = graphpool.make_pool()
    assert pool is None
    assert why is not None
    assert why.startswith("world size 2")
    assert alloc.allocator_and_pools == {}


def test_the_pools_segments_are_read_from_its_snapshot() -> None:
    class Pool:
        def snapshot(self) -> list[dict[str, int]]:
            return [{"address": 4096}, {"address": 8192}]

    alloc = _Alloc()
    assert graphpool.pool_segments(alloc) is None
    alloc.allocator_and_pools["cudagraph"] = (Pool(), None)
    assert graphpool.pool_segments(alloc) == frozenset({4096, 8192})
    assert graphpool.pool_segments(object()) is None


def test_only_a_worker_with_the_extension_takes_the_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM mixes the extension into its Worker class (`--worker-extension-cls`), or the
    worker is `HotSwapWorker`; a process that only imported the package keeps vLLM's pool."""
    from worker_ext.extension.hotswap import HotSwapExtension

    worker = type("Worker", (), {})
    fake = types.SimpleNamespace(Worker=worker)
    monkeypatch.setitem(sys.modules, "vllm.v1.worker.gpu_worker", fake)
    assert graphpool._in_worker() is False
    keep = type("HotSwapWorker", (worker, HotSwapExtension), {})  # a subclass, as sleepworker's
    assert graphpool._in_worker() is True
    del keep
    fake.Worker = type("Worker", (HotSwapExtension,), {})  # the mixin, as vLLM's injection
    assert graphpool._in_worker() is True
