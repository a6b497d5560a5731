"""worker_ext.cudriver against a fake libcuda: what it asks the driver for, where the new
handle goes, and that a failure leaves nothing created or mapped. (The real driver runs in
the GPU tests and benches.)"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import pytest
from support.fds import fd_closed, pipe_fd

from worker_ext.cudriver import Driver, DriverError

NOT_PERMITTED = 800
GRANULARITY = 2 << 20


class FakeCuda:
    """The cuMem calls Driver makes, recording them; `fail` maps a call name to the
    CUresult it returns (once per listed entry)."""

    def __init__(self, fabric: bool, rdma: bool = True) -> None:
        self.attrs = {110: int(rdma), 128: int(fabric)}
        self.calls: list[tuple[Any, ...]] = []
        self.fail: dict[str, list[int]] = {}
        self.live: set[int] = set()  # created, not released
        self.mapped: set[int] = set()
        self.next_handle = 0x1000
        self.free_now = 1 << 40  # what cuMemGetInfo answers; a create above it is refused
        self.free_seq: list[int] = []  # the next answers, in turn (then the last one stays)

    def _err(self, name: str) -> int:
        queue = self.fail.get(name) or []
        return queue.pop(0) if queue else 0

    def cuDeviceGetAttribute(self, out: Any, attr: int, device: int) -> int:
        out._obj.value = self.attrs.get(attr, 0)
        return 0

    def cuMemGetAllocationGranularity(self, out: Any, prop: Any, flags: int) -> int:
        out._obj.value = GRANULARITY
        return 0

    def cuMemCreate(self, out: Any, size: Any, prop: Any, flags: Any) -> int:
        handles = int(prop._obj.requestedHandleTypes)
        self.calls.append(("create", size.value, handles))
        if handles == 8 and self.fail.get("fabric") is not None:
            return NOT_PERMITTED  # as some devices answer: fabric reported, then refused
        err = self._err("create")
        if err:
            return err
        if size.value > self.free_now:
            return 2  # CUDA_ERROR_OUT_OF_MEMORY
        self.next_handle += 1
        out._obj.value = self.next_handle
        self.live.add(self.next_handle)
        return 0

    def cuMemGetInfo_v2(self, free: Any, total: Any) -> int:
        self.calls.append(("info",))
        if self.free_seq:
            self.free_now = self.free_seq.pop(0)
        free._obj.value, total._obj.value = self.free_now, 1 << 40
        return 0

    def cuMemImportFromShareableHandle(self, out: Any, fd: Any, kind: Any) -> int:
        self.calls.append(("import", fd.value, kind.value))
        err = self._err("import")
        if err:
            return err
        self.next_handle += 1
        out._obj.value = self.next_handle
        self.live.add(self.next_handle)
        return 0

    def cuMemExportToShareableHandle(self, out: Any, h: Any, kind: Any, flags: Any) -> int:
        self.calls.append(("export", h.value, kind.value))
        out._obj.value = os.dup(0)
        return self._err("export")

    def cuMemMap(self, ptr: Any, size: Any, offset: Any, h: Any, flags: Any) -> int:
        self.calls.append(("map", ptr.value, h.value, size.value))
        err = self._err("map")
        if not err:
            self.mapped.add(ptr.value)
        return err

    def cuMemSetAccess(self, ptr: Any, size: Any, desc: Any, count: Any) -> int:
        self.calls.append(("access", ptr.value, desc._obj.flags))
        return self._err("access")

    def cuMemUnmap(self, ptr: Any, size: Any) -> int:
        self.calls.append(("unmap", ptr.value, size.value))
        self.mapped.discard(ptr.value)
        return 0

    def cuMemRelease(self, h: Any) -> int:
        self.calls.append(("release", h.value))
        self.live.discard(h.value)
        return 0


def record(ptr: int, size: int = GRANULARITY) -> tuple[tuple[int, int, int, int], Any]:
    """A vLLM allocator handle (device, size, d_mem, p_memHandle) and its handle slot."""
    slot = ctypes.c_uint64(0)
    return (0, size, ptr, ctypes.addressof(slot)), slot


def test_the_new_handle_goes_where_the_record_points() -> None:
    cuda = FakeCuda(fabric=False)
    drv = Driver(0, lib=cuda)
    handle, slot = record(0x7000_0000)
    drv.create_and_map(handle)
    assert slot.value in cuda.live
    assert cuda.mapped == {0x7000_0000}
    kinds = [c[0] for c in cuda.calls]
    assert kinds == ["create", "map", "access"]
    assert cuda.calls[0][2] == 1  # no fabric support: a POSIX fd handle, as vLLM asks
    assert cuda.calls[2][2] == 3  # read-write access
    assert drv.handle_type == "posix_fd"
    assert drv.rdma is True
    spent = drv.take_spent()
    assert set(spent) == {"create", "map", "access", "oom_wait", "import"}
    assert all(v >= 0 for v in spent.values())
    assert spent["oom_wait"] == 0.0
    assert drv.take_spent() == {
        "create": 0.0,
        "map": 0.0,
        "access": 0.0,
        "oom_wait": 0.0,
        "import": 0.0,
    }


def test_a_refused_fabric_request_is_asked_once_then_a_posix_fd() -> None:
    cuda = FakeCuda(fabric=True)
    cuda.fail["fabric"] = []  # every fabric request refused
    drv = Driver(0, lib=cuda)
    assert drv.handle_type == "fabric"
    slots = []
    for i in range(3):
        handle, slot = record(0x7000_0000 + i * GRANULARITY)
        drv.create_and_map(handle)
        slots.append(slot)
    creates = [c for c in cuda.calls if c[0] == "create"]
    # vLLM 0.26 asks for fabric on every record and falls back each time; this asks once
    assert [c[2] for c in creates] == [8, 1, 1, 1]
    assert drv.fabric_refused
    assert drv.handle_type == "posix_fd"
    assert all(s.value in cuda.live for s in slots)


def test_fabric_where_the_driver_grants_it() -> None:
    cuda = FakeCuda(fabric=True)
    drv = Driver(0, lib=cuda)
    handle, slot = record(0x7000_0000)
    drv.create_and_map(handle)
    assert [c[2] for c in cuda.calls if c[0] == "create"] == [8]
    assert not drv.fabric_refused
    assert slot.value in cuda.live


def test_not_exportable_asks_for_no_handle_type() -> None:
    cuda = FakeCuda(fabric=True)
    drv = Driver(0, lib=cuda, exportable=False)
    drv.create_and_map(record(0x7000_0000)[0])
    assert [c[2] for c in cuda.calls if c[0] == "create"] == [0]
    assert drv.handle_type == "none"


@pytest.mark.parametrize("step", ["create", "map", "access"])
def test_a_failed_step_leaves_nothing_behind(step: str) -> None:
    cuda = FakeCuda(fabric=False)
    cuda.fail[step] = [2]  # CUDA_ERROR_OUT_OF_MEMORY
    drv = Driver(0, lib=cuda)
    handle, slot = record(0x7000_0000)
    with pytest.raises(DriverError, match=r"CUresult 2"):
        drv.create_and_map(handle)
    assert cuda.live == set()
    assert cuda.mapped == set()
    assert slot.value == 0  # the record's handle slot is untouched


def test_a_create_refused_for_memory_is_asked_again_only_once_the_device_has_room() -> None:
    """While the victim releases its memory the woken model's driver asks the device how
    much is free (cuMemGetInfo), not the create again and again: a refused create is what
    the releasing process waits behind."""
    cuda = FakeCuda(fabric=False)
    cuda.free_now = 0
    cuda.free_seq = [0] * 6 + [GRANULARITY]
    drv = Driver(0, lib=cuda, oom_wait_s=5.0)
    handle, slot = record(0x7000_0000)
    drv.create_and_map(handle)
    assert slot.value in cuda.live
    kinds = [c[0] for c in cuda.calls]
    assert kinds == ["create"] + ["info"] * 7 + ["create", "map", "access"]


def test_a_create_refused_for_memory_is_asked_again_within_oom_wait_s() -> None:
    """The memory an overlapped swap's victim is releasing: a create refused for memory is
    asked again until it passes (the wait timed apart), or until `oom_wait_s` has passed;
    with none, refused at once."""
    cuda = FakeCuda(fabric=False)
    cuda.fail["create"] = [2, 2, 2]  # CUDA_ERROR_OUT_OF_MEMORY three times, then room
    drv = Driver(0, lib=cuda, oom_wait_s=5.0)
    handle, slot = record(0x7000_0000)
    drv.create_and_map(handle)
    assert slot.value in cuda.live
    kinds = [c[0] for c in cuda.calls if c[0] != "info"]  # the device had room throughout
    assert kinds == ["create"] * 4 + ["map", "access"]
    spent = drv.take_spent()
    assert 0 < spent["oom_wait"] <= spent["create"]
    cuda.fail["create"] = [2] * 1000
    drv.oom_wait_s = 0.05
    with pytest.raises(DriverError, match=r"CUresult 2"):
        drv.create_and_map(record(0x7100_0000)[0])
    assert 0.05 <= drv.take_spent()["oom_wait"] < 2.0
    cuda.fail["create"] = [2]
    cuda.calls.clear()
    with pytest.raises(DriverError, match=r"CUresult 2"):
        Driver(0, lib=cuda).create_and_map(record(0x7200_0000)[0])
    assert [c[0] for c in cuda.calls] == ["create"]  # no wait asked: refused at once
    cuda.fail["create"] = [7]  # another error is never waited on
    cuda.calls.clear()
    with pytest.raises(DriverError, match=r"CUresult 7"):
        drv.create_and_map(record(0x7300_0000)[0])
    assert [c[0] for c in cuda.calls] == ["create"]


@pytest.mark.parametrize(("lent", "maps"), [(8, [8]), (6, [6, 2])])
def test_a_record_maps_memory_lent_to_it_in_place_of_a_create(lent: int, maps: list[int]) -> None:
    """kvlend: the allocation behind a lent descriptor is imported and mapped (all of it,
    and a new allocation after it where smaller, that one's handle released once mapped);
    the imported handle is the record's; the descriptor kept until the record's release,
    and lent on as it came (its own size, not the record's)."""
    g = GRANULARITY
    cuda = FakeCuda(fabric=False)
    drv = Driver(0, lib=cuda, oom_wait_s=5.0)
    fd = pipe_fd()
    handle, slot = record(0x7000_0000, 8 * g)
    drv.create_and_map(handle, lambda n: (fd, lent * g))
    kinds = [c[0] for c in cuda.calls]
    assert cuda.calls[0][0] == "import"
    assert cuda.calls[0][1] == fd
    assert [c[3] // g for c in cuda.calls if c[0] == "map"] == maps
    assert slot.value == cuda.calls[1][2]  # the imported handle
    if len(maps) == 2:  # the tail's own allocation: mapped after it, its handle released
        tail = next(c for c in cuda.calls if c[0] == "create")
        assert tail[1] == 2 * g
        assert kinds.index("release") > kinds.index("map", kinds.index("create"))
    assert kinds[-1] == "access"
    assert drv.kept == {0x7000_0000: (fd, lent * g)}
    assert not fd_closed(fd)
    assert drv.imported == lent * g
    again, n = drv.export_fd(handle)  # lent on: the same memory, its own size
    assert n == lent * g
    assert "export" not in [c[0] for c in cuda.calls]
    os.close(again)
    drv.forget(0x7000_0000)  # the record released: its descriptor closed
    assert fd_closed(fd)
    assert drv.kept == {}


def test_a_larger_lent_allocation_is_not_mapped_in_part() -> None:
    """The H200's driver refused to map the first bytes of a larger allocation (2026-12-03
    14:26): such a descriptor is closed and the record created."""
    g = GRANULARITY
    cuda = FakeCuda(fabric=False)
    drv = Driver(0, lib=cuda)
    fd = pipe_fd()
    handle, _slot = record(0x7000_0000, 8 * g)
    drv.create_and_map(handle, lambda n: (fd, 10 * g))
    assert [c[0] for c in cuda.calls] == ["create", "map", "access"]
    assert fd_closed(fd)
    assert drv.import_refused == 1
    assert drv.kept == {}


def test_memory_lent_while_a_create_waits_is_taken_in_its_place() -> None:
    cuda = FakeCuda(fabric=False)
    cuda.free_now = 0  # the victim's memory is still its own
    drv = Driver(0, lib=cuda, oom_wait_s=5.0)
    fd = pipe_fd()
    polls = {"n": 0}

    def lent(n: int) -> tuple[int, int] | None:
        polls["n"] += 1
        return (fd, n) if polls["n"] >= 4 else None  # arrives at the fourth look

    handle, slot = record(0x7000_0000)
    drv.create_and_map(handle, lent)
    kinds = [c[0] for c in cuda.calls]
    assert kinds.count("create") == 1  # the first, refused; then only queries and looks
    assert "import" in kinds
    assert slot.value in cuda.live
    assert drv.kept == {0x7000_0000: (fd, GRANULARITY)}
    assert drv.take_spent()["oom_wait"] > 0
    drv.forget(0x7000_0000)


def test_a_lent_descriptor_that_fails_is_closed_and_the_record_created() -> None:
    cuda = FakeCuda(fabric=False)
    cuda.fail["map"] = [1]  # the lent memory's mapping refused
    drv = Driver(0, lib=cuda)
    fd = pipe_fd()
    handle, slot = record(0x7000_0000)
    drv.create_and_map(handle, lambda n: (fd, n))
    assert fd_closed(fd)
    assert drv.import_refused == 1
    kinds = [c[0] for c in cuda.calls]
    assert kinds == ["import", "map", "release", "create", "map", "access"]
    assert slot.value in cuda.live
    assert len(cuda.live) == 1  # the imported handle went back


def test_export_gives_a_descriptor_of_the_records_handle() -> None:
    cuda = FakeCuda(fabric=False)
    drv = Driver(0, lib=cuda)
    handle, slot = record(0x7000_0000)
    drv.create_and_map(handle)
    fd, n = drv.export_fd(handle)
    assert cuda.calls[-1] == ("export", slot.value, 1)  # as a POSIX file descriptor
    assert n == GRANULARITY
    os.close(fd)


class _ContextCuda(FakeCuda):
    """A fake driver whose current context is per thread, as the real one's."""

    def __init__(self) -> None:
        import threading

        super().__init__(fabric=False)
        self.current = threading.local()  # a new thread has none (its ident may be reused)
        self.retained = 0

    def cuCtxGetCurrent(self, out: Any) -> int:
        out._obj.value = getattr(self.current, "ctx", None)
        return 0

    def cuDeviceGet(self, out: Any, ordinal: int) -> int:
        out._obj.value = ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, out: Any, dev: Any) -> int:
        self.retained += 1
        out._obj.value = 0xC0 + dev.value
        return 0

    def cuCtxSetCurrent(self, ctx: Any) -> int:
        self.calls.append(("set_current", ctx.value))
        self.current.ctx = ctx.value
        return 0


def test_unmap_release_binds_the_context_on_another_thread_and_releases_the_records_handle() -> (
    None
):
    """The KV release on a thread of its own (the tuning's kv_thread): the device's primary
    context is made current there first (retained once per driver), then the record is
    unmapped and the handle its slot holds released, as vLLM's unmap_and_release does."""
    import threading

    cuda = _ContextCuda()
    drv = Driver(3, lib=cuda)
    handles = [record(0x7000_0000 + i * GRANULARITY) for i in range(3)]
    for handle, _slot in handles:
        drv.create_and_map(handle)
    errors: list[BaseException] = []

    def run(mine: list[tuple[tuple[int, int, int, int], Any]]) -> None:
        try:
            for handle, _slot in mine:
                drv.unmap_release(handle)
        except BaseException as e:
            errors.append(e)

    for mine in (handles[:2], handles[2:]):  # two threads: the context retained once
        t = threading.Thread(target=run, args=(mine,))
        t.start()
        t.join()
    assert not errors
    assert cuda.retained == 1
    assert not cuda.mapped
    assert not cuda.live
    kinds = [c[0] for c in cuda.calls if c[0] in ("set_current", "unmap", "release")]
    first, second = ["set_current", "unmap", "release", "unmap", "release"], kinds[5:]
    assert kinds[:5] == first
    assert second == ["set_current", "unmap", "release"]
    assert ("set_current", 0xC3) in cuda.calls  # device 3's primary context
    assert getattr(cuda.current, "ctx", None) is None  # this thread's was never touched
