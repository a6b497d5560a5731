"""The level-2 disk tier on a real GPU: a level-2 wake takes the weights from the tier file
(no reload_weights), and a damaged file ends in a reload that says why, tokens equal and
verified every time; a truncated or older-format file is written again at the next sleep."""

from __future__ import annotations

import os
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.gpu.conftest import Engine

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


def _cycle(eng: Engine, base: object) -> dict:
    eng.sleep(2)
    tier = _written(eng)
    w = eng.wake(2)
    assert w["verify"]["mismatched"] == [], w["verify"]
    assert eng.gen() == base
    return {"tier": tier, "reload": w["reload"]}


def test_level2_wake_from_disk_then_faults_end_in_reload(llama: Engine, tier_dir: Path) -> None:
    base = llama.gen()
    first = _cycle(llama, base)
    files = sorted(tier_dir.glob("*.hswt"))
    assert len(files) == 1, (files, first)
    assert first["tier"]["last"]["write"]["written"], first
    assert first["reload"]["source"] == "disk", first["reload"]
    assert first["tier"]["usage_bytes"] == files[0].stat().st_size
    print(f"[tier] from disk: {first['reload']['tier']}")

    # a flipped byte in the payload: the header is whole, so the sleep keeps the file; the
    # wake decodes, sees the digest differ, reloads and removes the file
    data = bytearray(files[0].read_bytes())
    data[-100] ^= 0x5A
    files[0].write_bytes(bytes(data))
    flipped = _cycle(llama, base)
    assert flipped["reload"]["source"] == "reload", flipped["reload"]
    assert not flipped["reload"]["tier"]["used"]
    assert flipped["reload"]["tier"]["removed"]
    print(f"[tier] flipped byte: {flipped['reload']['tier']['reason']}")
    assert _cycle(llama, base)["reload"]["source"] == "disk"  # written again, used again

    # truncated, then another format version: the sleep writes the file again
    for damage in ("truncate", "version"):
        if damage == "truncate":
            os.truncate(files[0], files[0].stat().st_size // 2)
        else:
            with open(files[0], "r+b") as f:
                f.seek(8)
                f.write(struct.pack("<I", 999))
        again = _cycle(llama, base)
        assert again["tier"]["last"]["write"]["written"], (damage, again)
        assert again["reload"]["source"] == "disk", (damage, again["reload"])
