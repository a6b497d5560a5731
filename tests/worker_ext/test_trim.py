"""worker_ext.trim: the compile-worker pool goes at the first sleep, and a later compile
could start a new one (torch's own shutdown clears its cache)."""

from __future__ import annotations

import sys
import types

import pytest

from worker_ext import trim


def test_no_inductor_loaded_is_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch._inductor.async_compile", raising=False)
    assert trim.release_compile_workers() == 0


def test_the_pools_are_shut_down_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("torch._inductor.async_compile")
    shut: list[int] = []
    fake._pool_set = {object(), object()}  # type: ignore[attr-defined]

    def shutdown() -> None:
        shut.append(len(fake._pool_set))  # type: ignore[attr-defined]
        fake._pool_set.clear()  # type: ignore[attr-defined]

    fake.shutdown_compile_workers = shutdown  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", fake)
    assert trim.release_compile_workers() == 2
    assert trim.release_compile_workers() == 0  # the next sleep pays nothing
    assert shut == [2]


class FakeLibc:
    def __init__(self, gives_back: int) -> None:
        self.calls: list[int] = []
        self.gives_back = gives_back

    def malloc_trim(self, pad: int) -> int:
        self.calls.append(pad)
        return self.gives_back


def test_a_sleep_hands_back_pinned_blocks_and_the_heaps_free_pages() -> None:
    emptied: list[str] = []
    torch = types.SimpleNamespace(
        _C=types.SimpleNamespace(_host_emptyCache=lambda: emptied.append("x"))
    )
    libc = FakeLibc(1)
    out = trim.release_host_memory(torch, libc)
    assert emptied == ["x"]
    assert libc.calls == [0]
    assert out["pinned_cache"] is True
    assert out["malloc_trim"] is True
    assert "error" not in out
    assert out["s"] >= 0


def test_what_is_not_there_is_skipped_and_a_failure_never_raises() -> None:
    bare = trim.release_host_memory(types.SimpleNamespace(_C=object()), object())
    assert bare["pinned_cache"] is None
    assert bare["malloc_trim"] is None
    assert "error" not in bare

    def boom() -> None:
        raise RuntimeError("no CUDA")

    libc = FakeLibc(0)
    out = trim.release_host_memory(
        types.SimpleNamespace(_C=types.SimpleNamespace(_host_emptyCache=boom)), libc
    )
    assert "pinned_cache: RuntimeError: no CUDA" in out["error"]
    assert libc.calls == [0]  # the heap is still trimmed
    assert out["malloc_trim"] is False


def test_this_process_heap_is_trimmed_for_real() -> None:
    out = trim.release_host_memory()
    assert out["malloc_trim"] in (True, False)  # glibc here: the call was made
    assert "error" not in out


def test_the_heap_after_the_trim_is_reported() -> None:
    """glibc's mallinfo2 after the trim: in use (small chunks plus those mapped on their
    own) and free (kept by the allocator); null where the C library has none."""
    import ctypes

    libc = ctypes.CDLL(None)
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    before = trim.heap(libc)
    assert before is not None  # glibc >= 2.33 here
    # Counted in use whether glibc maps the block on its own or carves it from the heap
    # (which one depends on its threshold, which other code in the process may move).
    block = libc.malloc(64 << 20)
    assert block
    try:
        during = trim.heap(libc)
        assert during is not None
        assert during["in_use"] >= before["in_use"] + (64 << 20)
    finally:
        libc.free(block)
    out = trim.release_host_memory(types.SimpleNamespace(), ctypes.CDLL(None))
    assert set(out["heap"]) == {"arena", "mmap", "in_use", "free"}
    assert trim.release_host_memory(types.SimpleNamespace(), FakeLibc(0))["heap"] is None
