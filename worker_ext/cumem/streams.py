"""The copy streams: cudaMemcpyAsync of at most CHUNK_BYTES, round-robin over N_STREAMS
streams, never crossing a registration of the host buffer; and the copies a resume left
queued, which the next backend call waits for first."""

from __future__ import annotations

from typing import Any

from worker_ext.codec import Copy
from worker_ext.cudart import CHUNK_BYTES, REGISTER_BYTES, CudaRT

N_STREAMS = 2


class CopyStreams:
    """Two streams (a coded copy encodes or decodes on the second); the copies a resume
    queued stay `pending` until `wait()`."""

    def __init__(self, torch: Any, device: Any, cudart: CudaRT) -> None:
        self._torch = torch
        self._device = device
        self._cudart = cudart
        self._streams: list[Any] = []
        self._pending: list[Any] = []  # streams whose queued copies nobody has waited for
        self._dma_events: tuple[Any, list[Any]] | None = None  # (start, end per stream)
        self.last_dma_s: float | None = None  # GPU time of the last resume's copies

    def all(self) -> list[Any]:
        if not self._streams:
            self._streams = [self._torch.cuda.Stream(self._device) for _ in range(N_STREAMS)]
        return self._streams

    def current(self) -> Any:
        return self._torch.cuda.current_stream(self._device)

    def after_current(self, streams: list[Any]) -> None:
        """Order `streams` after the worker's current stream."""
        current = self.current()
        for s in streams:
            s.wait_stream(current)

    def start(self) -> Any:
        """Order the copy streams after the worker's current stream; the start event."""
        self.after_current(self.all())
        start = self._torch.cuda.Event(enable_timing=True)
        start.record(self.all()[0])
        return start

    def synchronize(self) -> None:
        """Wait for everything queued on the copy streams."""
        for s in self.all():
            s.synchronize()

    def queue(self, dev: int, host: int, host_off: int, size: int, to_host: bool, k: int) -> int:
        """Queue one record's copies in CHUNK_BYTES pieces (cut at host-offset multiples, so
        no copy spans two registrations) round-robin over the streams; returns the next k."""
        streams = self.all()
        pos = 0
        while pos < size:
            off = host_off + pos
            n = min(size - pos, (off // CHUNK_BYTES + 1) * CHUNK_BYTES - off)
            s = streams[k % len(streams)]
            if to_host:
                self._cudart.memcpy_async(host + off, dev + pos, n, s.cuda_stream)
            else:
                self._cudart.memcpy_async(dev + pos, host + off, n, s.cuda_stream)
            pos += n
            k += 1
        return k

    def copier(self, host: int) -> Copy:
        """The codec's copy between its staging and the host buffer at `host`, cut where
        the buffer's registrations meet (no copy spans two)."""
        memcpy = self._cudart.memcpy_async

        def copy(host_off: int, dev: int, n: int, to_host: bool, stream: int) -> None:
            pos = 0
            while pos < n:
                off = host_off + pos
                m = min(n - pos, (off // REGISTER_BYTES + 1) * REGISTER_BYTES - off)
                if to_host:
                    memcpy(host + off, dev + pos, m, stream)
                else:
                    memcpy(dev + pos, host + off, m, stream)
                pos += m

        return copy

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def hand_over(self, start: Any) -> None:
        """A resume's copies are queued: later work on the current stream sees the bytes
        (no host wait); `wait()` waits for them and times them from `start`."""
        current = self.current()
        ends = []
        for s in self.all():
            ends.append(s.record_event(self._torch.cuda.Event(enable_timing=True)))
            current.wait_stream(s)
        self._pending = self.all()
        self._dma_events = (start, ends)

    def wait(self) -> None:
        """Wait for the copies a resume handed over; their GPU time in `last_dma_s`."""
        for s in self._pending:
            s.synchronize()
        self._pending = []
        if self._dma_events is not None:  # first copy queued -> last copy done, on the GPU
            start, ends = self._dma_events
            self.last_dma_s = max(start.elapsed_time(e) for e in ends) / 1000.0
            self._dma_events = None
