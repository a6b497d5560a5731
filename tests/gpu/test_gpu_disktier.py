"""The level-2 disk tier on a real GPU: a level-2 wake takes the weights from the tier file
(no reload_weights), and a damaged file ends in a reload that says why, tokens equal and
verified every time; a truncated or older-format file is written again at the next sleep."""

from __future__ import annotations

import json
import os
import struct
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.gpu.conftest import Engine
from worker_ext import codec

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def tier_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tier")


@pytest.fixture(scope="module")
def llama(
    model_dir: Callable[[str], Path], engines: Callable[..., Engine], tier_dir: Path
) -> Iterator[Engine]:
    old = os.environ.get("HOTSWAP_DISK_DIR")
    os.environ["HOTSWAP_DISK_DIR"] = str(tier_dir)  # the engine's process inherits it
    try:
        yield engines(model_dir("llama"))
    finally:
        if old is None:
            os.environ.pop("HOTSWAP_DISK_DIR", None)
        else:
            os.environ["HOTSWAP_DISK_DIR"] = old


def _tier(eng: Engine) -> dict:
    return eng.rpc("hotswap_info")["backend_detail"]["tier"]  # type: ignore[no-any-return]


def _written(eng: Engine) -> dict:
    deadline = time.monotonic() + 120
    while _tier(eng)["writing"]:
        assert time.monotonic() < deadline, "the tier file was not written in 120 s"
        time.sleep(0.2)
    return _tier(eng)


def _cycle(eng: Engine, base: object, damage: Callable[[Path], None] | None = None) -> dict:
    """A level-2 sleep, its tier file written, `damage` done to the file the wake will
    read (between the write and the wake), the wake: verified, tokens equal."""
    eng.sleep(2)
    tier = _written(eng)
    assert tier["pending"], tier
    path = Path(tier["dir"]) / tier["pending"]
    assert path.is_file(), (path, tier)
    assert Path(tier["dir"]).stat().st_mode & 0o022 == 0, tier  # the engine's own
    if damage is not None:
        damage(path)
    w = eng.wake(2)
    assert w["verify"]["mismatched"] == [], w["verify"]
    assert eng.gen() == base
    return {"tier": tier, "reload": w["reload"], "path": path}


def _flip(path: Path) -> None:
    """A byte the decoder reads (the first piece's first chunk, past its rows): the header
    is whole, the decoded bytes' digest differs."""
    data = bytearray(path.read_bytes())
    hlen = struct.unpack_from("<I", data, 12)[0]
    _rec, _dev_off, _raw, n_chunks, _size, off = json.loads(data[24 : 24 + hlen])["pieces"][0]
    data[off + codec.header_bytes(n_chunks) + 10] ^= 0x5A
    path.write_bytes(bytes(data))


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _version(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 999))


def _rewritten_header(path: Path) -> None:
    """The header rewritten whole and valid (its crc32 right), one value changed: no
    longer the file this engine recorded (docs/contracts.md §1.4)."""
    data = bytearray(path.read_bytes())
    hlen = struct.unpack_from("<I", data, 12)[0]
    blob = bytes(data[24 : 24 + hlen])
    at = blob.index(b'"written_at": ') + len(b'"written_at": ')
    blob = blob[:at] + (b"1" if blob[at : at + 1] != b"1" else b"2") + blob[at + 1 :]
    data[24 : 24 + hlen] = blob
    struct.pack_into("<I", data, 16, zlib.crc32(blob))
    path.write_bytes(bytes(data))


def _symlink(path: Path) -> None:
    moved = path.with_name("moved-away")
    os.replace(path, moved)
    path.symlink_to(moved)


def _fifo(path: Path) -> None:
    path.unlink()
    os.mkfifo(path)


def test_level2_wake_from_disk_then_faults_end_in_reload(llama: Engine, tier_dir: Path) -> None:
    base = llama.gen()
    first = _cycle(llama, base)
    assert first["tier"]["last"]["write"]["written"], first
    assert first["reload"]["source"] == "disk", first["reload"]
    assert first["tier"]["usage_bytes"] == sum(p.stat().st_size for p in tier_dir.glob("*.hswt"))
    print(f"[tier] from disk: {first['reload']['tier']}")

    # the same weights, woken from the file: the next level-2 sleep finds that file (its
    # key leaves out the free blocks and the bytes the snapshot writes back, which serving
    # can change: a key over them once differed between two sleeps) and writes nothing
    same = _cycle(llama, base)
    assert same["tier"]["pending"] == first["tier"]["pending"], (first["tier"], same["tier"])
    assert same["tier"]["last"]["write"] == {"written": False, "reason": "already on disk"}, same
    assert same["reload"]["source"] == "disk", same["reload"]

    # each damage, done between the sleep's write and the wake, ends in a reload that says
    # why and removes the file; the next sleep writes it again and the wake uses it
    damages = (
        ("flipped byte", _flip),
        ("truncated", _truncate),
        ("version", _version),
        ("rewritten header", _rewritten_header),
        ("symlink", _symlink),
        ("fifo", _fifo),
    )
    for name, damage in damages:
        hit = _cycle(llama, base, damage)
        assert hit["reload"]["source"] == "reload", (name, hit["reload"])
        assert not hit["reload"]["tier"]["used"], (name, hit["reload"])
        assert hit["reload"]["tier"]["removed"], (name, hit["reload"])
        assert not hit["path"].exists(), name
        print(f"[tier] {name}: {hit['reload']['tier']['reason']}")
        again = _cycle(llama, base)
        assert again["tier"]["last"]["write"]["written"], (name, again)
        assert again["reload"]["source"] == "disk", (name, again["reload"])
    # whether a sleep found its file already on disk (the same bytes as an earlier sleep's)
    print(f"[tier] files now: {sorted(p.name for p in tier_dir.glob('*.hswt'))}")
