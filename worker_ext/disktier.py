"""The level-2 disk tier's files: the weights pool's runtime bytes, coded by worker_ext/codec.py,
written once to a local directory and read back instead of vLLM's reload_weights.

A file holds one rank's weights records as the codec's pieces, keyed by the model, the vLLM
version, the parallel rank and the records' sizes (`Key`); its name carries a digest of the
key, so a changed model or vLLM never opens an old file. Layout:

  magic (8) | format version u32 | header length u32 | header crc32 u32 | 0 u32 |
  header (JSON, utf-8) | zero padding to ALIGN | the pieces, each at its `file_off` (a
  multiple of ALIGN, so a piece read into a page-aligned host buffer starts on a page)

The header names the key, every record's size and pieces (file offset, size, chunks, raw
bytes, offset in the record), the file's total size and a digest of the raw bytes (the
caller's: fpkernel's per-piece sums on CUDA). What makes a read refuse, with its reason,
so that the caller reloads instead (never a wrong weight):

- a missing file, another magic or format version, a header whose crc32 differs, a key
  that is not the caller's (model, vLLM version, rank, record sizes), a file shorter or
  longer than its header says (truncated, appended);
- a piece whose meta rows do not describe a valid piece of its record (checked on the host
  before the device reads it, so no corrupt offset sends the decoder outside its piece);
- after decoding, a digest of the bytes that differs from the header's (the caller's check).

A file is used only as the engine recorded it when it wrote it (`Record`: a SHA-256 of the
header and the caller's digest of the raw bytes, kept in the engine's memory, never read
from the file): a header that hashes otherwise is refused (a file this engine did not
write), and the decoded bytes' digest is compared with the recorded one, not the file's
own field (docs/contracts.md §1.4, the threat model: the caller's digest is keyed).

On disk (`ensure_dir`, `_open`): the directory is made 0700 and must be a real directory of
the engine's user (group and other write removed); reads open with O_NOFOLLOW|O_NONBLOCK
and take only a regular file (a symlink or a FIFO is refused, never waited on), the header
and the payload through one descriptor. Writes go to a temporary name opened with
O_CREAT|O_EXCL|O_NOFOLLOW and held under an exclusive flock, are fsynced and renamed into
place, so a reader sees a whole file or none; a temporary file whose writer died (its lock
is free) is swept (`sweep`) at start and before a write, and the budget counts temporary
files too. A writer stops between chunks when asked (`cancel`). The directory's budget
(bytes) is kept by removing the oldest files first; a file that alone exceeds the budget
is not written, and the writer says so.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import logging
import os
import stat
import struct
import threading
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from worker_ext import codec

MAGIC = b"HSWTIER\x00"
FORMAT_VERSION = 2  # 2: every piece starts on ALIGN in the file (1: pieces back to back)
ALIGN = 4096
SUFFIX = ".hswt"
_FIXED = struct.Struct("<8sIIII")
# one pread: 16 MiB reads on 16 threads (settings.Tuning.disk_threads) read a warm file
# fastest of the sizes tried (docs/benchmarks.md)
READ_BYTES = 16 << 20
WRITE_BYTES = 64 << 20  # one pwrite; a writer asked to stop stops between them
TMP_SUFFIX = ".tmp"
# the next sleep waits this long for the previous background write, then asks it to stop
# and waits WRITER_STOP_S more (a writer still in the disk then fails that sleep)
WRITER_WAIT_S = 60.0
WRITER_STOP_S = 10.0
log = logging.getLogger(__name__)


class TierRefused(Exception):
    """This file cannot be used; the message says why (the caller reloads)."""


@dataclass(frozen=True)
class Record:
    """What the engine keeps of a file it wrote: its header's SHA-256 and the digest of the
    raw bytes it brings back. The file itself can supply neither."""

    header_sha256: str
    digest: Any


@dataclass(frozen=True)
class Key:
    model: str
    vllm_version: str
    rank: int
    sizes: tuple[int, ...]  # the weights records' sizes, in address order
    fingerprint: str = ""  # a digest of the bytes themselves (a changed checkpoint: a new file)

    def as_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "vllm_version": self.vllm_version,
            "rank": self.rank,
            "sizes": list(self.sizes),
            "fingerprint": self.fingerprint,
        }

    def filename(self) -> str:
        blob = json.dumps(self.as_json(), sort_keys=True).encode()
        return f"r{self.rank}-{hashlib.sha256(blob).hexdigest()[:32]}{SUFFIX}"


@dataclass
class TierPiece:
    record: int  # index into the key's sizes
    dev_off: int  # byte offset inside the record
    raw_bytes: int
    n_chunks: int
    size: int  # encoded bytes
    file_off: int


@dataclass
class Header:
    key: Key
    pieces: list[TierPiece]
    digest: Any  # the caller's digest of the raw bytes (JSON-able)
    total: int  # file size
    payload_off: int

    def payload_bytes(self) -> int:
        return self.total - self.payload_off


def _aligned(pos: int) -> int:
    return (pos + ALIGN - 1) // ALIGN * ALIGN


def _header_blob(key: Key, pieces: list[TierPiece], digest: Any, total: int, payload: int) -> bytes:
    doc = {
        "key": key.as_json(),
        "codec": "exp",
        "pieces": [
            [p.record, p.dev_off, p.raw_bytes, p.n_chunks, p.size, p.file_off] for p in pieces
        ],
        "digest": digest,
        "total": total,
        "payload_off": payload,
        "written_at": time.time(),
    }
    return json.dumps(doc, sort_keys=True).encode()


def layout(
    key: Key, entries: list[tuple[int, int, int, int, int]], digest: Any
) -> tuple[bytes, Header]:
    """The header bytes and header of a file holding `entries` (record, dev_off, raw_bytes,
    n_chunks, size) in that order. The payload offset depends on the header's length, which
    depends on the offsets: fixed by trying a payload offset until it holds."""
    payload = ALIGN
    while True:
        pieces: list[TierPiece] = []
        pos = payload
        for rec, dev_off, raw, n_ch, size in entries:
            pos = _aligned(pos)  # a whole page: the host-to-device copy reads whole pages
            pieces.append(TierPiece(rec, dev_off, raw, n_ch, size, pos))
            pos += size
        blob = _header_blob(key, pieces, digest, pos, payload)
        if _FIXED.size + len(blob) <= payload:
            return blob, Header(key, pieces, digest, pos, payload)
        payload = (_FIXED.size + len(blob) + ALIGN - 1) // ALIGN * ALIGN


def ensure_dir(directory: Path) -> None:
    """Make the directory (0700) or accept an existing one only if it is a directory (not a
    symlink) of this user; group and other write permission is taken away. TierRefused
    otherwise (the tier is then not used: the wake reloads)."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = os.lstat(directory)
    except OSError as exc:
        raise TierRefused(f"{directory}: {exc}") from exc
    if not stat.S_ISDIR(st.st_mode):
        raise TierRefused(f"{directory}: not a directory (a symlink or another file)")
    if st.st_uid != os.geteuid():
        raise TierRefused(f"{directory}: owned by uid {st.st_uid}, not this engine's")
    if st.st_mode & 0o022:
        os.chmod(directory, stat.S_IMODE(st.st_mode) & ~0o022)
        log.warning("hotswap: disk tier %s was group/other writable: made it %o", directory,
                    stat.S_IMODE(st.st_mode) & ~0o022)  # fmt: skip


def _regular(directory: Path, pattern: str) -> list[tuple[Path, os.stat_result]]:
    out = []
    for p in directory.glob(pattern):
        try:
            st = os.lstat(p)
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):
            out.append((p, st))
    return sorted(out)


def tier_files(directory: Path) -> list[Path]:
    """The tier's files (regular files only: never a symlink's target)."""
    return [p for p, _ in _regular(directory, f"*{SUFFIX}")]


def usage(directory: Path) -> int:
    """Bytes the tier takes: its files and the temporary files (a live or a dead writer's)."""
    found = _regular(directory, f"*{SUFFIX}") + _regular(directory, f".*{TMP_SUFFIX}")
    return sum(st.st_size for _, st in found)


def sweep(directory: Path) -> list[str]:
    """Remove the temporary files whose writer is gone (their flock is free): what a writer
    killed mid-write leaves. A live writer's (this or another engine's) is kept."""
    removed = []
    for p, _ in _regular(directory, f".*{TMP_SUFFIX}"):
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            continue  # its writer holds it
        finally:
            os.close(fd)
        p.unlink(missing_ok=True)
        removed.append(p.name)
    return removed


def make_room(directory: Path, need: int, budget: int, keep: Path | None = None) -> list[str]:
    """Remove dead writers' temporary files, then the oldest tier files until `need` more
    bytes fit the budget (a live writer's temporary file counts, and stays); their names."""
    removed = sweep(directory)
    files = sorted(_regular(directory, f"*{SUFFIX}"), key=lambda f: f[1].st_mtime)
    total = usage(directory)
    for p, st in files:
        if total + need <= budget:
            break
        if keep is not None and p == keep:
            continue
        total -= st.st_size
        p.unlink(missing_ok=True)
        removed.append(p.name)
    return removed


def write(
    directory: Path,
    key: Key,
    entries: list[tuple[int, int, int, int, int]],
    read_piece: Callable[[int], Any],
    digest: Any,
    budget: int,
    cancel: threading.Event | None = None,
) -> dict[str, Any]:
    """Write one tier file: piece i's bytes come from `read_piece(i)` (a uint8 CPU tensor
    or bytes-like of entries[i]'s size). Atomic (a temporary name opened O_EXCL|O_NOFOLLOW
    under an exclusive flock, fsync, rename); keeps the directory within `budget` bytes;
    stops between chunks once `cancel` is set. Returns what it did, with `header_sha256`
    for the caller's `Record` (never raises for a full budget; TierRefused when cancelled
    or for a directory it may not use)."""
    t0 = time.perf_counter()
    blob, header = layout(key, entries, digest)
    if header.total > budget:
        return {"written": False, "reason": f"{header.total} B exceed the budget of {budget} B"}
    ensure_dir(directory)
    final = directory / key.filename()
    removed = make_room(directory, header.total, budget, keep=None)
    tmp = directory / f".{final.name}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(tmp, flags, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held until closed: `sweep` leaves it alone
        fixed = _FIXED.pack(MAGIC, FORMAT_VERSION, len(blob), zlib.crc32(blob), 0)
        head = fixed + blob
        os.pwrite(fd, head + b"\0" * (header.payload_off - len(head)), 0)
        for i, p in enumerate(header.pieces):
            data = read_piece(i)
            view = memoryview(data.numpy() if isinstance(data, torch.Tensor) else data).cast("B")
            if len(view) != p.size:
                raise ValueError(f"piece {i}: {len(view)} bytes, expected {p.size}")
            done = 0
            while done < p.size:
                if cancel is not None and cancel.is_set():
                    raise TierRefused(f"{final.name}: the write was stopped")
                end = min(p.size, done + WRITE_BYTES)
                done += os.pwrite(fd, view[done:end], p.file_off + done)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, final)
    os.close(fd)
    return {
        "written": True,
        "path": final.name,
        "bytes": header.total,
        "removed": removed,
        "write_s": time.perf_counter() - t0,
        "header_sha256": hashlib.sha256(blob).hexdigest(),
    }


def join_writer(
    thread: threading.Thread,
    cancel: threading.Event,
    wait_s: float = WRITER_WAIT_S,
    stop_s: float = WRITER_STOP_S,
) -> None:
    """Wait for a background `write` at most `wait_s`, then set `cancel` (it stops at its
    next chunk, removing its temporary file) and wait `stop_s` more. RuntimeError when it
    is still running then (stuck in the disk): the caller must not reuse what it reads."""
    thread.join(wait_s)
    if not thread.is_alive():
        return
    cancel.set()
    log.warning("hotswap: disk tier write still running after %.0f s: stopping it", wait_s)
    thread.join(stop_s)
    if thread.is_alive():
        raise RuntimeError(f"the disk tier's writer did not stop in {wait_s + stop_s:.0f} s")


def _open(path: Path) -> int:
    """A read-only descriptor of `path` if it is a regular file (O_NOFOLLOW: a symlink is
    refused; O_NONBLOCK, cleared after the check: a FIFO never blocks the open)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise TierRefused(f"{path.name}: no such file") from None
    except OSError as exc:
        why = "a symbolic link" if exc.errno == errno.ELOOP else str(exc)
        raise TierRefused(f"{path.name}: {why}") from exc
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise TierRefused(f"{path.name}: not a regular file")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _pread_all(fd: int, n: int, off: int) -> bytes:
    out = b""
    while len(out) < n:
        got = os.pread(fd, n - len(out), off + len(out))
        if not got:
            break
        out += got
    return out


def read_header(path: Path, key: Key, record: Record | None) -> Header:
    """The file's header, if the file is whole, is `key`'s and is the one `record` says
    this engine wrote (None: no file was recorded, so none is accepted); else TierRefused."""
    fd = _open(path)
    try:
        return _header_of(fd, path, key, record)
    finally:
        os.close(fd)


def _header_of(fd: int, path: Path, key: Key, record: Record | None) -> Header:
    try:
        size = os.fstat(fd).st_size
        fixed = _pread_all(fd, _FIXED.size, 0)
        if len(fixed) < _FIXED.size:
            raise TierRefused(f"{path.name}: {size} bytes, shorter than a header")
        magic, version, hlen, crc, _ = _FIXED.unpack(fixed)
        if magic != MAGIC:
            raise TierRefused(f"{path.name}: not a tier file (magic {magic!r})")
        if version != FORMAT_VERSION:
            raise TierRefused(f"{path.name}: format version {version}, expected {FORMAT_VERSION}")
        blob = _pread_all(fd, min(hlen, max(0, size - _FIXED.size)), _FIXED.size)
    except OSError as exc:
        raise TierRefused(f"{path.name}: {exc}") from exc
    if len(blob) != hlen or zlib.crc32(blob) != crc:
        raise TierRefused(f"{path.name}: header damaged (crc32 differs)")
    if record is None or hashlib.sha256(blob).hexdigest() != record.header_sha256:
        raise TierRefused(f"{path.name}: not the file this engine recorded (header hash)")
    try:
        doc = json.loads(blob)
        got = doc["key"]
        pieces = [TierPiece(*map(int, row)) for row in doc["pieces"]]
        total, payload = int(doc["total"]), int(doc["payload_off"])
    except (ValueError, KeyError, TypeError) as exc:
        raise TierRefused(f"{path.name}: header unreadable: {exc}") from exc
    if got != key.as_json():
        diff = sorted(k for k in key.as_json() if got.get(k) != key.as_json()[k])
        raise TierRefused(f"{path.name}: written for another {', '.join(diff) or 'key'}")
    if size != total:
        raise TierRefused(f"{path.name}: {size} bytes, the header says {total} (truncated?)")
    pos = payload
    for i, p in enumerate(pieces):
        pos = _aligned(pos)
        if p.file_off != pos or p.size <= 0 or not 0 <= p.record < len(key.sizes):
            raise TierRefused(f"{path.name}: piece {i} out of place")
        if p.dev_off + p.raw_bytes > key.sizes[p.record]:
            raise TierRefused(f"{path.name}: piece {i} reaches past its record")
        pos += p.size
    if pos != total:
        raise TierRefused(f"{path.name}: pieces end at {pos}, the file at {total}")
    return Header(key, pieces, doc.get("digest"), total, payload)


class _Reader:
    """Parallel preads of a file's payload into `dst`, issued in file order (each thread
    takes the next span), with a watermark: the bytes from the start that are all read, so
    the caller can use piece i while later pieces are still on their way."""

    def __init__(
        self,
        path: Path,
        header: Header,
        dst: Any,
        threads: int,
        read_bytes: int = READ_BYTES,
        fd: int | None = None,
    ) -> None:
        self.path, self.header = path, header
        self.n = n = header.payload_bytes()
        self.view = view = memoryview(dst).cast("B")
        if len(view) < n:
            raise ValueError(f"buffer of {len(view)} bytes for {n}")
        self.spans = [(o, min(read_bytes, n - o)) for o in range(0, n, read_bytes)]
        self._done = [False] * len(self.spans)
        self._next = 0  # the next span a thread takes
        self._mark = 0  # spans [0, mark) are all read
        self._error: BaseException | None = None
        self._cv = threading.Condition()
        self.t0 = time.perf_counter()
        self.last_read_s = 0.0
        self._fd = _open(path) if fd is None else os.dup(fd)
        k = max(1, min(threads, len(self.spans)))
        self._workers = [threading.Thread(target=self._work, daemon=True) for _ in range(k)]
        for w in self._workers:
            w.start()

    def _work(self) -> None:
        while True:
            with self._cv:
                if self._error is not None or self._next >= len(self.spans):
                    return
                j = self._next
                self._next += 1
            off, m = self.spans[j]
            try:
                got = os.preadv(self._fd, [self.view[off : off + m]], self.header.payload_off + off)
                if got != m:
                    raise TierRefused(f"{self.path.name}: short read at {off} ({got} of {m})")
            except BaseException as exc:
                with self._cv:
                    self._error = self._error or exc
                    self._cv.notify_all()
                return
            with self._cv:
                self._done[j] = True
                while self._mark < len(self.spans) and self._done[self._mark]:
                    self._mark += 1
                if self._mark == len(self.spans):
                    self.last_read_s = time.perf_counter() - self.t0
                self._cv.notify_all()

    def _raise(self) -> None:
        err = self._error
        if err is not None:
            raise err if isinstance(err, TierRefused) else TierRefused(f"{self.path.name}: {err}")

    def wait_until(self, end: int) -> None:
        """Block until the payload's bytes [0, end) are read (TierRefused on a failed read)."""
        with self._cv:
            while True:
                self._raise()
                read = self.spans[self._mark][0] if self._mark < len(self.spans) else self.n
                if read >= end:
                    return
                self._cv.wait()

    def close(self) -> float:
        """Stop taking spans, join the threads, close the file; seconds to the last read."""
        with self._cv:
            if self._error is None and self._mark < len(self.spans):
                self._error = TierRefused(f"{self.path.name}: reading stopped")
                stopped = True
            else:
                stopped = False
        for w in self._workers:
            w.join()
        os.close(self._fd)
        if not stopped:
            self._raise()
        return self.last_read_s


def read_payload(
    path: Path,
    header: Header,
    dst: Any,
    threads: int = 16,
    read_bytes: int = READ_BYTES,
) -> float:
    """Read every piece into `dst` (a writable buffer of header.payload_bytes(), e.g. a
    pinned host buffer's memoryview) with `threads` parallel preads; seconds taken."""
    reader = _Reader(path, header, dst, threads, read_bytes)
    try:
        reader.wait_until(reader.n)
    finally:
        reader.close()
    return reader.last_read_s


def check_piece(piece: Any, entry: TierPiece) -> None:
    """TierRefused unless `piece` (uint8 CPU tensor, entry.size bytes) is a valid encoded
    piece of entry.raw_bytes: every meta row's width, words, offsets and sizes agree with
    the codec's layout and stay inside the piece. In numpy: it runs on the thread that
    queues the pieces' copies, once per piece, where torch's per-op cost on these few rows
    added up to a visible share of a tier wake (docs/benchmarks.md)."""
    c = entry.n_chunks
    if c <= 0 or c * codec.META_BYTES > entry.size:
        raise TierRefused(f"piece at {entry.file_off}: {c} chunks in {entry.size} bytes")
    rows = piece[: c * codec.META_BYTES].numpy().view(np.int32)
    meta = rows.reshape(c, codec.META_INTS).astype(np.int64)
    words = entry.raw_bytes // 2
    want_n = np.full(c, codec.CHUNK_WORDS, dtype=np.int64)
    want_n[-1] = words - (c - 1) * codec.CHUNK_WORDS
    k, off, n, nexc = (
        meta[:, codec.K],
        meta[:, codec.OFF],
        meta[:, codec.NWORDS],
        meta[:, codec.NEXC],
    )
    ok = bool(np.array_equal(n, want_n)) and entry.raw_bytes % 2 == 0
    ok = ok and bool(((k == 0) | (k == 2) | (k == 3) | (k == 4)).all())
    ok = ok and bool(((nexc >= 0) & (nexc <= n)).all())
    if ok:  # every offset recomputed from the sizes, as codec.layout sets them
        sizes = meta[:, codec.SIZE]
        ends = np.cumsum(sizes)
        head = codec.header_bytes(c)
        a = codec.PIECE_ALIGN
        size = (head + int(ends[-1]) + a - 1) // a * a
        ok = size == entry.size and bool(np.array_equal(head + ends - sizes, off))
    if ok:  # every row's part offsets and size, as payload_size computes them
        want = codec.payload_sizes(k, n, nexc)
        got = meta[:, [codec.PACKED, codec.BOFF, codec.EXC, codec.SIZE]]
        ok = bool(np.array_equal(got, want))
    if not ok:
        raise TierRefused(f"piece at file offset {entry.file_off}: its chunk rows are not valid")


def restore(
    directory: Path,
    key: Key,
    record: Record | None,
    alloc: Callable[[int], Any],
    queue: Callable[[Header, int, Any], None],
    drain: Callable[[], None],
    digest: Callable[[], Any],
    threads: int = 16,
    read_bytes: int = READ_BYTES,
) -> dict[str, Any]:
    """Read `key`'s file into `alloc(n)` (a uint8 CPU tensor of n bytes, e.g. over a pinned
    buffer) with parallel reads in file order; as soon as piece i is read, check its rows
    and `queue(header, i, buffer)` (the caller starts putting it into its record: its copy
    and decode run while later pieces are still read); once every piece is queued,
    `drain()` (the caller waits for its decodes), then compare `digest()` of the decoded
    bytes with `record`'s (what the engine recorded when it wrote the file; the file's
    header must hash as recorded too). TierRefused, with the reason, at the first thing
    that is not right; the caller's drain has then not run, and it must wait for what it
    queued."""
    t0 = time.perf_counter()
    path = directory / key.filename()
    fd = _open(path)
    try:
        header = _header_of(fd, path, key, record)
        buf = alloc(header.payload_bytes())
        reader = _Reader(path, header, buf.numpy(), threads, read_bytes, fd=fd)
    finally:
        os.close(fd)
    check_s = 0.0
    try:
        for i, p in enumerate(header.pieces):
            lo = p.file_off - header.payload_off
            reader.wait_until(lo + p.size)
            t = time.perf_counter()
            check_piece(buf[lo : lo + p.size], p)
            check_s += time.perf_counter() - t
            queue(header, i, buf)
    finally:
        read_s = reader.close()
    t = time.perf_counter()
    drain()
    decode_s = time.perf_counter() - t
    got = digest()
    assert record is not None  # the header was accepted only against a record
    if json.loads(json.dumps(got)) != json.loads(json.dumps(record.digest)):
        raise TierRefused(f"{path.name}: the decoded bytes differ from the recorded digest")
    return {
        "path": path.name,
        "bytes": header.total,
        "raw_bytes": sum(key.sizes),
        "read_s": read_s,
        "check_s": check_s,
        "decode_s": decode_s,
        "restore_s": time.perf_counter() - t0,
    }
