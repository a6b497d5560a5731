"""The CUDA backend (worker_ext.cumem) over a fake device: the allocator's records are host
memory, the copies are memmoves, a release and a fresh mapping scribble over a record.

The raw copy path's bookkeeping (the host buffer's layout, each record's `is_asleep`, the
levels, a kept KV cache, the prepare run under the copies, a demotion) is checked on CPU;
the copies' speed and the coded path are the GPU suite's (tests/gpu)."""

from __future__ import annotations

import ctypes
import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from support.fds import fd_closed

from worker_ext.cudart import CudaRT
from worker_ext.cudriver import Driver, DriverError
from worker_ext.settings import Tuning, WorkerSettings

RELEASED, MAPPED = 0xEE, 0xDD  # what a released record, then a fresh mapping, holds


class _Event:
    def record(self, _stream: Any = None) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, _other: Any) -> float:
        return 0.0


class _Stream:
    cuda_stream = 7

    def __init__(self, *_a: Any, **_k: Any) -> None:
        pass

    def wait_stream(self, _other: Any) -> None:
        pass

    def wait_event(self, _ev: Any) -> None:
        pass

    def record_event(self, ev: Any = None) -> Any:
        return ev if ev is not None else _Event()

    def synchronize(self) -> None:
        pass


@dataclasses.dataclass
class _Record:
    tag: str
    handle: tuple[int, int, int, int]
    is_asleep: bool = False


class _Allocator:
    def __init__(self) -> None:
        self.pointer_to_data: dict[int, _Record] = {}
        self._keep: list[Any] = []

    def add(self, tag: str, data: bytes) -> int:
        buf = ctypes.create_string_buffer(data, len(data))
        self._keep.append(buf)
        ptr = ctypes.addressof(buf)
        self.pointer_to_data[ptr] = _Record(tag, (0, len(data), ptr, 0))
        return ptr

    def read(self, ptr: int) -> bytes:
        return ctypes.string_at(ptr, self.pointer_to_data[ptr].handle[1])


def _scribble(handle: tuple[int, int, int, int], value: int) -> None:
    ctypes.memset(handle[2], value, handle[1])


class _Worker:
    device = torch.device("cuda", 0)


@pytest.fixture
def alloc(monkeypatch: pytest.MonkeyPatch) -> _Allocator:
    """vLLM's allocator, the CUDA runtime, the driver and torch.cuda, faked."""
    from vllm.device_allocator import cumem as vllm_cumem

    fake = _Allocator()
    monkeypatch.setattr(vllm_cumem.CuMemAllocator, "get_instance", staticmethod(lambda: fake))
    monkeypatch.setattr(vllm_cumem, "unmap_and_release", lambda h: _scribble(h, RELEASED))

    def rt_init(self: CudaRT, path: str | None = None) -> None:
        pass

    monkeypatch.setattr(CudaRT, "__init__", rt_init)
    monkeypatch.setattr(
        CudaRT, "memcpy_async", lambda _s, dst, src, n, _st: ctypes.memmove(dst, src, n)
    )
    for name in ("host_register", "host_unregister", "set_device"):
        monkeypatch.setattr(CudaRT, name, lambda *_a: None)

    def drv_init(self: Driver, device: int, exportable: bool = True, **_k: Any) -> None:
        self.fabric_refused, self.rdma, self.spent = False, False, {}
        self.imported = self.import_refused = 0
        self.kept = {}

    monkeypatch.setattr(Driver, "__init__", drv_init)
    monkeypatch.setattr(Driver, "handle_type", property(lambda _s: "posix_fd"))
    monkeypatch.setattr(Driver, "create_and_map", lambda _s, h, lent=None: _scribble(h, MAPPED))
    monkeypatch.setattr(Driver, "take_spent", lambda _s: {})
    cuda = torch.cuda
    monkeypatch.setattr(cuda, "Stream", _Stream)
    monkeypatch.setattr(cuda, "Event", lambda **_k: _Event())
    monkeypatch.setattr(cuda, "current_stream", lambda *_a: _Stream())
    monkeypatch.setattr(cuda, "synchronize", lambda *_a: None)
    monkeypatch.setattr(cuda, "mem_get_info", lambda *_a: (1 << 30, 2 << 30))
    monkeypatch.setattr(cuda, "memory_snapshot", lambda: [])
    monkeypatch.setattr(cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(cuda, "current_device", lambda: 0)
    return fake


def _backend(alloc: _Allocator, **tuning: Any) -> Any:
    from worker_ext.cumem import CuMemBackend

    settings = WorkerSettings(host_codec="none", verify_kernel="off", tuning=Tuning(**tuning))
    return CuMemBackend(_Worker(), settings)


def _model(alloc: _Allocator) -> dict[int, bytes]:
    """Two weights records and two KV records, each of its own bytes."""
    out = {}
    for i, (tag, n) in enumerate([("weights", 4096), ("weights", 1000), ("kv_cache", 512)]):
        data = bytes((i * 31 + j) % 251 for j in range(n))
        out[alloc.add(tag, data)] = data
    out[alloc.add("kv_cache", b"\x05" * 300)] = b"\x05" * 300
    return out


def _tags(alloc: _Allocator, tag: str) -> list[int]:
    return sorted(p for p, d in alloc.pointer_to_data.items() if d.tag == tag)


def test_a_level1_sleep_brings_the_weights_back_and_discards_the_kv_cache(
    alloc: _Allocator,
) -> None:
    before = _model(alloc)
    b = _backend(alloc)
    assert b.pools() == {"weights": 5096, "kv_cache": 812}
    r = b.suspend(1, ["weights", "kv_cache"])
    assert r["freed_bytes"] == {"weights": 5096, "kv_cache": 812}
    assert r["offloaded_bytes"] == {"weights": 5096, "kv_cache": 0}
    assert b.suspended() == {"weights": "offloaded", "kv_cache": "discarded"}
    assert all(d.is_asleep for d in alloc.pointer_to_data.values())
    assert all(alloc.read(p) == bytes([RELEASED]) * len(v) for p, v in before.items())
    assert b.host_backup_bytes() == 5096
    w = b.resume(["weights"])
    k = b.resume(["kv_cache"])
    b.synchronize()
    assert (w["restored_bytes"], k["restored_bytes"]) == ({"weights": 5096}, {"kv_cache": 812})
    for p in _tags(alloc, "weights"):
        assert alloc.read(p) == before[p]
    for p in _tags(alloc, "kv_cache"):
        assert alloc.read(p) == bytes([MAPPED]) * len(before[p])  # mapped fresh, not copied
    assert not any(d.is_asleep for d in alloc.pointer_to_data.values())
    assert b.suspended() == {}
    assert b.host_backup_bytes() == 5096  # kept for the next sleep


def test_a_discarded_pool_is_mapped_before_the_earlier_copies_are_waited_for(
    alloc: _Allocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An overlapped swap's last resume: the KV cache comes back without a copy, so it is
    mapped while the weights' copies (queued by the resume before) still run, and those
    are waited for after it, in the same call; a pool with copies of its own waits first."""
    _model(alloc)
    b = _backend(alloc)
    b.suspend(1, ["weights", "kv_cache"])
    order: list[str] = []
    monkeypatch.setattr(
        Driver,
        "create_and_map",
        lambda _s, h, lent=None: (order.append("map"), _scribble(h, MAPPED)),
    )
    monkeypatch.setattr(_Stream, "synchronize", lambda _s: order.append("wait"))
    b.resume(["weights"])
    assert order == ["map", "map"]  # the weights' copies queued, not waited for
    order.clear()
    k = b.resume(["kv_cache"])
    assert order[:2] == ["map", "map"], order
    assert "wait" in order[2:], order
    assert "wait_copies_s" in k["timings"]
    assert b.last_dma_s is not None
    b.suspend(1, ["weights", "kv_cache"])
    order.clear()
    b._streams._pending = b._streams.all()  # an earlier resume's copies still in flight
    b.resume(["weights"])
    assert order[0] == "wait", order  # copies of its own: the earlier ones first


def test_a_kept_kv_cache_comes_back_from_its_own_buffer(alloc: _Allocator) -> None:
    before = _model(alloc)
    b = _backend(alloc)
    assert b.kv_keep_refusal() is None
    b.prepare_kv_keep()
    r = b.suspend(1, ["weights", "kv_cache"], keep_kv=True)
    assert r["offloaded_bytes"] == {"weights": 5096, "kv_cache": 812}
    assert r["kv_host_backup_bytes"] == 812
    assert b.demote_refusal() == "demote: the KV cache is kept (offloaded) across this sleep"
    b.resume(["weights", "kv_cache"])
    b.synchronize()
    assert all(alloc.read(p) == v for p, v in before.items())


def test_a_level2_sleep_copies_nothing(alloc: _Allocator) -> None:
    _model(alloc)
    b = _backend(alloc, pin_early=False)
    r = b.suspend(2, ["weights", "kv_cache"])
    assert r["offloaded_bytes"] == {"weights": 0, "kv_cache": 0}
    assert b.suspended() == {"weights": "discarded", "kv_cache": "discarded"}
    assert b.host_backup_bytes() == 0
    assert b.wake_scratch_bytes() == 0
    b.resume(["weights", "kv_cache"])
    assert all(
        alloc.read(p) == bytes([MAPPED]) * d.handle[1] for p, d in alloc.pointer_to_data.items()
    )


def test_the_prepare_runs_under_the_copies_and_a_failed_one_releases_nothing(
    alloc: _Allocator,
) -> None:
    before = _model(alloc)
    b = _backend(alloc)
    seen: list[bool] = []

    def failing(go_on: Callable[[], None]) -> list[tuple[int, int]]:
        go_on()
        raise RuntimeError("the prepare failed")

    with pytest.raises(RuntimeError, match="the prepare failed"):
        b.suspend(1, ["weights", "kv_cache"], during=failing)
    assert b.suspended() == {}
    assert not any(d.is_asleep for d in alloc.pointer_to_data.values())
    assert all(alloc.read(p) == v for p, v in before.items())

    def prepare(go_on: Callable[[], None]) -> list[tuple[int, int]]:
        seen.append(any(d.is_asleep for d in alloc.pointer_to_data.values()))
        go_on()
        return []

    r = b.suspend(1, ["weights", "kv_cache"], during=prepare)
    assert seen == [False]  # nothing released while the prepare ran
    assert r["overlapped"] is True
    assert "prepare_under_copies_s" in r["timings"]
    assert r["timings"]["link_s"] >= 0  # the copies' own time on the GPU, by their events
    assert r["timings"]["at_link_done_s"] >= 0
    b.resume(["weights", "kv_cache"])
    b.synchronize()
    for p in _tags(alloc, "weights"):
        assert alloc.read(p) == before[p]


def test_a_demoted_sleep_wakes_without_a_copy(alloc: _Allocator) -> None:
    _model(alloc)
    b = _backend(alloc)
    with pytest.raises(RuntimeError, match="not offloaded at level 1"):
        b.demote()
    b.suspend(1, ["weights", "kv_cache"])
    out = b.demote()
    assert out["freed_bytes"] == {"weights": 5096}
    assert b.suspended() == {"weights": "discarded", "kv_cache": "discarded"}
    assert b.host_backup_bytes() == 0
    b.resume(["weights", "kv_cache"])
    for p in _tags(alloc, "weights"):
        assert alloc.read(p) == bytes([MAPPED]) * alloc.pointer_to_data[p].handle[1]


def test_drop_backup_frees_the_kept_buffers_only_while_awake(alloc: _Allocator) -> None:
    _model(alloc)
    b = _backend(alloc)
    b.suspend(1, ["weights"])
    with pytest.raises(RuntimeError, match="pools asleep"):
        b.drop_backup()
    b.resume(["weights"])
    assert b.drop_backup() == {"weights": 5096, "kv_cache": 0}
    assert b.host_backup_bytes() == 0


def test_a_level2_sleep_frees_the_kept_host_buffer(alloc: _Allocator) -> None:
    """The pinned buffer kept from a level-1 cycle for the next sleep goes at a level-2
    sleep (it holds nothing a level-2 wake reads); the next level-1 sleep pins anew."""
    _model(alloc)
    b = _backend(alloc)
    b.suspend(1, ["weights", "kv_cache"])
    b.resume(["weights", "kv_cache"])
    b.synchronize()
    assert b.host_backup_bytes() == 5096  # kept for the next sleep
    r = b.suspend(2, ["weights", "kv_cache"])
    assert b.host_backup_bytes() == 0
    assert r["host_backup_bytes"] == 0
    b.resume(["weights", "kv_cache"])
    b.suspend(1, ["weights", "kv_cache"])
    assert b.host_backup_bytes() == 5096


def test_refusals_leave_everything_as_it_was(alloc: _Allocator) -> None:
    _model(alloc)
    b = _backend(alloc)
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        b.suspend(3, ["weights"])
    with pytest.raises(ValueError, match="non-empty subset"):
        b.suspend(1, ["lora"])
    with pytest.raises(ValueError, match="unknown tags"):
        b.resume(["lora"])
    b.suspend(1, ["weights"])
    with pytest.raises(RuntimeError, match="already suspended"):
        b.suspend(1, ["weights"])
    assert b.suspended() == {"weights": "offloaded"}


def test_tag_of_finds_a_record_by_address(alloc: _Allocator) -> None:
    _model(alloc)
    b = _backend(alloc)
    w = next(p for p in _tags(alloc, "weights") if alloc.pointer_to_data[p].handle[1] == 4096)
    assert b.tag_of(w + 10, 100) == "weights"
    assert b.tag_of(w + 4000, 200) == "unpooled"  # runs past the record's end
    assert [t for _s, _e, t in b.records()].count("kv_cache") == 2
    info = b.describe()
    assert (info["records"], info["codec"]["setting"], info["map"]["impl"]) == (4, "none", "driver")


class _Recorder:
    """A CudaRT whose copies are only written down: (dst, src, n, stream)."""

    def __init__(self) -> None:
        self.copies: list[tuple[int, int, int, int]] = []

    def memcpy_async(self, dst: int, src: int, n: int, stream: int) -> None:
        self.copies.append((dst, src, n, stream))

    def set_device(self, index: int) -> None:
        pass


class _NumberedStream(_Stream):
    def __init__(self, number: int) -> None:
        self.cuda_stream = number


def test_raw_copies_never_cross_a_chunk_of_the_host_buffer() -> None:
    """A record's copies are cut where the host offset crosses a CHUNK_BYTES multiple (so
    none spans two registrations) and taken by the streams in turn."""
    from worker_ext.cudart import CHUNK_BYTES
    from worker_ext.cumem.streams import CopyStreams

    rt = _Recorder()
    streams = CopyStreams(torch, None, rt)  # type: ignore[arg-type]
    streams._streams = [_NumberedStream(1), _NumberedStream(2)]
    dev, host, off = 10_000, 1 << 40, CHUNK_BYTES - 100
    k = streams.queue(dev, host, off, CHUNK_BYTES + 300, True, 1)
    assert k == 4
    assert rt.copies == [
        (host + off, dev, 100, 2),
        (host + CHUNK_BYTES, dev + 100, CHUNK_BYTES, 1),
        (host + 2 * CHUNK_BYTES, dev + 100 + CHUNK_BYTES, 200, 2),
    ]
    rt.copies.clear()
    streams.queue(dev, host, 0, 50, False, 0)
    assert rt.copies == [(dev, host, 50, 1)]  # back to the device: the other direction


def test_the_codecs_copies_never_cross_a_registration() -> None:
    from worker_ext.cudart import REGISTER_BYTES
    from worker_ext.cumem.streams import CopyStreams

    rt = _Recorder()
    copy = CopyStreams(torch, None, rt).copier(0)  # type: ignore[arg-type]
    copy(REGISTER_BYTES - 8, 500, 24, True, 3)
    assert rt.copies == [(REGISTER_BYTES - 8, 500, 8, 3), (REGISTER_BYTES, 508, 16, 3)]


def test_a_failed_pinning_is_reported_and_the_sleep_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The buffer's pinning fails: the error is kept for describe(), and the sleep that
    needs the buffer is refused with it instead of copying into nothing."""
    from worker_ext.cumem import hostbuf

    def refuse(self: Any, threads: int) -> float:
        raise OSError("cudaHostRegister: out of memory")

    monkeypatch.setattr(hostbuf.HostBuffer, "pin", refuse)
    rt = _Recorder()
    swaps: list[int] = []
    buf = hostbuf.Pinned("host backup buffer", rt, 0, lambda: 2, lambda: swaps.append(1))  # type: ignore[arg-type]
    buf.warm(4096, "test-pin")
    buf.join()
    assert buf.error == "OSError: cudaHostRegister: out of memory"
    assert (buf.state(), buf.nbytes) == ("none", 0)
    with pytest.raises(RuntimeError, match="no host backup buffer: OSError"):
        buf.take(4096)
    assert swaps  # whatever reads the buffer was waited for before the attempt


def test_kv_records_named_early_go_before_the_prepare_and_come_back_if_it_fails(
    alloc: _Allocator,
) -> None:
    """The KV cache first: the records in `early_kv` are released once the first copies are
    queued and before `during` runs, the others after it; a failed prepare maps them back
    (fresh memory), releases nothing else and raises again."""
    before = _model(alloc)
    kv = _tags(alloc, "kv_cache")
    b = _backend(alloc)
    seen: list[dict[int, bool]] = []

    def failing(go_on: Callable[[], None]) -> list[tuple[int, int]]:
        seen.append({p: d.is_asleep for p, d in alloc.pointer_to_data.items()})
        raise RuntimeError("the prepare failed")

    with pytest.raises(RuntimeError, match="the prepare failed"):
        b.suspend(1, ["weights", "kv_cache"], during=failing, early_kv=[kv[0]])
    assert [p for p, asleep in seen[0].items() if asleep] == [kv[0]]
    assert b.suspended() == {}
    assert not any(d.is_asleep for d in alloc.pointer_to_data.values())
    n = alloc.pointer_to_data[kv[0]].handle[1]
    assert alloc.read(kv[0]) == bytes([MAPPED]) * n  # mapped again: fresh memory
    assert all(alloc.read(p) == v for p, v in before.items() if p != kv[0])
    seen.clear()

    def prepare(go_on: Callable[[], None]) -> list[tuple[int, int]]:
        seen.append({p: d.is_asleep for p, d in alloc.pointer_to_data.items()})
        go_on()
        return []

    r = b.suspend(1, ["weights", "kv_cache"], during=prepare, early_kv=[kv[0]])
    assert [p for p, asleep in seen[0].items() if asleep] == [kv[0]]
    assert all(d.is_asleep for d in alloc.pointer_to_data.values())
    assert r["timings"]["kv_early_bytes"] == n
    assert r["timings"]["kv_early_records"] == 1
    assert r["timings"]["at_kv_early_s"] <= r["timings"]["at_prepared_s"]
    b.resume(["weights", "kv_cache"])
    b.synchronize()
    for p in _tags(alloc, "weights"):
        assert alloc.read(p) == before[p]


def _threaded_release(
    monkeypatch: pytest.MonkeyPatch,
    wait_for: threading.Event,
    fail: bool = False,
    waits: dict[int, threading.Event] | None = None,
) -> list[tuple[int, int, bool]]:
    """Driver.unmap_release faked: each call waits (bounded) for `wait_for` (or for the
    record's own event in `waits`), then scribbles the record (or raises, with `fail`);
    (record, thread, whether the event was set) per call."""
    calls: list[tuple[int, int, bool]] = []

    def unmap_release(_s: Driver, handle: Any) -> None:
        event = (waits or {}).get(handle[2], wait_for)
        calls.append((handle[2], threading.get_ident(), event.wait(5.0)))
        if fail:
            raise DriverError("cuMemUnmap: CUresult 1")
        _scribble(handle, RELEASED)

    monkeypatch.setattr(Driver, "unmap_release", unmap_release)
    monkeypatch.setattr(Driver, "bind_context", lambda _s: None)
    return calls


def test_kv_records_released_first_on_a_thread_of_their_own_run_beside_the_prepare(
    alloc: _Allocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tuning's kv_thread: the KV records named early are released on another thread
    through the driver (no GIL held), while the prepare runs: the release waits for the
    prepare to start and the prepare sees the record go; the rest of the KV cache goes
    after the prepare, on a thread too; the weights come back."""
    before = _model(alloc)
    kv = _tags(alloc, "kv_cache")
    started = threading.Event()
    calls = _threaded_release(monkeypatch, started)
    b = _backend(alloc, kv_thread=True)
    seen: list[bool] = []

    def prepare(go_on: Callable[[], None]) -> list[tuple[int, int]]:
        started.set()
        for _ in range(500):  # bounded: the thread releases the record meanwhile
            if alloc.pointer_to_data[kv[0]].is_asleep:
                break
            time.sleep(0.01)
        seen.append(alloc.pointer_to_data[kv[0]].is_asleep)
        seen.append(alloc.pointer_to_data[kv[1]].is_asleep)  # not named early: after
        go_on()
        return []

    r = b.suspend(1, ["weights", "kv_cache"], during=prepare, early_kv=[kv[0]])
    assert [(p, ok) for p, _t, ok in calls] == [(kv[0], True), (kv[1], True)]
    assert threading.get_ident() not in {t for _p, t, _ok in calls}
    assert seen == [True, False]
    assert all(d.is_asleep for d in alloc.pointer_to_data.values())
    n = alloc.pointer_to_data[kv[0]].handle[1]
    assert alloc.read(kv[0]) == bytes([RELEASED]) * n
    t = r["timings"]
    assert (t["kv_thread"], t["kv_early_records"], t["kv_early_bytes"]) == (1.0, 1.0, n)
    assert t["kv_join_wait_s"] >= 0
    assert t["discard_join_wait_s"] >= 0
    assert t["at_discarded_s"] <= t["at_released_s"]
    b.resume(["weights", "kv_cache"])
    b.synchronize()
    for p in _tags(alloc, "weights"):
        assert alloc.read(p) == before[p]


def test_the_discarded_pools_go_on_a_thread_beside_the_weights_releases(
    alloc: _Allocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tuning's kv_thread: once the prepare has ended, the KV records not released
    first are released on a thread while the suspend's thread releases the weights as
    their copies end: the KV record's release waits for a weights release (serially it
    would come first, and time out); the suspend answers once both are done."""
    from vllm.device_allocator import cumem as vllm_cumem

    _model(alloc)
    kv = _tags(alloc, "kv_cache")
    weights_gone = threading.Event()

    def release_weights(h: Any) -> None:
        _scribble(h, RELEASED)
        weights_gone.set()

    monkeypatch.setattr(vllm_cumem, "unmap_and_release", release_weights)
    calls = _threaded_release(monkeypatch, weights_gone)
    b = _backend(alloc, kv_thread=True)

    r = b.suspend(1, ["weights", "kv_cache"], during=_go_on)  # nothing released first
    assert [(p, ok) for p, _t, ok in calls] == [(kv[0], True), (kv[1], True)]
    assert threading.get_ident() not in {t for _p, t, _ok in calls}
    assert all(d.is_asleep for d in alloc.pointer_to_data.values())
    assert r["timings"]["kv_thread"] == 1.0
    assert "kv_join_wait_s" not in r["timings"]  # no KV record named early: no thread


def test_a_release_thread_without_a_device_context_releases_nothing_and_the_sleep_does(
    alloc: _Allocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kv_thread where a thread cannot bind the device's context: it releases nothing, and
    its records are released on the sleep's thread at the join (vLLM's release), the
    sleep whole; `release_thread_unbound` says so."""
    before = _model(alloc)
    kv = _tags(alloc, "kv_cache")
    calls = _threaded_release(monkeypatch, threading.Event())

    def unbound(_s: Driver) -> None:
        raise DriverError("cuCtxSetCurrent: CUresult 201")

    monkeypatch.setattr(Driver, "bind_context", unbound)
    b = _backend(alloc, kv_thread=True)

    r = b.suspend(1, ["weights", "kv_cache"], during=_go_on, early_kv=[kv[0]])
    assert calls == []  # nothing through the thread's driver
    assert all(d.is_asleep for d in alloc.pointer_to_data.values())
    assert all(alloc.read(p) == bytes([RELEASED]) * len(v) for p, v in before.items())
    t = r["timings"]
    assert t["release_thread_unbound"] == 1.0
    assert t["kv_early_records"] == 1.0
    b.resume(["weights", "kv_cache"])
    b.synchronize()
    for p in _tags(alloc, "weights"):
        assert alloc.read(p) == before[p]


def _go_on(go_on: Callable[[], None]) -> list[tuple[int, int]]:
    """A prepare that protects nothing: it lets the suspend go on at once."""
    go_on()
    return []


def _exports(monkeypatch: pytest.MonkeyPatch, refuse: set[int] | None = None) -> list[int]:
    """Driver.export_fd faked: a new descriptor per record (its memory kept alive while
    open), refused for the records in `refuse`; the descriptors handed out, in order."""
    fds: list[int] = []

    def export(_s: Driver, handle: Any) -> tuple[int, int]:
        if refuse and handle[2] in refuse:
            raise DriverError("cuMemExportToShareableHandle: CUresult 801")
        fds.append(os.dup(2))  # a new descriptor; closing it leaves stderr open
        return fds[-1], handle[1]

    monkeypatch.setattr(Driver, "export_fd", export)
    return fds


def test_free_later_releases_every_record_and_answers_once_every_descriptor_isfd_closed(
    alloc: _Allocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The tuning's free_later: each KV record the fused sleep releases (those released
    first, the rest of the pool) is exported first, released as usual, and its descriptor
    closed on another thread; the suspend answers once all are closed; a record that
    cannot be exported is released as usual; the weights are released as usual (many
    records for their bytes); the wake is whole."""
    before = _model(alloc)
    kv = _tags(alloc, "kv_cache")
    weights = _tags(alloc, "weights")
    alloc.add("kv_cache", b"\x07" * 200)  # a third KV record, whose export is refused
    kv3 = [p for p in _tags(alloc, "kv_cache") if p not in kv]
    before[kv3[0]] = b"\x07" * 200
    fds = _exports(monkeypatch, refuse=set(kv3))
    closer: list[tuple[int, int]] = []
    real_close = os.close

    def close(fd: int) -> None:
        closer.append((fd, threading.get_ident()))
        real_close(fd)

    monkeypatch.setattr(os, "close", close)
    b = _backend(alloc, free_later=True)

    r = b.suspend(1, ["weights", "kv_cache"], during=_go_on, early_kv=[kv[0]])
    monkeypatch.setattr(os, "close", real_close)
    assert len(fds) == 2  # the two exportable KV records; no weights record
    assert all(fd_closed(fd) for fd in fds)
    by = {t for fd, t in closer if fd in fds}
    assert by
    assert threading.get_ident() not in by  # closed on the closer thread
    assert all(d.is_asleep for d in alloc.pointer_to_data.values())
    assert all(alloc.read(p) == bytes([RELEASED]) * len(v) for p, v in before.items())
    t = r["timings"]
    assert (t["free_later"], t["free_later_records"], t["free_later_not_exported"]) == (
        1.0, 2.0, 1.0
    )  # fmt: skip
    assert t["free_later_wait_s"] >= 0
    assert t["kv_early_records"] == 1.0
    b.resume(["weights", "kv_cache"])
    b.synchronize()
    for p in weights:
        assert alloc.read(p) == before[p]


def test_free_later_frees_the_early_records_before_a_failed_prepare_maps_them_back(
    alloc: _Allocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """free_later and a failed prepare: the descriptors of the KV records released first
    are all closed (their memory free) before those records are mapped back, and nothing
    else is released."""
    _model(alloc)
    kv = _tags(alloc, "kv_cache")
    fds = _exports(monkeypatch)
    at_map: list[bool] = []

    def create_and_map(_s: Driver, h: Any, lent: Any = None) -> None:
        at_map.append(all(fd_closed(fd) for fd in fds))
        _scribble(h, MAPPED)

    monkeypatch.setattr(Driver, "create_and_map", create_and_map)
    b = _backend(alloc, free_later=True)

    def failing(go_on: Callable[[], None]) -> list[tuple[int, int]]:
        raise RuntimeError("the prepare failed")

    with pytest.raises(RuntimeError, match="the prepare failed"):
        b.suspend(1, ["weights", "kv_cache"], during=failing, early_kv=kv)
    assert len(fds) == 2
    assert at_map == [True, True]
    assert b.suspended() == {}
    assert not any(d.is_asleep for d in alloc.pointer_to_data.values())


def test_a_failed_prepare_waits_for_the_kv_thread_then_maps_its_records_back(
    alloc: _Allocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A prepare that fails while the thread releases: the thread is waited for, what it
    released is mapped back (fresh memory), nothing else is released, the error raised."""
    _model(alloc)
    kv = _tags(alloc, "kv_cache")
    started = threading.Event()
    calls = _threaded_release(monkeypatch, started)
    b = _backend(alloc, kv_thread=True)

    def failing(go_on: Callable[[], None]) -> list[tuple[int, int]]:
        started.set()
        raise RuntimeError("the prepare failed")

    with pytest.raises(RuntimeError, match="the prepare failed"):
        b.suspend(1, ["weights", "kv_cache"], during=failing, early_kv=kv)
    assert [ok for _p, _t, ok in calls] == [True, True]
    assert b.suspended() == {}
    assert not any(d.is_asleep for d in alloc.pointer_to_data.values())
    for p in kv:
        assert alloc.read(p) == bytes([MAPPED]) * alloc.pointer_to_data[p].handle[1]


def test_a_driver_error_on_the_kv_thread_fails_the_suspend_after_the_prepare(
    alloc: _Allocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The thread's driver error is raised on the suspend's thread once the prepare ended
    (the rank is then failed), before any weights record is released."""
    before = _model(alloc)
    kv = _tags(alloc, "kv_cache")
    started = threading.Event()
    _threaded_release(monkeypatch, started, fail=True)
    b = _backend(alloc, kv_thread=True)
    ended: list[bool] = []

    def prepare(go_on: Callable[[], None]) -> list[tuple[int, int]]:
        started.set()
        go_on()
        ended.append(True)
        return []

    with pytest.raises(DriverError, match="cuMemUnmap"):
        b.suspend(1, ["weights", "kv_cache"], during=prepare, early_kv=[kv[0]])
    assert ended == [True]
    for p in _tags(alloc, "weights"):
        assert not alloc.pointer_to_data[p].is_asleep
        assert alloc.read(p) == before[p]


@pytest.mark.parametrize("share", [0.1, 1.0])
def test_the_fused_sleeps_first_stage_is_the_tunings_share_of_the_weights(
    alloc: _Allocator, monkeypatch: pytest.MonkeyPatch, share: float
) -> None:
    """The copies queued before `during` runs hold the tuning's `sleep_stage_share` of the
    weights' bytes (whole records, in address order), the rest only once it calls go_on."""
    _model(alloc)
    lowest = alloc.pointer_to_data[_tags(alloc, "weights")[0]].handle[1]
    first = lowest if share < 0.19 else 5096  # the records hold 4096 and 1000 bytes
    copied: list[int] = []
    move = CudaRT.memcpy_async

    def count(s: CudaRT, dst: int, src: int, n: int, st: int) -> None:
        copied.append(n)
        move(s, dst, src, n, st)

    monkeypatch.setattr(CudaRT, "memcpy_async", count)
    b = _backend(alloc, sleep_stage_share=share)
    seen: list[int] = []

    def prepare(go_on: Callable[[], None]) -> list[tuple[int, int]]:
        seen.append(sum(copied))
        go_on()
        seen.append(sum(copied))
        return []

    b.suspend(1, ["weights", "kv_cache"], during=prepare)
    assert seen == [first, 5096]


def test_a_wake_maps_with_the_tuned_wait_for_memory(alloc: _Allocator) -> None:
    """An overlapped swap maps the woken model's KV cache while the victim releases its
    own: the backend's driver waits for memory (the tuning's map_oom_wait_s) at a create."""
    _model(alloc)
    b = _backend(alloc, map_oom_wait_s=1.5)
    b.suspend(1, ["weights", "kv_cache"])
    b.resume(["weights", "kv_cache"])
    assert b._driver.oom_wait_s == 1.5
    assert _backend(alloc)._mapper().oom_wait_s == 5.0  # the default


class _GraphPool:
    """A MemPool's snapshot: its segments' base addresses."""

    def __init__(self, ptrs: list[int]) -> None:
        self.ptrs = ptrs

    def snapshot(self) -> list[dict[str, int]]:
        return [{"address": p, "total_size": 0} for p in self.ptrs]


def _with_graphs(alloc: _Allocator) -> tuple[dict[int, bytes], list[int]]:
    """The model, and two records the CUDA graphs were captured into (tagged as vLLM's
    allocator tags what no pool context names)."""
    before = _model(alloc)
    graphs = [alloc.add("default", b"\x11" * 700), alloc.add("default", b"\x22" * 300)]
    alloc.allocator_and_pools = {"cudagraph": (_GraphPool(graphs), None)}  # type: ignore[attr-defined]
    return before, graphs


def test_the_graph_pool_sleeps_with_the_kv_cache_without_a_copy(alloc: _Allocator) -> None:
    """worker_ext.graphpool: the graphs' records are the pool `cudagraph` (tagged `kv_cache`
    in vLLM's allocator, so its own sleep discards them and its wake maps them with the KV
    cache); released with the KV cache, never copied, mapped back empty with it."""
    before, graphs = _with_graphs(alloc)
    b = _backend(alloc)
    assert b.pools() == {"weights": 5096, "kv_cache": 812, "cudagraph": 1000}
    assert [alloc.pointer_to_data[p].tag for p in graphs] == ["kv_cache", "kv_cache"]
    assert b.tag_of(graphs[0] + 10, 4) == "cudagraph"
    b.suspend(1, ["weights"])  # the weights alone: the graphs stay
    assert not any(alloc.pointer_to_data[p].is_asleep for p in graphs)
    b.resume(["weights"])
    r = b.suspend(1, ["weights", "kv_cache"])
    assert r["freed_bytes"] == {"weights": 5096, "kv_cache": 812, "cudagraph": 1000}
    assert r["offloaded_bytes"] == {"weights": 5096, "kv_cache": 0}
    assert b.host_backup_bytes() == 5096  # nothing of the graphs on the host
    assert all(
        alloc.read(p) == bytes([RELEASED]) * alloc.pointer_to_data[p].handle[1] for p in graphs
    )
    assert b.suspended() == {"weights": "offloaded", "kv_cache": "discarded"}
    assert b.resume(["weights"])["restored_bytes"] == {"weights": 5096}
    assert all(alloc.pointer_to_data[p].is_asleep for p in graphs)  # still with the KV cache
    k = b.resume(["kv_cache"])
    assert k["restored_bytes"] == {"kv_cache": 812, "cudagraph": 1000}
    assert "cudagraph_s" in k["timings"]
    assert "cudagraph_poisoned" not in k["timings"]
    assert all(
        alloc.read(p) == bytes([MAPPED]) * alloc.pointer_to_data[p].handle[1] for p in graphs
    )
    b.synchronize()
    for p in _tags(alloc, "weights"):
        assert alloc.read(p) == before[p]


def test_a_kept_kv_cache_still_drops_the_graph_pool(alloc: _Allocator) -> None:
    before, graphs = _with_graphs(alloc)
    b = _backend(alloc)
    b.prepare_kv_keep()
    r = b.suspend(1, ["weights", "kv_cache"], keep_kv=True)
    assert r["offloaded_bytes"] == {"weights": 5096, "kv_cache": 812}
    assert r["kv_host_backup_bytes"] == 812  # the KV records only
    b.resume(["weights", "kv_cache"])
    b.synchronize()
    assert all(alloc.read(p) == v for p, v in before.items())
    assert all(
        alloc.read(p) == bytes([MAPPED]) * alloc.pointer_to_data[p].handle[1] for p in graphs
    )


def test_the_poisoned_graph_pool_is_filled_at_every_wake(
    alloc: _Allocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """HOTSWAP_GRAPH_POOL=poison: every mapping back is filled with 0xFF bytes before the
    wake returns (a replay that read the old bytes would then change the tokens)."""
    _before, graphs = _with_graphs(alloc)
    from worker_ext.cumem import CuMemBackend

    monkeypatch.setattr(CuMemBackend, "_fill", lambda _s, p, n, v: ctypes.memset(p, v, n))
    settings = WorkerSettings(host_codec="none", verify_kernel="off", graph_pool="poison")
    b = CuMemBackend(_Worker(), settings)
    for level in (1, 2):
        b.suspend(level, ["weights", "kv_cache"])
        k = b.resume(["weights", "kv_cache"])
        assert k["timings"]["cudagraph_poisoned"] == 1.0
        assert all(alloc.read(p) == b"\xff" * alloc.pointer_to_data[p].handle[1] for p in graphs)


@pytest.mark.parametrize("kv_thread", [False, True])
def test_kv_records_released_first_are_lent_to_a_rank_waking_on_the_device(
    alloc: _Allocator, monkeypatch: pytest.MonkeyPatch, kv_thread: bool
) -> None:
    """kvlend through the backend: a rank waking on the same device (by UUID) listens from
    its first resume until its KV pool is mapped; the sleeping rank's KV records released
    first are exported and lent to it (from the KV thread too: the tuning's kv_thread); its
    KV records (only those) are mapped with what was lent (the driver's side:
    test_cudriver)."""
    import os
    import uuid

    from worker_ext.cumem import kvlend

    go = threading.Event()
    go.set()
    _threaded_release(monkeypatch, go)  # used only with kv_thread

    dev = f"GPU-{uuid.uuid4()}"
    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda _d: type("P", (), {"uuid": dev})()
    )
    exported: list[int] = []

    def export(_s: Driver, handle: Any) -> tuple[int, int]:
        r, w = os.pipe()
        os.close(w)
        exported.append(handle[1])
        return r, handle[1]

    monkeypatch.setattr(Driver, "export_fd", export)
    lents: list[tuple[int, Any]] = []

    def create_and_map(_s: Driver, h: Any, lent: Any = None) -> None:
        got = lent(h[1]) if lent is not None else None
        lents.append((h[1], got))
        if got is not None:
            os.close(got[0])
        _scribble(h, MAPPED)

    monkeypatch.setattr(Driver, "create_and_map", create_and_map)
    _model(alloc)
    kv = _tags(alloc, "kv_cache")
    waking = _backend(alloc)  # the same fake records stand in for its own
    waking._suspended = {"kv_cache": "discarded"}  # as if asleep: its KV pool discarded
    waking._lending.open()  # its first resume (the weights') opened it
    sleeping = _backend(alloc, kv_thread=kv_thread)

    r = sleeping.suspend(1, ["weights", "kv_cache"], during=_go_on, early_kv=kv)
    assert r["timings"].get("kv_thread", 0.0) == float(kv_thread)
    assert sorted(exported) == sorted(alloc.pointer_to_data[p].handle[1] for p in kv)
    assert r["timings"]["kv_lent_records"] == len(kv)
    assert waking._lending.inbox is not None
    nothing = kvlend.Lending(lambda: dev, lambda: waking.settings, print, print)
    nothing.open()
    assert nothing.inbox is None  # one listener per device: the waking rank's
    out = waking.resume(["kv_cache"])
    sizes = sorted(alloc.pointer_to_data[p].handle[1] for p in kv)
    assert sorted(n for n, _got in lents) == sizes
    assert all(got is not None and got[1] == n for n, got in lents)  # each from lent memory
    assert out["timings"]["kv_lent_received"] == len(kv)
    assert waking._lending.inbox is None  # closed once the KV pool is mapped
    assert kvlend.connect(kvlend.address(dev)) is None
