"""The pinned host buffers an offloaded pool is copied into: one of exactly the pool's bytes
(anonymous mmap, page-locked in REGISTER_BYTES pieces: worker_ext/cudart.py), made in a
background thread ahead of the sleep that needs it, or in the foreground by that sleep."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from worker_ext import hostram
from worker_ext.cudart import CudaRT, HostBuffer

log = logging.getLogger(__name__)


class Pinned:
    """One pinned buffer (`what` names it in errors), grown to the size asked for.

    `before_swap` runs before a buffer is replaced or handed out: whatever still reads
    the buffer (the disk tier's writer) is done by then."""

    def __init__(
        self,
        what: str,
        cudart: CudaRT,
        device_index: int,
        threads: Callable[[], int],
        before_swap: Callable[[], None] = lambda: None,
    ) -> None:
        self._what = what
        self._cudart = cudart
        self._index = device_index
        self._threads = threads
        self._before_swap = before_swap
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.buf: HostBuffer | None = None
        self.error: str | None = None
        self.pin_s: float | None = None

    @property
    def nbytes(self) -> int:
        buf = self.buf
        return buf.nbytes if buf is not None else 0

    def pinning(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def state(self) -> str:
        return "pinning" if self.pinning() else "ready" if self.buf is not None else "none"

    def make(self, nbytes: int) -> None:
        """Pin a buffer of `nbytes` and put it in place of the old one; a failure is kept
        in `error` (reported by describe(); a sleep retries in the foreground)."""
        try:
            self._cudart.set_device(self._index)
            buf = HostBuffer(nbytes, self._cudart, self._index)
            try:
                pin_s = buf.pin(self._threads())
            except Exception:
                buf.free()
                raise
            self._before_swap()
            with self._lock:
                old, self.buf = self.buf, buf
                self.pin_s, self.error = pin_s, None
            if old is not None:
                old.free()
        except Exception as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("hotswap: pinning the %s failed: %s", self._what, self.error)

    def warm(self, need: int, thread_name: str) -> None:
        """Start pinning `need` bytes in the background unless a big enough buffer is
        there or on its way."""
        with self._lock:
            if need > 0 and self.nbytes < need and not self.pinning():
                self._thread = threading.Thread(
                    target=self.make, args=(need,), name=thread_name, daemon=True
                )
                self._thread.start()

    def join(self) -> None:
        thread = self._thread
        if thread is not None:
            thread.join()

    def take(self, nbytes: int) -> HostBuffer:
        """A buffer of at least `nbytes`: the one pinned ahead of time, else one pinned now
        (the sleep pays the pinning)."""
        self.join()
        self._before_swap()
        if self.buf is None or self.buf.nbytes < nbytes:
            self.make(nbytes)
        if self.buf is None or self.buf.nbytes < nbytes:
            raise RuntimeError(f"no {self._what}: {self.error}")
        return self.buf

    def release(self) -> int:
        """Free the buffer; its bytes."""
        with self._lock:
            buf, self.buf = self.buf, None
        if buf is None:
            return 0
        freed = buf.nbytes
        buf.free()
        return freed


def keep_refusal(need: int, have: int, making: bool) -> str | None:
    """Host memory for a pinned copy of `need` bytes, unless a big enough buffer is there or
    on its way: what this process may still take (MemAvailable, or its cgroup's limit less
    its usage where lower: `worker_ext.hostram`) less a margin (2 GiB or 5% of that RAM)."""
    if have >= need or making:
        return None
    avail, total = hostram.read()
    if avail is None or total is None:
        return None  # no /proc/meminfo: the pinning itself will say if it cannot
    margin = max(2 << 30, total // 20)
    if need - have > avail - margin:
        return (
            f"host memory: need {need - have} bytes for the KV cache's copy, "
            f"MemAvailable {avail} (less a margin of {margin})"
        )
    return None


def describe(weights: Pinned, kv: Pinned) -> dict[str, Any]:
    """The buffers' part of hotswap_info's backend_detail."""
    return {
        "kv_host_backup_bytes": kv.nbytes,
        "kv_host_backup_pin_s": kv.pin_s,
        "kv_host_backup_error": kv.error,
        "host_backup_bytes": weights.nbytes,
        "host_backup_state": weights.state(),
        "host_backup_pin_s": weights.pin_s,
        "host_backup_error": weights.error,
    }
