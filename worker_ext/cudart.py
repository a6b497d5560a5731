"""The CUDA runtime calls and the page-locked host buffer the cuMem backend copies through.

Beside cudriver.py (the driver calls a resume maps memory with): `CudaRT` binds the few
libcudart functions torch does not expose without holding the GIL (ctypes CDLL calls
release it), and `HostBuffer` is the one anonymous mapping of exactly the weights' bytes,
page-locked in REGISTER_BYTES pieces, that level-1 copies go through.
"""

from __future__ import annotations

import ctypes
import threading
import time

CHUNK_BYTES = 64 << 20  # one cudaMemcpyAsync; large enough to run at link speed
REGISTER_BYTES = 4 * CHUNK_BYTES  # one cudaHostRegister: short enough not to stall serving
_MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: direction from the unified address space
_HOST_REGISTER_PORTABLE = 1  # pinned for every context, whichever thread registered it
_PROT_RW = 0x1 | 0x2
_MAP_PRIVATE_ANON = 0x02 | 0x20
_MADV_HUGEPAGE = 14


def loaded_library(name: str) -> str | None:
    """The path of the shared library `name` (e.g. "libcudart") mapped into this process:
    vLLM's finder where vLLM is installed, else this process's maps (torch-only benches)."""
    try:
        from vllm.utils.system_utils import find_loaded_library
    except ImportError:
        find_loaded_library = None
    if find_loaded_library is not None:
        return find_loaded_library(name)  # type: ignore[no-any-return]
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        for line in f:
            path = line.split()[-1] if line.strip() else ""
            if path.startswith("/") and f"/{name}" in path and ".so" in path:
                return path
    return None


class CudaRT:
    """The few CUDA runtime calls torch does not expose without holding the GIL."""

    def __init__(self, path: str | None = None) -> None:
        if path is None:
            path = loaded_library("libcudart")
        if path is None:
            raise RuntimeError("libcudart is not loaded in this process")
        lib = ctypes.CDLL(path)  # CDLL calls release the GIL
        lib.cudaMemcpyAsync.argtypes = [
            ctypes.c_void_p,
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_void_p,
        ]
        lib.cudaMemcpyAsync.restype = ctypes.c_int
        lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        lib.cudaHostRegister.restype = ctypes.c_int
        lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
        lib.cudaHostUnregister.restype = ctypes.c_int
        lib.cudaSetDevice.argtypes = [ctypes.c_int]
        lib.cudaSetDevice.restype = ctypes.c_int
        lib.cudaDeviceGetLimit.argtypes = [ctypes.POINTER(ctypes.c_size_t), ctypes.c_int]
        lib.cudaDeviceGetLimit.restype = ctypes.c_int
        lib.cudaDeviceSetLimit.argtypes = [ctypes.c_int, ctypes.c_size_t]
        lib.cudaDeviceSetLimit.restype = ctypes.c_int
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        self._lib = lib

    def check(self, err: int, what: str) -> None:
        if err != 0:
            msg = self._lib.cudaGetErrorString(err)
            raise RuntimeError(f"{what} failed: CUDA error {err} ({msg.decode() if msg else '?'})")

    def memcpy_async(self, dst: int, src: int, n: int, stream: int) -> None:
        self.check(self._lib.cudaMemcpyAsync(dst, src, n, _MEMCPY_DEFAULT, stream), "memcpy")

    def host_register(self, ptr: int, n: int) -> None:
        self.check(self._lib.cudaHostRegister(ptr, n, _HOST_REGISTER_PORTABLE), "register")

    def host_unregister(self, ptr: int) -> None:
        self.check(self._lib.cudaHostUnregister(ptr), "cudaHostUnregister")

    def set_device(self, index: int) -> None:
        self.check(self._lib.cudaSetDevice(index), "cudaSetDevice")

    def get_limit(self, limit: int) -> int:
        value = ctypes.c_size_t()
        self.check(self._lib.cudaDeviceGetLimit(ctypes.byref(value), limit), "cudaDeviceGetLimit")
        return int(value.value)

    def set_limit(self, limit: int, value: int) -> None:
        """Blocks until the device's queued work is done (the driver's own rule)."""
        self.check(self._lib.cudaDeviceSetLimit(limit, value), "cudaDeviceSetLimit")


class HostBuffer:
    """Exactly `nbytes` of page-aligned anonymous memory, page-locked piece by piece."""

    def __init__(self, nbytes: int, cudart: CudaRT, device_index: int = 0) -> None:
        self.nbytes = nbytes
        self._cudart = cudart
        self._device_index = device_index
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._libc.mmap.restype = ctypes.c_void_p
        self._libc.mmap.argtypes = [
            ctypes.c_void_p,
            ctypes.c_size_t,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_int,
            ctypes.c_long,
        ]
        self._libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        self._libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        ptr = self._libc.mmap(None, max(nbytes, 1), _PROT_RW, _MAP_PRIVATE_ANON, -1, 0)
        if ptr is None or ptr == ctypes.c_void_p(-1).value:
            raise MemoryError(f"mmap of {nbytes} bytes failed (errno {ctypes.get_errno()})")
        self.ptr: int = ptr
        self._registered: list[int] = []

    def pin(self, threads: int) -> float:
        """Touch then register every piece (touching first makes registering several times faster),
        pieces spread over `threads` threads; huge pages asked for to cut page faults."""
        t0 = time.perf_counter()
        self._libc.madvise(ctypes.c_void_p(self.ptr), ctypes.c_size_t(self.nbytes), _MADV_HUGEPAGE)
        pieces = list(range(0, self.nbytes, REGISTER_BYTES))
        errors: list[BaseException] = []
        lock = threading.Lock()

        def work(mine: list[int]) -> None:
            try:
                self._cudart.set_device(self._device_index)
                for off in mine:
                    n = min(REGISTER_BYTES, self.nbytes - off)
                    ctypes.memset(self.ptr + off, 0, n)  # populate the pages; releases the GIL
                    self._cudart.host_register(self.ptr + off, n)
                    with lock:
                        self._registered.append(self.ptr + off)
            except BaseException as exc:
                errors.append(exc)

        n_threads = max(1, min(threads, len(pieces)))
        workers = [
            threading.Thread(target=work, args=(pieces[i::n_threads],), daemon=True)
            for i in range(n_threads)
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        if errors:
            raise errors[0]
        return time.perf_counter() - t0

    def free(self) -> None:
        for p in self._registered:
            self._cudart.host_unregister(p)
        self._registered.clear()
        if self.ptr:
            self._libc.munmap(self.ptr, max(self.nbytes, 1))
            self.ptr = 0
