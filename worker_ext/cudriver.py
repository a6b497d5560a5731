"""The CUDA driver's virtual-memory calls (cuMem*), through ctypes, timed call by call.

vLLM's allocator maps a record with one C call (`create_and_map`: cuMemCreate, cuMemMap,
cuMemSetAccess) that holds the GIL and reports nothing. `Driver.create_and_map` does the
same three calls on the same record handle, `(device, size, d_mem, p_memHandle)`: the new
allocation handle is written where `p_memHandle` points, so vLLM's `unmap_and_release`
releases it later as if vLLM had made it. It adds each call's time to `Driver.spent`, so a
wake can say which driver step its mapping time went to.

What it asks for is what vLLM 0.26's allocator asks for: pinned device memory,
`gpuDirectRDMACapable` where the device supports it with VMM, and an exportable handle
type: fabric (CU_MEM_HANDLE_TYPE_FABRIC) where the device reports fabric handle support,
else a POSIX file descriptor; vLLM retries with the file descriptor when the fabric
request is refused (CUDA_ERROR_NOT_PERMITTED or NOT_SUPPORTED, e.g. no IMEX daemon).
vLLM makes that refused call again for every record at every wake; this driver remembers
the refusal and asks once. On devices that report fabric support and refuse it, the
refused call per record made mapping a KV pool several times slower and slowed the
weights' map-and-copy loop (docs/benchmarks.md).

Used by the cumem backend to map every record back, and by benchmarks/mapping.py.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Callable
from typing import Any

_ALLOCATION_PINNED = 1  # CU_MEM_ALLOCATION_TYPE_PINNED
_LOCATION_DEVICE = 1  # CU_MEM_LOCATION_TYPE_DEVICE
_PROT_READWRITE = 3  # CU_MEM_ACCESS_FLAGS_PROT_READWRITE
_ATTR_RDMA_WITH_VMM = 110  # CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
_ATTR_FABRIC_HANDLES = 128  # CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_FABRIC_SUPPORTED
_HANDLE_NONE = 0
_HANDLE_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_HANDLE_FABRIC = 8  # CU_MEM_HANDLE_TYPE_FABRIC
_REFUSED = (800, 801)  # CUDA_ERROR_NOT_PERMITTED, CUDA_ERROR_NOT_SUPPORTED
_OUT_OF_MEMORY = 2  # CUDA_ERROR_OUT_OF_MEMORY
_OOM_POLL_S = 0.0005  # between two creates while waiting for memory another process frees
STEPS = ("create", "map", "access", "oom_wait", "import")


# for a record of this many bytes: a lent descriptor (the caller then owns it) and the size
# of the allocation behind it, or None (kvlend.Inbox.take)
Lent = Callable[[int], tuple[int, int] | None]


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AllocFlags(ctypes.Structure):
    _fields_ = [
        ("compressionType", ctypes.c_ubyte),
        ("gpuDirectRDMACapable", ctypes.c_ubyte),
        ("usage", ctypes.c_ushort),
        ("reserved", ctypes.c_ubyte * 4),
    ]


class _Prop(ctypes.Structure):
    _fields_ = [
        ("type", ctypes.c_int),
        ("requestedHandleTypes", ctypes.c_int),
        ("location", _Location),
        ("win32HandleMetaData", ctypes.c_void_p),
        ("allocFlags", _AllocFlags),
    ]


class _Access(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


class DriverError(RuntimeError):
    pass


class Driver:
    """cuMem calls for one device. `rdma=None` asks the device, like vLLM's allocator.
    `exportable=True` asks for vLLM's handle types (fabric, else a POSIX fd); False for
    memory with no exportable handle (the bare measurements of bench_mapping.py)."""

    def __init__(
        self,
        device: int,
        rdma: bool | None = None,
        exportable: bool = True,
        lib: Any = None,
        oom_wait_s: float = 0.0,
    ) -> None:
        self.lib = ctypes.CDLL("libcuda.so.1") if lib is None else lib  # releases the GIL
        self.device = device
        self._context: ctypes.c_void_p | None = None  # the primary context, once retained
        if rdma is None:
            rdma = self.attribute(_ATTR_RDMA_WITH_VMM, device)
        self.rdma = rdma
        handles = _HANDLE_NONE
        if exportable:
            fabric = self.attribute(_ATTR_FABRIC_HANDLES, device)
            handles = _HANDLE_FABRIC if fabric else _HANDLE_POSIX_FD
        self.fabric_refused = False
        self.prop = _Prop()
        self.prop.type = _ALLOCATION_PINNED
        self.prop.requestedHandleTypes = handles
        self.prop.location = _Location(_LOCATION_DEVICE, device)
        self.prop.allocFlags.gpuDirectRDMACapable = 1 if rdma else 0
        self.access = _Access(_Location(_LOCATION_DEVICE, device), _PROT_READWRITE)
        gran = ctypes.c_size_t()
        self._ok(
            self.lib.cuMemGetAllocationGranularity(ctypes.byref(gran), ctypes.byref(self.prop), 0),
            "cuMemGetAllocationGranularity",
        )
        self.granularity = gran.value
        self.spent = dict.fromkeys(STEPS, 0.0)
        self.imported = 0  # bytes mapped from lent memory (kvlend), since take_spent
        self.import_refused = 0  # lent descriptors whose import failed (then created)
        # record -> the lent descriptor its memory came from and that allocation's size,
        # kept while it is mapped: lent on as it came (export_fd), closed at its release
        self.kept: dict[int, tuple[int, int]] = {}
        # a create refused for memory is asked again for up to this long (the memory an
        # overlapped swap's victim is releasing); 0: refused at once
        self.oom_wait_s = oom_wait_s

    def attribute(self, attr: int, device: int) -> bool:
        flag = ctypes.c_int(0)
        self._ok(
            self.lib.cuDeviceGetAttribute(ctypes.byref(flag), attr, device), "cuDeviceGetAttribute"
        )
        return bool(flag.value)

    @staticmethod
    def _ok(err: int, what: str) -> None:
        if err != 0:
            raise DriverError(f"{what}: CUresult {err}")

    def reserve(self, size: int) -> int:
        ptr = ctypes.c_uint64()
        err = self.lib.cuMemAddressReserve(
            ctypes.byref(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(0),
            ctypes.c_uint64(0),
        )  # fmt: skip
        self._ok(err, "cuMemAddressReserve")
        return ptr.value

    def _create(self, h: Any, size: int) -> int:
        err: int = self.lib.cuMemCreate(
            ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(self.prop), ctypes.c_uint64(0)
        )
        if err in _REFUSED and self.prop.requestedHandleTypes == _HANDLE_FABRIC:
            # as vLLM: a POSIX fd instead; unlike vLLM, not asked again for the next record
            self.prop.requestedHandleTypes = _HANDLE_POSIX_FD
            self.fabric_refused = True
            err = self.lib.cuMemCreate(
                ctypes.byref(h), ctypes.c_size_t(size), ctypes.byref(self.prop), ctypes.c_uint64(0)
            )
        return err

    def free_bytes(self) -> int | None:
        """The device's free memory as the driver reports it (None: it did not answer)."""
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        err = self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total))
        return int(free.value) if err == 0 else None

    def export_fd(self, handle: tuple[int, int, int, int]) -> tuple[int, int]:
        """A record's allocation as a POSIX file descriptor (the caller closes it; while it
        is open the memory outlives the record's release) and that allocation's size: for a
        record mapped from lent memory, the descriptor it came with (a duplicate: what was
        lent goes on as it came, a new allocation after it stays behind); else exported."""
        kept = self.kept.get(int(handle[2]))
        if kept is not None:
            return os.dup(kept[0]), kept[1]
        p_handle = int(handle[3])
        h = ctypes.c_uint64.from_address(p_handle).value
        fd = ctypes.c_int(-1)
        err = self.lib.cuMemExportToShareableHandle(
            ctypes.byref(fd), ctypes.c_uint64(h), ctypes.c_int(_HANDLE_POSIX_FD),
            ctypes.c_uint64(0),
        )  # fmt: skip
        self._ok(err, "cuMemExportToShareableHandle")
        return int(fd.value), int(handle[1])

    def forget(self, ptr: int) -> None:
        """The record at `ptr` was released: the descriptor its lent memory came with is
        closed (its memory then goes back to the driver, unless lent on meanwhile)."""
        kept = self.kept.pop(ptr, None)
        if kept is not None:
            with contextlib.suppress(OSError):
                os.close(kept[0])

    def _import(self, fd: int) -> int:
        """The allocation behind a lent descriptor, as a handle of this process."""
        t = time.perf_counter()
        h = ctypes.c_uint64()
        err = self.lib.cuMemImportFromShareableHandle(
            ctypes.byref(h), ctypes.c_void_p(fd), ctypes.c_int(_HANDLE_POSIX_FD)
        )
        self.spent["import"] += time.perf_counter() - t
        self._ok(err, "cuMemImportFromShareableHandle")
        return h.value

    def _map_lent(self, handle: tuple[int, int, int, int], fd: int, lent: int) -> None:
        """Map a record from the allocation behind a lent descriptor of `lent` bytes (no
        larger than the record: the driver refused to map part of one on the H200): all of
        it, and a new allocation after it where smaller (that one's handle released at once:
        it lives while mapped, and the record's unmap covers both). The imported handle goes
        where the record's `p_memHandle` points; on a failure nothing stays mapped or held."""
        _device, size, ptr, p_handle = (int(x) for x in handle)
        if lent > size:
            raise DriverError(f"lent {lent} bytes for a record of {size}: not mapped in part")
        h = self._import(fd)
        n, mapped = lent, 0
        try:
            self.map(ptr, n, h)
            mapped = n
            if n < size:
                tail = self.create(size - n)
                try:
                    self.map(ptr + n, size - n, tail)
                    mapped = size
                finally:
                    self.release(tail)
            self.set_access(ptr, size)
        except Exception:
            if mapped:
                self.unmap(ptr, mapped)
            self.release(h)
            raise
        ctypes.c_uint64.from_address(p_handle).value = h

    def _try_lent(self, handle: tuple[int, int, int, int], lent: Lent | None) -> bool:
        """Whether the record was mapped from memory `lent` has for its size (the
        descriptor then kept until the record's release: `kept`); False: nothing lent, or
        mapping it failed (the descriptor closed, then a create)."""
        got = lent(int(handle[1])) if lent is not None else None
        if got is None:
            return False
        fd, n = got
        try:
            self._map_lent(handle, fd, n)
        except Exception:  # whatever went wrong, nothing of it stays: a create follows
            self.import_refused += 1
            os.close(fd)
            return False
        self.forget(int(handle[2]))
        self.kept[int(handle[2])] = (fd, n)
        self.imported += n
        return True

    def create(self, size: int) -> int:
        """A new allocation's handle; refused for memory, asked again until `oom_wait_s`
        has passed (the time spent waiting is `spent["oom_wait"]`, within `create`), each
        time only once the device reports `size` bytes free: a refused create is a costly
        call into the driver, which the process releasing that memory waits behind."""
        h = self._create_waiting(size, None)
        assert h is not None
        return h

    def _create_waiting(self, size: int, instead: Callable[[], bool] | None) -> int | None:
        """create's body; while it waits for memory, `instead()` first (True: the record
        was mapped another way, and None is returned)."""
        h = ctypes.c_uint64()
        t = time.perf_counter()
        err = self._create(h, size)
        waited = err == _OUT_OF_MEMORY and self.oom_wait_s > 0
        try:
            deadline = t + self.oom_wait_s
            while waited and err == _OUT_OF_MEMORY and time.perf_counter() < deadline:
                time.sleep(_OOM_POLL_S)
                if instead is not None and instead():
                    return None
                free = self.free_bytes()
                if free is None or free >= size:
                    err = self._create(h, size)
        finally:
            spent = time.perf_counter() - t
            self.spent["create"] += spent
            if waited:
                self.spent["oom_wait"] += spent
        self._ok(err, "cuMemCreate")
        return h.value

    @property
    def handle_type(self) -> str:
        return {_HANDLE_NONE: "none", _HANDLE_POSIX_FD: "posix_fd", _HANDLE_FABRIC: "fabric"}[
            int(self.prop.requestedHandleTypes)
        ]

    def map(self, ptr: int, size: int, h: int) -> None:
        t = time.perf_counter()
        err = self.lib.cuMemMap(
            ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.c_size_t(0), ctypes.c_uint64(h),
            ctypes.c_uint64(0),
        )  # fmt: skip
        self.spent["map"] += time.perf_counter() - t
        self._ok(err, "cuMemMap")

    def set_access(self, ptr: int, size: int) -> None:
        t = time.perf_counter()
        err = self.lib.cuMemSetAccess(
            ctypes.c_uint64(ptr), ctypes.c_size_t(size), ctypes.byref(self.access),
            ctypes.c_size_t(1),
        )  # fmt: skip
        self.spent["access"] += time.perf_counter() - t
        self._ok(err, "cuMemSetAccess")

    def unmap(self, ptr: int, size: int) -> None:
        self._ok(self.lib.cuMemUnmap(ctypes.c_uint64(ptr), ctypes.c_size_t(size)), "cuMemUnmap")

    def release(self, h: int) -> None:
        self._ok(self.lib.cuMemRelease(ctypes.c_uint64(h)), "cuMemRelease")

    def bind_context(self) -> None:
        """Make the device's primary context current on the calling thread where none is
        (a thread of the worker's own, as vLLM's allocator does before its calls); it is
        retained once per driver."""
        current = ctypes.c_void_p()
        self._ok(self.lib.cuCtxGetCurrent(ctypes.byref(current)), "cuCtxGetCurrent")
        if current.value:
            return
        if self._context is None:
            dev, ctx = ctypes.c_int(), ctypes.c_void_p()
            self._ok(self.lib.cuDeviceGet(ctypes.byref(dev), self.device), "cuDeviceGet")
            err = self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev)
            self._ok(err, "cuDevicePrimaryCtxRetain")
            self._context = ctx
        self._ok(self.lib.cuCtxSetCurrent(self._context), "cuCtxSetCurrent")

    def unmap_release(self, handle: tuple[int, int, int, int]) -> None:
        """vLLM's `unmap_and_release` of one allocator record (cuMemUnmap, then cuMemRelease
        of the handle its `p_memHandle` points to), each call dropping the GIL (vLLM's holds
        it), from any thread (the context bound first)."""
        _device, size, ptr, p_handle = (int(x) for x in handle)
        self.bind_context()
        self.unmap(ptr, size)
        self.release(ctypes.c_uint64.from_address(p_handle).value)

    def create_and_map(self, handle: tuple[int, int, int, int], lent: Lent | None = None) -> None:
        """vLLM's `create_and_map` for one allocator record; the handle it makes goes where
        the record's `p_memHandle` points. On a failure nothing stays created or mapped.
        `lent`: memory another process lent is mapped in place of a create (no scrub:
        kvlend), before creating and while a create waits for memory."""
        _device, size, ptr, p_handle = (int(x) for x in handle)
        self.forget(ptr)  # released already; a stale descriptor would hold its old memory
        if self._try_lent(handle, lent):
            return
        h = self._create_waiting(
            size, None if lent is None else lambda: self._try_lent(handle, lent)
        )
        if h is None:
            return
        try:
            self.map(ptr, size, h)
        except DriverError:
            self.release(h)
            raise
        try:
            self.set_access(ptr, size)
        except DriverError:
            self.unmap(ptr, size)
            self.release(h)
            raise
        ctypes.c_uint64.from_address(p_handle).value = h

    def take_spent(self) -> dict[str, float]:
        """Seconds per driver step since the last call; resets the counters."""
        out, self.spent = self.spent, dict.fromkeys(STEPS, 0.0)
        self.imported = self.import_refused = 0
        return out
