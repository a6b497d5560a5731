"""The backend's part of the level-2 disk tier (worker_ext/disktier.py): before a level-2
sleep discards the weights, their coded bytes go to a file in the background, keyed by
the parameters' bytes; a level-2 wake reads them back and decodes them into place, or
says why not (then the reload brings them back)."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from worker_ext import codec, disktier, fpkernel, vllmcompat
from worker_ext import ranges as byteranges
from worker_ext.cudart import HostBuffer
from worker_ext.cumem.coded import CodedCopies
from worker_ext.cumem.records import Records, ranges
from worker_ext.cumem.streams import CopyStreams
from worker_ext.pools import WEIGHTS
from worker_ext.rawmem import raw_bytes
from worker_ext.settings import WorkerSettings

log = logging.getLogger(__name__)


class TierPart:
    """The file the next level-2 wake reads, the writer writing it, and what this engine
    wrote (no other file is accepted: docs/contracts.md §1.4)."""

    def __init__(
        self,
        worker: Any,
        torch: Any,
        device: Any,
        parts: tuple[Records, CopyStreams, CodedCopies],
        host_for: Callable[[int], HostBuffer],
        settings: Callable[[], WorkerSettings],
    ) -> None:
        self._worker = worker
        self._torch = torch
        self._device = device
        self._records, self._streams, self._coded = parts
        self._host_for = host_for
        self._settings = settings
        self.key: disktier.Key | None = None  # the weights a level-2 sleep put away
        self._spans: list[tuple[int, int]] = []  # the bytes its key digests
        self._writer: threading.Thread | None = None
        self._cancel = threading.Event()  # asks the writer to stop (a bounded join)
        # what this engine wrote (file name -> its header's hash and digest)
        self._written: dict[str, disktier.Record] = {}
        self._report: dict[str, Any] = {}  # the last write and the last restore
        self.restored: dict[str, Any] | None = None
        self._sweep()

    def directory(self) -> Path | None:
        disk_dir = self._settings().disk_dir
        if not disk_dir or self._coded.get_codec() is None:
            return None
        return Path(disk_dir)

    def describe(self) -> dict[str, Any]:
        directory = self.directory()
        usage = None
        if directory is not None and directory.is_dir():
            usage = disktier.usage(directory)
        settings = self._settings()
        return {
            "dir": settings.disk_dir or None,
            "budget_bytes": settings.disk_budget_bytes,
            "usage_bytes": usage,
            "writing": self.writing(),
            # the file the next level-2 wake reads (its key: these weights' bytes), or None
            "pending": self.key.filename() if self.key is not None else None,
            "last": dict(self._report),
        }

    def writing(self) -> bool:
        return self._writer is not None and self._writer.is_alive()

    def _sweep(self) -> None:
        """At start: what a writer killed mid-write left (its temporary file) goes."""
        disk_dir = self._settings().disk_dir
        if disk_dir:
            try:
                directory = Path(disk_dir)
                disktier.ensure_dir(directory)
                self._report["swept"] = disktier.sweep(directory)
            except Exception as exc:  # the tier is an optimisation: its writes report it
                log.warning("hotswap: disk tier not swept: %s", exc)

    def join_writer(self) -> None:
        """The writer reads the host buffer until it is done: wait for it (bounded)."""
        writer = self._writer
        if writer is not None and writer is not threading.current_thread():
            disktier.join_writer(writer, self._cancel)

    def _keyed_spans(
        self, spans: list[tuple[int, int]], rewritten: Sequence[tuple[int, int]]
    ) -> list[tuple[int, int]]:
        """The (start, end) spans of `spans` (start, size) that the tier file alone brings
        back, the parameters, from word boundaries. Left out: the allocator's free blocks
        (no tensor holds them; a level-2 wake maps fresh memory under them) and
        `rewritten`, the bytes the snapshot writes back after the wake (buffers and other
        tensors, some of which serving changes: a key over them differed between two
        sleeps of the same weights, so every level-2 sleep wrote a new file). What the
        file holds of those is overwritten, then verified. Taken at the sleep; the wake
        digests the same spans (the key's record sizes hold them in place)."""
        return byteranges.left_over(
            [(p, p + n) for p, n in spans], [*self._records.free_ranges(), *rewritten], word=8
        )

    def _digest(self, spans: list[tuple[int, int]]) -> str:
        """A digest of the bytes of `spans` on the device (verify's kernel sums, in order)."""
        sums = fpkernel.SpanCheck([(s, e - s) for s, e in spans], self._device).sums()
        return hashlib.sha256(json.dumps(sums).encode()).hexdigest()

    def _key_for(self, spans: list[tuple[int, int]], fingerprint: str) -> disktier.Key:
        config = getattr(self._worker, "model_config", None)
        model = str(getattr(config, "model", None) or type(self._worker).__name__)
        version = vllmcompat.vllm_version()
        rank = int(getattr(self._worker, "rank", 0) or 0)
        return disktier.Key(model, version, rank, tuple(n for _, n in spans), fingerprint)

    def put_away(
        self,
        recs: list[tuple[int, Any]],
        timings: dict[str, float],
        rewritten: Sequence[tuple[int, int]] = (),
    ) -> None:
        """Before a level-2 sleep discards the weights: the key of their bytes, and unless
        the tier holds that file already, their coded pieces on the host and a background
        thread that writes them (the sleep does not wait for the disk)."""
        self.key = None
        directory, gc = self.directory(), self._coded.made
        if directory is None or gc is None or not recs:
            return
        t = time.perf_counter()
        try:
            spans = ranges(recs)
            keyed = self._keyed_spans(spans, rewritten)
            key = self._key_for(spans, self._digest(keyed))
            self.key, self._spans = key, keyed
            try:
                disktier.read_header(
                    directory / key.filename(), key, self._written.get(key.filename())
                )
                self._report["write"] = {"written": False, "reason": "already on disk"}
                return
            except disktier.TierRefused:
                pass
            self.join_writer()
            self._write_in_background(directory, key, gc, gc.plan(spans))
        except Exception as exc:  # the tier is an optimisation: the wake reloads
            self._report["write"] = {"written": False, "reason": f"{type(exc).__name__}: {exc}"}
            log.warning("hotswap: disk tier skipped: %s", self._report["write"]["reason"])
        finally:
            timings["tier_put_away_s"] = time.perf_counter() - t

    def _write_in_background(
        self, directory: Path, key: disktier.Key, gc: codec.GpuCodec, plan: codec.Plan
    ) -> None:
        """Code the weights into the host buffer, then start the thread that writes it."""
        host = self._host_for(plan.total)
        q = self._coded.sleep_queue(gc, plan, host)
        for piece in plan.pieces:
            q.queue(piece)
        self._streams.all()[1].synchronize()
        self._coded.release_scratch()
        entries = [(p.rng, p.dev_off, p.raw_bytes, p.n_chunks, p.size) for p in plan.pieces]
        offs = [p.host_off for p in plan.pieces]
        view = raw_bytes(host.ptr, plan.total, self._torch.device("cpu"))
        budget = self._settings().disk_budget_bytes
        self._cancel = cancel = threading.Event()

        def write() -> None:
            try:
                done = disktier.write(
                    directory,
                    key,
                    entries,
                    lambda i: view[offs[i] : offs[i] + entries[i][4]],
                    key.fingerprint,
                    budget,
                    cancel,
                )
                record = disktier.Record(done.pop("header_sha256", ""), key.fingerprint)
                if done.get("written"):
                    self._written[key.filename()] = record
            except Exception as exc:  # reported in describe(); the next wake reloads
                done = {"written": False, "reason": f"{type(exc).__name__}: {exc}"}
            self._report["write"] = done
            if not done.get("written"):
                log.warning("hotswap: disk tier not written: %s", done.get("reason"))

        self._writer = threading.Thread(target=write, name="hotswap-tier", daemon=True)
        self._writer.start()

    def restore(self, timings: dict[str, float]) -> dict[str, Any]:
        """After a level-2 resume mapped the weights: their bytes from the tier file, checked
        and decoded into place, or why not (then the reload brings them back)."""
        key, self.key = self.key, None
        directory, gc = self.directory(), self._coded.made
        t = time.perf_counter()
        report: dict[str, Any]
        try:
            if key is None or directory is None or gc is None:
                raise disktier.TierRefused("no tier file for these weights")
            if self.writing():
                raise disktier.TierRefused("the tier file is still being written")
            spans = ranges(self._records.of(WEIGHTS))
            if tuple(n for _, n in spans) != key.sizes:
                raise disktier.TierRefused("the weights records changed since the sleep")
            report = self._read_back(directory, key, spans)
            report["used"] = True
        except Exception as exc:  # refused or failed: the reload brings the weights back
            reason = str(exc) if isinstance(exc, disktier.TierRefused) else repr(exc)
            report = {"used": False, "reason": reason}
            if key is not None and directory is not None and "being written" not in reason:
                path = directory / key.filename()  # refused: the next sleep writes it anew
                self._written.pop(key.filename(), None)
                report["removed"] = path.exists()
                path.unlink(missing_ok=True)
            log.warning("hotswap: disk tier not used, reloading: %s", reason)
        self._coded.release_scratch()
        timings["tier_restore_s"] = time.perf_counter() - t
        self._report["restore"] = report
        return report

    def _read_back(
        self, directory: Path, key: disktier.Key, spans: list[tuple[int, int]]
    ) -> dict[str, Any]:
        """The file's pieces read into the host buffer, each copied to the device and
        decoded into place as it arrives; the bytes' digest checked against the key."""
        held: dict[str, HostBuffer] = {}

        def alloc(n: int) -> Any:
            held["host"] = self._host_for(n)
            return raw_bytes(held["host"].ptr, n, self._torch.device("cpu"))

        wq: list[codec.WakeQueue] = []  # made at the first piece read

        def queue(header: disktier.Header, i: int, _buf: Any) -> None:
            p = header.pieces[i]
            piece = codec.Piece(
                p.record,
                p.dev_off,
                p.raw_bytes,
                0,
                p.n_chunks,
                p.size,
                p.file_off - header.payload_off,
            )
            if not wq:
                total = sum(key.sizes)
                plan = codec.Plan(spans, [], None, None, header.payload_bytes(), total)
                self._streams.after_current(self._streams.all()[:2])
                wq.append(self._coded.wake_queue(plan, held["host"], track=False))
            wq[0].queue(piece)

        def drain() -> None:
            self._streams.synchronize()
            if wq:
                self._coded.last_wake = wq[0].profile_summary()
            self._coded.release_scratch()

        try:
            return disktier.restore(
                directory,
                key,
                self._written.get(key.filename()),
                alloc,
                queue,
                drain,
                lambda: self._digest(self._spans),
                self._settings().tuning.disk_threads,
            )
        finally:  # refused midway: what was queued still reads the host buffer
            if wq:
                self._streams.synchronize()

    def take_restored(self) -> dict[str, Any] | None:
        """The last tier restore's report, once."""
        out, self.restored = self.restored, None
        return out
