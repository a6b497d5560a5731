"""worker_ext.cumem.kvlend: a sleeping rank's KV records lent to a rank waking on the same
device, over a real Unix socket in one process (pipes stand in for the driver's exported
descriptors); the driver's side (mapping lent memory) is in test_cudriver."""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from support.fds import fd_closed, pipe_fd

from worker_ext.cumem import kvlend
from worker_ext.settings import Tuning, WorkerSettings


@pytest.fixture
def name() -> Iterator[str]:
    return kvlend.address(f"test-{uuid.uuid4()}")


def test_nothing_listens_so_nothing_is_lent(name: str) -> None:
    assert kvlend.connect(name) is None


def test_lent_descriptors_reach_the_inbox_and_those_not_taken_are_closed(name: str) -> None:
    box = kvlend.Inbox.open(name)
    assert box is not None
    assert kvlend.Inbox.open(name) is None  # one listener per device
    mine = [(pipe_fd(), 4096), (pipe_fd(), 8192), (pipe_fd(), 8192)]
    sock = kvlend.connect(name)
    assert sock is not None
    assert kvlend.lend(sock, mine) == 3
    for fd, _n in mine:
        os.close(fd)  # the lender's own: what went is the inbox's now
    got = box.take(8192)
    assert got is not None
    assert got[1] == 8192
    assert not fd_closed(got[0])
    os.close(got[0])
    assert box.received == 3
    left = [fds for fds in box._lent.values() for fds in fds]
    assert box.close() == 2
    assert all(fd_closed(fd) for fd in left)
    assert kvlend.connect(name) is None  # closed: nobody listens


def test_take_is_the_best_fit_by_size(name: str) -> None:
    """Exact, else the largest smaller one of at least three quarters (a new allocation maps
    the rest); never a larger one: the H200's driver refused to map part of one."""
    box = kvlend.Inbox.open(name)
    assert box is not None
    sock = kvlend.connect(name)
    assert sock is not None
    fds = [pipe_fd() for _ in range(3)]
    kvlend.lend(sock, list(zip(fds, [100, 300, 200], strict=True)))
    for fd in fds:
        os.close(fd)
    assert box.take(500) is None  # 300 < three quarters of it: a create
    taken = []
    for want in (200, 320, 120):
        got = box.take(want)
        assert got is not None
        os.close(got[0])
        taken.append(got[1])
    # exact; else the largest smaller (>= 3/4 of it); never a larger one
    assert taken == [200, 300, 100]
    assert box.take(100) is None
    box.close()


class _Rec:
    def __init__(self, n: int) -> None:
        self.handle = (0, n, 0x1000, 0)
        self.is_asleep = False


def _settings(on: bool = True) -> WorkerSettings:
    return WorkerSettings(tuning=Tuning(kv_lend=on))


def _lending(uid: str) -> kvlend.Lending:
    """A waking rank's side (it lends nothing here)."""

    def never(_x: Any) -> Any:
        raise AssertionError("the waking side lent")

    return kvlend.Lending(lambda: uid, lambda: _settings(), never, never)


def test_a_lending_sleep_exports_releases_then_sends(name: str) -> None:
    """The lender exports each record before its release, releases it as usual, and sends
    the descriptors once; the waking rank's inbox maps them by size."""
    order: list[str] = []
    uid = name[len(kvlend.address("")) :]
    waking = _lending(uid)
    waking.open()
    assert waking.inbox is not None

    def export(handle: Any) -> tuple[int, int]:
        order.append(f"export {handle[1]}")
        return pipe_fd(), handle[1]

    def release(data: Any) -> None:
        order.append(f"release {data.handle[1]}")

    sleeping = kvlend.Lending(lambda: uid, lambda: _settings(), release, export)
    lender = sleeping.lender()
    for n in (4096, 8192):
        lender(_Rec(n))
    timings: dict[str, float] = {}
    lender.send(timings)
    assert order == ["export 4096", "release 4096", "export 8192", "release 8192"]
    assert timings["kv_lent_records"] == 2
    assert timings["kv_lent_bytes"] == 4096 + 8192
    assert sleeping.lent_total == 4096 + 8192  # kept out of what it reports holding
    got = waking.lent(8192)
    assert got is not None
    assert got[1] == 8192
    os.close(got[0])
    closed: dict[str, float] = {}
    waking.close(closed, 8192)
    assert closed == {"kv_cache_lent_bytes": 8192, "kv_lent_received": 2.0, "kv_lent_unused": 1.0}
    assert waking.inbox is None


@pytest.mark.parametrize("why", ["nobody listens", "lending off", "no device uuid"])
def test_without_a_listener_the_release_is_the_plain_one(name: str, why: str) -> None:
    uid = name[len(kvlend.address("")) :]
    waking = _lending(uid)
    if why != "nobody listens":
        waking.open()

    def no_uuid() -> str:
        raise RuntimeError("no CUDA")

    released: list[int] = []

    def export(handle: Any) -> int:
        raise AssertionError("exported with nobody to lend to")

    sleeping = kvlend.Lending(
        no_uuid if why == "no device uuid" else lambda: uid,
        lambda: _settings(why != "lending off"),
        lambda d: released.append(d.handle[1]),
        export,
    )
    lender = sleeping.lender()
    lender(_Rec(4096))
    timings: dict[str, float] = {}
    lender.send(timings)
    assert released == [4096]
    assert timings == {}
    if waking.inbox is not None:
        assert waking.lent(4096) is None
        waking.close()


def test_a_record_that_cannot_be_exported_is_released_all_the_same(name: str) -> None:
    uid = name[len(kvlend.address("")) :]
    waking = _lending(uid)
    waking.open()
    released: list[int] = []

    def export(handle: Any) -> int:
        raise OSError("fabric handle only")

    sleeping = kvlend.Lending(
        lambda: uid, lambda: _settings(), lambda d: released.append(d.handle[1]), export
    )
    lender = sleeping.lender()
    lender(_Rec(4096))
    timings: dict[str, float] = {}
    lender.send(timings)
    assert released == [4096]
    assert timings["kv_lent_records"] == 0
    assert timings["kv_lend_export_failed"] == 1
    waking.close()


def test_lending_is_on_by_default() -> None:
    assert WorkerSettings.from_env({}).tuning.kv_lend is True


def test_lent_memory_that_fits_no_record_goes_back_after_a_while(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A create may be waiting for the memory a victim lent in pieces too small for the
    records still to map: STALE_S after the last one received or taken, they are closed."""
    box = kvlend.Inbox.open(name)
    assert box is not None
    sock = kvlend.connect(name)
    assert sock is not None
    fds = [pipe_fd(), pipe_fd()]
    kvlend.lend(sock, [(fds[0], 100), (fds[1], 100)])
    for fd in fds:
        os.close(fd)
    assert box.take(1000) is None  # too small: kept a while (another record may fit)
    held = [fd for fds in box._lent.values() for fd in fds]
    assert len(held) == 2
    assert all(not fd_closed(fd) for fd in held)
    now = [kvlend.time.monotonic() + kvlend.STALE_S + 1]
    monkeypatch.setattr(kvlend.time, "monotonic", lambda: now[0])
    assert box.take(1000) is None
    assert box.dropped == 2
    assert all(fd_closed(fd) for fd in held)
    box.close()
