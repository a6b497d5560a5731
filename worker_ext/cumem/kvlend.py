"""The KV cache's memory handed from a sleeping rank to a waking one on the same device
(docs/contracts.md §1, "the KV memory lent"): the driver scrubs memory another process has
just released before it hands it out again (about 0.18 s per 100 GiB), and a refused create
slows the release itself; the physical memory passed as exported handles needs neither.

A waking rank whose KV pool is asleep opens an `Inbox`: a listening Unix socket of the
SOCK_SEQPACKET kind in the abstract namespace, named by this user and the device's UUID
(`address`). A sleeping rank about to release KV records (their bytes discarded anyway)
`connect`s to that name; where a waking rank of the same user listens, it exports each
record's handle as a file descriptor, releases the record as usual, and `lend`s the
descriptors with their sizes in one message; the descriptors in flight keep the memory
alive. The waking rank takes a descriptor for each KV record (`Inbox.take`, the best fit by
size) and maps the memory behind it in place of a create (cudriver.Driver.create_and_map);
whatever it does not take is closed when the inbox is (the memory then goes back to the
driver). Both ends check the other's user id
(SO_PEERCRED); nothing blocks: a connect or send that cannot go at once lends nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import struct
import time
from collections.abc import Callable, Iterable
from typing import Any

from worker_ext.pools import KV_CACHE

MAX_FDS = 200  # descriptors per message (the kernel's limit is 253)
# Lent memory no record took for this long (since the last one received or taken) is given
# back: none of the records still to map fits it, and a create may be waiting for it.
STALE_S = 0.1
_MSG = 1 << 16


def address(device_uuid: str) -> str:
    """The rendezvous name of one device for this user (abstract: no file)."""
    return f"\0hotswap-kv-{os.getuid()}-{device_uuid}"


def _peer_uid(sock: socket.socket) -> int:
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", raw)
    return int(uid)


def connect(name: str) -> socket.socket | None:
    """A connection to the waking rank listening at `name`, or None (none listens, or not
    this user's)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.setblocking(False)
    try:
        sock.connect(name)
        if _peer_uid(sock) != os.getuid():
            raise PermissionError("the listener is another user's")
    except OSError:
        sock.close()
        return None
    return sock


def lend(sock: socket.socket, lent: list[tuple[int, int]]) -> int:
    """Send (descriptor, size) pairs; the caller closes its descriptors after (those sent
    are the receiver's now). Returns how many went; a send that fails sends nothing more."""
    sent = 0
    try:
        for i in range(0, len(lent), MAX_FDS):
            part = lent[i : i + MAX_FDS]
            msg = json.dumps({"sizes": [n for _fd, n in part]}).encode()
            socket.send_fds(sock, [msg], [fd for fd, _n in part])
            sent += len(part)
    except OSError:
        pass
    finally:
        sock.close()
    return sent


class Inbox:
    """A waking rank's listener and the descriptors lent to it, by size."""

    def __init__(self, name: str) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._sock.setblocking(False)
        try:
            self._sock.bind(name)
            self._sock.listen(8)
        except OSError:  # another rank of this device listens (or no abstract names)
            self._sock.close()
            raise
        self._conns: list[socket.socket] = []
        self._lent: dict[int, list[int]] = {}
        self.received = 0  # descriptors received
        self.taken = 0  # descriptors taken
        self.dropped = 0  # descriptors closed untaken after STALE_S
        self._moved = time.monotonic()  # the last one received or taken

    @classmethod
    def open(cls, name: str) -> Inbox | None:
        with contextlib.suppress(OSError):
            return cls(name)
        return None

    def poll(self) -> None:
        """Accept the connections waiting and read what they sent (never blocks)."""
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, OSError):
                break
            conn.setblocking(False)
            try:
                mine = _peer_uid(conn) == os.getuid()
            except OSError:
                mine = False
            if not mine:  # not this user's: nothing it sends is read
                conn.close()
                continue
            self._conns.append(conn)
        for conn in list(self._conns):
            self._read(conn)

    def _read(self, conn: socket.socket) -> None:
        while True:
            try:
                data, fds, _flags, _addr = socket.recv_fds(conn, _MSG, MAX_FDS)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data, fds = b"", []
            if not data:  # the lender is done (or gone)
                _close(fds)
                conn.close()
                self._conns.remove(conn)
                return
            try:
                sizes = [int(n) for n in json.loads(data)["sizes"]]
            except (ValueError, KeyError, TypeError):
                sizes = []
            if len(sizes) != len(fds):
                _close(fds)
                continue
            for fd, n in zip(fds, sizes, strict=True):
                self._lent.setdefault(n, []).append(fd)
            self.received += len(fds)
            self._moved = time.monotonic()

    def take(self, size: int) -> tuple[int, int] | None:
        """For a record of `size` bytes: a lent descriptor (the caller owns it now) and its
        allocation's size, or None. The allocation of exactly that size, else the largest
        smaller one of at least three quarters of it (a new allocation maps the rest): two
        models' KV records differ by a few blocks (cudriver); never a larger one (the driver
        refused to map part of an allocation on the H200). Lent memory that fits none for
        STALE_S is closed (a create of the record may be waiting for that memory)."""
        self.poll()
        sizes = [n for n, fds in self._lent.items() if fds]
        if not sizes:
            return None
        fits = [n for n in sizes if n <= size]
        n = max(fits) if fits else 0
        if n * 4 < size * 3:  # the new allocation after it would be more than a quarter
            if time.monotonic() - self._moved > STALE_S:  # what nothing took: back to the driver
                left = [fd for fds in self._lent.values() for fd in fds]
                self._lent = {}
                self.dropped += len(left)
                _close(left)
            return None
        self.taken += 1
        self._moved = time.monotonic()
        return self._lent[n].pop(0), n

    def close(self) -> int:
        """Stop listening; close every descriptor not taken. Returns how many were closed."""
        with contextlib.suppress(OSError):
            self.poll()
        self._sock.close()
        for conn in self._conns:
            conn.close()
        self._conns = []
        left = [fd for fds in self._lent.values() for fd in fds]
        self._lent = {}
        _close(left)
        return len(left)


def _close(fds: Iterable[int]) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Lending:
    """One backend's side: its inbox while a wake maps a discarded KV pool back, and the
    lending of a sleep's KV records released first. `uuid`: the device's UUID (an error or
    None: nothing is lent or borrowed); `settings`: the worker's (its tuning's `kv_lend`)."""

    def __init__(
        self,
        uuid: Callable[[], str | None],
        settings: Callable[[], Any],
        release: Callable[[Any], None],
        export: Callable[[Any], tuple[int, int]],
    ) -> None:
        self._uuid = uuid
        self._settings = settings
        self._release = release  # one record, as the backend releases it
        self._export = export  # one record's memory: a POSIX descriptor and its size
        self.inbox: Inbox | None = None
        # every byte this process ever lent: the driver may go on counting lent memory as
        # this process's while the borrower holds it (Residency.resident takes it out)
        self.lent_total = 0

    def _name(self) -> str | None:
        if not self._settings().tuning.kv_lend:
            return None
        try:
            uuid = self._uuid()
        except Exception:  # no UUID to meet on: nothing lent or borrowed
            return None
        return address(uuid) if uuid else None

    def open(self, wanted: bool = True) -> None:
        """Listen for memory lent to this rank (once per wake; nothing if another rank of
        this device listens already); `wanted`: its KV pool is asleep, discarded."""
        if wanted and self.inbox is None:
            name = self._name()
            self.inbox = Inbox.open(name) if name else None

    def lent(self, size: int) -> tuple[int, int] | None:
        """Inbox.take, while the inbox is open (cudriver.Lent)."""
        return self.inbox.take(size) if self.inbox is not None else None

    def mapped(self, tag: str, timings: dict[str, float], imported: int) -> None:
        """A pool was mapped back: the KV pool's closes the inbox (`imported`: the bytes its
        records mapped from lent memory)."""
        if tag == KV_CACHE:
            self.close(timings, imported)

    def close(self, timings: dict[str, float] | None = None, mapped: int = 0) -> None:
        """Stop listening; the descriptors not taken are closed (their memory freed).
        `mapped`: the bytes the KV pool's records mapped from lent memory."""
        box, self.inbox = self.inbox, None
        if box is None:
            return
        unused = box.close()
        if timings is not None:
            timings["kv_cache_lent_bytes"] = float(mapped)
        if timings is not None and box.received:
            timings["kv_lent_received"] = float(box.received)
            timings["kv_lent_unused"] = float(unused)

    def lender(self, release: Callable[[Any], None] | None = None) -> Lender:
        """The release of one KV record, lending it first where a waking rank of this
        device listens (its descriptor exported, then the record released as usual, or by
        `release`); `send` on the returned object hands the lent ones over."""
        name = self._name()
        sock = connect(name) if name else None
        return Lender(sock, release or self._release, self._export, self._count)

    def _count(self, n: int) -> None:
        self.lent_total += n


class Lender:
    """Lending.lender's release of one KV record; `send` hands the lent ones over."""

    def __init__(
        self,
        sock: socket.socket | None,
        release: Callable[[Any], None],
        export: Callable[[Any], tuple[int, int]],
        sent: Callable[[int], None] = lambda _n: None,
    ) -> None:
        self._sock = sock
        self._release = release
        self._export = export
        self._sent = sent  # told the bytes that went
        self._items: list[tuple[int, int]] = []
        self.export_failed = 0

    def __call__(self, data: Any) -> None:
        got = None
        if self._sock is not None:
            try:
                got = self._export(data.handle)
            except Exception:  # not exportable (another handle type): released as usual
                self.export_failed += 1
        self._release(data)
        if got is not None:
            self._items.append(got)

    def send(self, timings: dict[str, float]) -> None:
        """Hand the lent records over (once), then close this side's descriptors."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        t = time.perf_counter()
        sent = lend(sock, self._items) if self._items else 0
        if not self._items:
            sock.close()
        _close(fd for fd, _n in self._items)
        timings["kv_lent_records"] = float(sent)
        timings["kv_lent_bytes"] = float(sum(n for _fd, n in self._items[:sent]))
        self._sent(int(timings["kv_lent_bytes"]))
        timings["kv_lend_send_s"] = time.perf_counter() - t
        if self.export_failed:
            timings["kv_lend_export_failed"] = float(self.export_failed)
        self._items = []
