"""The level-2 disk tier's files (worker_ext/disktier.py) on CPU, with the codec's torch
reference: a file round-trips; a truncated file, a flipped byte anywhere, another format
version or another key end in TierRefused (the caller reloads), never in wrong bytes; the
directory keeps to its budget."""

from __future__ import annotations

import os
import struct
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from worker_ext import codec, devmodels, disktier

SIZES = (3 * codec.BLOCK * 2 + 10, codec.CHUNK_WORDS * 2 + 4 * codec.BLOCK)  # bytes, even


def _records() -> list[torch.Tensor]:
    out = []
    for i, n in enumerate(SIZES):
        t = torch.empty(n // 2, dtype=torch.bfloat16)
        devmodels.realistic_fill_(t, f"layers.{i}.mlp.down_proj", 7 + i)
        out.append(t.view(torch.uint8).clone())
    out[1][5::1000] = 0xFF  # some bytes that are no bf16 pattern (NaNs and -NaNs)
    return out


def _digest(records: list[torch.Tensor]) -> list[list[int]]:
    rows = []
    for r in records:
        w = r.view(torch.int16).to(torch.int64)
        pos = torch.arange(1, w.numel() + 1, dtype=torch.int64)
        rows.append([int(w.sum()), int((w * pos).sum())])
    return rows


KEY = disktier.Key("llama-test", "0.26.0", 0, SIZES)
RECORDED: dict[Path, disktier.Record] = {}  # what "the engine" recorded per directory


def _write(directory: Path, records: list[torch.Tensor], budget: int = 1 << 30) -> dict:
    entries, blobs = [], []
    for r, data in enumerate(records):
        for chunks, piece in codec.encode(data, piece_chunks=1):
            off = sum(e[2] for e in entries if e[0] == r)
            entries.append(
                (
                    r,
                    off,
                    min(chunks * 2 * codec.CHUNK_WORDS, data.numel() - off),
                    chunks,
                    piece.numel(),
                )
            )
            blobs.append(piece)
    done = disktier.write(directory, KEY, entries, blobs.__getitem__, _digest(records), budget)
    if done["written"]:
        RECORDED[directory] = disktier.Record(done["header_sha256"], _digest(records))
    return done


def _restore(
    directory: Path, key: disktier.Key = KEY, read_bytes: int = disktier.READ_BYTES
) -> list[torch.Tensor]:
    out = [torch.zeros(n, dtype=torch.uint8) for n in key.sizes]

    def queue(header: disktier.Header, i: int, buf: torch.Tensor) -> None:
        p = header.pieces[i]
        lo = p.file_off - header.payload_off
        raw = codec.decode_piece(buf[lo : lo + p.size], p.n_chunks)
        out[p.record][p.dev_off : p.dev_off + p.raw_bytes] = raw[: p.raw_bytes]

    disktier.restore(
        directory,
        key,
        RECORDED.get(directory),
        lambda n: torch.empty(n, dtype=torch.uint8),
        queue,
        lambda: None,
        lambda: _digest(out),
        threads=3,
        read_bytes=read_bytes,
    )
    return out


@pytest.fixture(scope="module")
def records() -> list[torch.Tensor]:
    return _records()


def test_roundtrip(tmp_path: Path, records: list[torch.Tensor]) -> None:
    done = _write(tmp_path, records)
    assert done["written"], done
    assert (tmp_path / KEY.filename()).stat().st_size == done["bytes"]
    assert done["bytes"] < 0.75 * sum(SIZES)  # coded, not raw
    back = _restore(tmp_path)
    assert all(torch.equal(a, b) for a, b in zip(back, records, strict=True))
    assert not list(tmp_path.glob(".*.tmp"))  # the temporary name is gone


@pytest.mark.parametrize("cut", [1, 4096, 100_000, -1])
def test_truncated_file_is_refused(tmp_path: Path, records: list[torch.Tensor], cut: int) -> None:
    _write(tmp_path, records)
    path = tmp_path / KEY.filename()
    size = path.stat().st_size
    os.truncate(path, size // 2 if cut == -1 else size - cut)
    with pytest.raises(disktier.TierRefused, match=r"truncated|shorter|damaged"):
        _restore(tmp_path)


def test_appended_file_is_refused(tmp_path: Path, records: list[torch.Tensor]) -> None:
    _write(tmp_path, records)
    with open(tmp_path / KEY.filename(), "ab") as f:
        f.write(b"\0" * 16)
    with pytest.raises(disktier.TierRefused, match="truncated"):
        _restore(tmp_path)


def test_wrong_format_version_is_refused(tmp_path: Path, records: list[torch.Tensor]) -> None:
    _write(tmp_path, records)
    path = tmp_path / KEY.filename()
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", disktier.FORMAT_VERSION + 1))
    with pytest.raises(disktier.TierRefused, match="format version"):
        _restore(tmp_path)


def test_another_key_is_refused(tmp_path: Path, records: list[torch.Tensor]) -> None:
    _write(tmp_path, records)
    other = disktier.Key("llama-test", "0.27.0", 0, SIZES)
    with pytest.raises(disktier.TierRefused, match="no such file"):
        _restore(tmp_path, other)  # another vLLM: another name, never opened
    os.replace(tmp_path / KEY.filename(), tmp_path / other.filename())
    with pytest.raises(disktier.TierRefused, match="vllm_version"):
        _restore(tmp_path, other)  # the same name by force: the header's key decides


def _file_regions(path: Path) -> dict[str, list[int]]:
    """Byte offsets of interest in one written file: header, meta rows, payload parts."""
    header = disktier.read_header(path, KEY, RECORDED[path.parent])
    raw = path.read_bytes()
    regions: dict[str, list[int]] = {
        "fixed": [0, 9, 13, 17],
        "header": [30, header.payload_off - 4096 + 40],
    }
    regions["meta"], regions["sbytes"], regions["planes"], regions["boff"], regions["exc"] = (
        [],
        [],
        [],
        [],
        [],
    )
    for p in header.pieces:
        meta = torch.frombuffer(
            bytearray(raw[p.file_off : p.file_off + p.n_chunks * 64]), dtype=torch.int32
        ).view(-1, 16)
        for c, row in enumerate(meta.tolist()):
            base = p.file_off + row[codec.OFF]
            regions["meta"] += [p.file_off + c * 64 + 4 * j for j in (0, 1, 2, 3, 4, 5, 6, 7)]
            regions["sbytes"].append(base + 17)
            if row[codec.K]:
                regions["planes"].append(base + row[codec.PACKED] + 3)
                regions["boff"] += [base + row[codec.BOFF] + 4 + j for j in range(4)]
                if row[codec.NEXC]:
                    regions["exc"].append(base + row[codec.EXC])
    return regions


@pytest.mark.parametrize("region", ["fixed", "header", "meta", "sbytes", "planes", "boff", "exc"])
def test_flipped_byte_is_refused(tmp_path: Path, records: list[torch.Tensor], region: str) -> None:
    _write(tmp_path, records)
    path = tmp_path / KEY.filename()
    offsets = _file_regions(path)[region]
    assert offsets, region
    good = path.read_bytes()
    for off in offsets[:6]:
        bad = bytearray(good)
        bad[off] ^= 0x5A
        path.write_bytes(bytes(bad))
        with pytest.raises(disktier.TierRefused):
            _restore(tmp_path)
    path.write_bytes(good)
    assert all(torch.equal(a, b) for a, b in zip(_restore(tmp_path), records, strict=True))


@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(st.data())
def test_any_flipped_bit_ends_in_refusal_or_the_right_bytes(
    tmp_path: Path, records: list[torch.Tensor], data: st.DataObject
) -> None:
    if not (tmp_path / KEY.filename()).exists():
        _write(tmp_path, records)
    path = tmp_path / KEY.filename()
    good = path.read_bytes()
    off = data.draw(st.integers(min_value=0, max_value=len(good) - 1))
    bit = data.draw(st.integers(min_value=0, max_value=7))
    bad = bytearray(good)
    bad[off] ^= 1 << bit
    path.write_bytes(bytes(bad))
    try:
        back = _restore(tmp_path)
    except disktier.TierRefused:
        pass
    else:  # only a flip in padding may pass, and then the bytes are the right ones
        assert all(torch.equal(a, b) for a, b in zip(back, records, strict=True)), off
    finally:
        path.write_bytes(good)


def test_budget_removes_the_oldest_and_refuses_what_cannot_fit(
    tmp_path: Path, records: list[torch.Tensor]
) -> None:
    size = _write(tmp_path, records)["bytes"]
    old = tmp_path / "r0-0000000000000000000000000000older.hswt"
    old.write_bytes(b"\0" * 1000)
    os.utime(old, (1, 1))  # the oldest
    done = _write(tmp_path, records, budget=size + 500)
    assert done["written"], done
    assert old.name in done["removed"], done
    assert disktier.usage(tmp_path) <= size + 500
    small = _write(tmp_path, records, budget=size - 1)
    assert not small["written"]
    assert "budget" in small["reason"]


def test_pieces_are_queued_while_later_ones_are_still_read(
    tmp_path: Path, records: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The restore pipelines: piece 0 goes to its copy and decode before the file's last
    read is done (the old restore read the whole file first), in small reads here."""
    assert _write(tmp_path, records)["written"]
    header = disktier.read_header(tmp_path / KEY.filename(), KEY, RECORDED[tmp_path])
    first_end = header.pieces[0].file_off + header.pieces[0].size
    assert first_end + 8 * 4096 < header.total
    log: list[str] = []
    real = os.preadv
    queued_first = threading.Event()

    waited: list[bool] = []

    def preadv(fd: int, bufs: list, off: int) -> int:
        if off >= first_end + 4 * 4096 and not waited:  # wait once (bounded) for queue 0
            waited.append(queued_first.wait(timeout=5))
        log.append(f"read {off}")
        return real(fd, bufs, off)

    monkeypatch.setattr(disktier.os, "preadv", preadv)
    out = [torch.zeros(n, dtype=torch.uint8) for n in KEY.sizes]

    def queue(header: disktier.Header, i: int, buf: torch.Tensor) -> None:
        log.append(f"queue {i}")
        queued_first.set()
        p = header.pieces[i]
        lo = p.file_off - header.payload_off
        raw = codec.decode_piece(buf[lo : lo + p.size], p.n_chunks)
        out[p.record][p.dev_off : p.dev_off + p.raw_bytes] = raw[: p.raw_bytes]

    def drain() -> None:
        log.append("drain")

    done = disktier.restore(
        tmp_path,
        KEY,
        RECORDED[tmp_path],
        lambda n: torch.empty(n, dtype=torch.uint8),
        queue,
        drain,
        lambda: _digest(out),
        threads=1,
        read_bytes=4096,
    )
    reads = [i for i, e in enumerate(log) if e.startswith("read")]
    assert len(reads) > 3, log
    assert log.index("queue 0") < reads[-1], log
    assert log[-1] == "drain"
    assert done["read_s"] > 0
    assert all(torch.equal(a, b) for a, b in zip(out, records, strict=True))


def test_a_failed_read_midway_is_refused_after_queued_pieces(
    tmp_path: Path, records: list[torch.Tensor], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read that fails after some pieces were queued ends in TierRefused (the caller
    reloads), the readers stop and the file is closed; drain is not called."""
    assert _write(tmp_path, records)["written"]
    real = os.preadv
    calls = []

    def preadv(fd: int, bufs: list, off: int) -> int:
        calls.append(off)
        if len(calls) > 6:
            raise OSError(5, "Input/output error")
        return real(fd, bufs, off)

    monkeypatch.setattr(disktier.os, "preadv", preadv)
    drained = []
    with pytest.raises(disktier.TierRefused, match="Input/output error"):
        disktier.restore(
            tmp_path,
            KEY,
            RECORDED[tmp_path],
            lambda n: torch.empty(n, dtype=torch.uint8),
            lambda h, i, b: None,
            lambda: drained.append(1),
            lambda: [],
            threads=2,
            read_bytes=4096,
        )
    assert not drained


# -- what the engine recorded, and the files on disk (docs/contracts.md §1.4) ------------


def test_a_file_this_engine_did_not_write_is_refused(
    tmp_path: Path, records: list[torch.Tensor]
) -> None:
    """Other weights written under the same name, whole and with their own digest in the
    header (what anyone who can write the directory can make): the recorded header hash
    and digest refuse it (the old check compared the digest with the file's own field)."""
    assert _write(tmp_path, records)["written"]
    ours = RECORDED[tmp_path]
    other = [r.clone() for r in records]
    other[0][100:110] ^= 0x01
    assert _write(tmp_path, other)["written"]  # the same key, so the same name
    RECORDED[tmp_path] = ours
    with pytest.raises(disktier.TierRefused, match="not the file this engine recorded"):
        _restore(tmp_path)
    RECORDED[tmp_path] = disktier.Record(ours.header_sha256, _digest(other))
    with pytest.raises(disktier.TierRefused):  # even with a matching digest: not our header
        _restore(tmp_path)
    RECORDED.pop(tmp_path)
    with pytest.raises(disktier.TierRefused, match="recorded"):  # nothing recorded: refused
        _restore(tmp_path)


def test_a_symlink_is_refused_not_followed(tmp_path: Path, records: list[torch.Tensor]) -> None:
    assert _write(tmp_path, records)["written"]
    path = tmp_path / KEY.filename()
    elsewhere = tmp_path / "elsewhere"
    os.replace(path, elsewhere)
    path.symlink_to(elsewhere)
    with pytest.raises(disktier.TierRefused, match="symbolic link"):
        _restore(tmp_path)
    assert disktier.usage(tmp_path) == 0  # a symlink is no tier file, nor counted


def test_a_fifo_cannot_hang_the_wake(tmp_path: Path, records: list[torch.Tensor]) -> None:
    assert _write(tmp_path, records)["written"]
    path = tmp_path / KEY.filename()
    path.unlink()
    os.mkfifo(path)
    errors: list[BaseException] = []

    def wake() -> None:
        try:
            _restore(tmp_path)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=wake, daemon=True)
    t.start()
    t.join(10)
    hung = t.is_alive()
    if hung:  # free the old code's blocked open, so the thread ends
        fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        t.join(10)
    assert not hung, "the restore blocked on a FIFO"
    assert errors, "the restore neither refused nor hung"
    assert isinstance(errors[0], disktier.TierRefused), errors
    assert "not a regular file" in str(errors[0])


def test_the_temporary_name_is_never_followed(tmp_path: Path, records: list[torch.Tensor]) -> None:
    """A symlink planted at the writer's (predictable) temporary name: the write fails
    and the file it points to is untouched (O_EXCL|O_NOFOLLOW; the old O_TRUNC wrote it)."""
    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    directory = tmp_path / "tier"
    directory.mkdir(mode=0o700)
    tmp = directory / f".{KEY.filename()}.{os.getpid()}.{threading.get_ident()}.tmp"
    tmp.symlink_to(victim)
    with pytest.raises(FileExistsError):
        _write(directory, records)
    assert victim.read_bytes() == b"precious"
    assert not (directory / KEY.filename()).exists()


def test_dead_writers_temporary_files_are_counted_and_swept(tmp_path: Path) -> None:
    dead = tmp_path / f".{KEY.filename()}.1.2.tmp"
    dead.write_bytes(b"\0" * 5000)
    live = tmp_path / f".{KEY.filename()}.3.4.tmp"
    live.write_bytes(b"\0" * 3000)
    fd = os.open(live, os.O_RDONLY)
    try:
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX)  # a writer still at work holds its lock
        assert disktier.usage(tmp_path) == 8000  # the budget counts both
        assert disktier.sweep(tmp_path) == [dead.name]
        assert not dead.exists()
        assert live.exists()
        assert disktier.usage(tmp_path) == 3000
    finally:
        os.close(fd)


def test_a_writer_killed_mid_write_leaves_what_the_next_start_sweeps(tmp_path: Path) -> None:
    """A real process killed (SIGKILL) inside a write: its temporary file stays, counted in
    the usage; once it is gone, sweep removes it (what the backend runs at start)."""
    import signal
    import subprocess
    import sys

    code = (
        "import sys, time; from pathlib import Path; from worker_ext import disktier\n"
        "key = disktier.Key('m', 'v', 0, (1 << 20,))\n"
        "def piece(i):\n"
        "    print('writing', flush=True); time.sleep(60); return b''\n"
        "entries = [(0, 0, 1 << 20, 1, 1 << 20)]\n"
        "disktier.write(Path(sys.argv[1]), key, entries, piece, 'd', 1 << 30)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, env=env
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == b"writing"
        temps = list(tmp_path.glob(".*.tmp"))
        assert len(temps) == 1
        assert disktier.sweep(tmp_path) == []  # its writer is alive: kept
        assert disktier.usage(tmp_path) == temps[0].stat().st_size > 0
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
    assert disktier.sweep(tmp_path) == [temps[0].name]
    assert disktier.usage(tmp_path) == 0


def test_the_directory_is_made_private_and_checked(tmp_path: Path) -> None:
    made = tmp_path / "a" / "tier"
    disktier.ensure_dir(made)
    assert made.stat().st_mode & 0o777 == 0o700
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o777)
    disktier.ensure_dir(loose)
    assert loose.stat().st_mode & 0o022 == 0
    link = tmp_path / "link"
    link.symlink_to(made)
    with pytest.raises(disktier.TierRefused, match="not a directory"):
        disktier.ensure_dir(link)
    if os.geteuid() == 0:
        theirs = tmp_path / "theirs"
        theirs.mkdir()
        os.chown(theirs, 65534, -1)
        with pytest.raises(disktier.TierRefused, match="owned by uid 65534"):
            disktier.ensure_dir(theirs)


def test_the_next_sleep_waits_for_the_writer_with_a_bound(tmp_path: Path) -> None:
    """A writer slower than the bound is asked to stop and stops at its next chunk (its
    temporary file removed); one stuck in a call is reported, never waited on for good."""
    key = disktier.Key("m", "v", 0, (3 * disktier.WRITE_BYTES,))
    gate = threading.Event()
    cancel = threading.Event()
    data = bytes(3 * disktier.WRITE_BYTES)
    entries = [(0, 0, len(data), 1, len(data))]
    done: list[object] = []

    def piece(i: int) -> bytes:
        gate.wait(30)
        return data

    def run() -> None:
        try:
            done.append(disktier.write(tmp_path, key, entries, piece, "d", 1 << 40, cancel))
        except disktier.TierRefused as exc:
            done.append(exc)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    stuck = threading.Thread(target=gate.wait, args=(30,), daemon=True)
    stuck.start()
    with pytest.raises(RuntimeError, match="did not stop"):
        disktier.join_writer(stuck, threading.Event(), wait_s=0.1, stop_s=0.1)
    real = os.pwrite

    def pwrite(fd: int, buf: object, off: int) -> int:
        cancel.set()  # asked to stop during its first chunk: stops before the next
        return real(fd, buf, off)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(disktier.os, "pwrite", pwrite)
        gate.set()
        disktier.join_writer(t, cancel, wait_s=10, stop_s=10)
    assert isinstance(done[0], disktier.TierRefused), done
    assert not list(tmp_path.glob(".*.tmp"))
    assert not (tmp_path / key.filename()).exists()
