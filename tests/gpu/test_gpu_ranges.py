"""Protection by memory range on a real GPU (issue 18): tensors no walk reaches survive.

The engines here run with HOTSWAP_TEST_UNREACHABLE=1: gpu_ext plants, inside each cuMem
pool, a tensor in a module global, one in a closure and one in a dict keyed outside the
model, all read by the embedding's forward (a lost value changes the greedy tokens). One
engine runs eagerly, one with full CUDA graphs captured after the planting.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.conftest import Engine

pytestmark = pytest.mark.gpu

GRAPHS = {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL"}, "enforce_eager": False}
MODES: dict[str, dict[str, Any]] = {"eager": {}, "graphs": GRAPHS}
Planted = tuple[Engine, str]


@pytest.fixture(scope="module", params=list(MODES))
def planted(
    request: pytest.FixtureRequest,
    model_dir: Callable[[str], Path],
    engines: Callable[..., Engine],
) -> Planted:
    old = os.environ.get("HOTSWAP_TEST_UNREACHABLE")
    os.environ["HOTSWAP_TEST_UNREACHABLE"] = "1"  # the engine's process inherits it
    try:
        eng = engines(model_dir("llama"), **MODES[request.param])
    finally:
        if old is None:
            os.environ.pop("HOTSWAP_TEST_UNREACHABLE", None)
        else:
            os.environ["HOTSWAP_TEST_UNREACHABLE"] = old
    return eng, str(request.param)


def _state(eng: Engine) -> dict[str, Any]:
    return eng.rpc("hotswap_test_planted")["planted"]  # type: ignore[no-any-return]


def _fill(eng: Engine, value: float) -> None:
    eng.rpc("hotswap_test_planted", value)
    eng.llm.reset_prefix_cache()


def test_planted_tensors_are_in_their_pools_unreached_and_read(planted: Planted) -> None:
    eng, mode = planted
    state = _state(eng)
    assert set(state) == {"weights", "kv_cache"}
    for tag, rows in state.items():
        assert [r["pool"] for r in rows] == [tag] * 3, rows
        assert [r["reached"] for r in rows] == [False] * 3, rows
        assert all(r["sum"] == 256.0 for r in rows), rows
    base = eng.gen()
    _fill(eng, 0.0)  # what a lost tensor reads as
    assert eng.gen()[0] != base[0], "the forward pass does not read the planted tensors"
    _fill(eng, 1.0)
    assert eng.gen() == base
    audit = eng.rpc("hotswap_audit", 2, True)
    assert audit["protection"] == "ranges"
    assert audit["unprotected_bytes"] == 0
    assert audit["unnamed_bytes"] > 0
    print(f"[ranges] {mode} audit level 2: pools {audit['pools']}, unnamed {audit['unnamed'][:4]}")


def test_unreachable_tensors_survive_every_level(planted: Planted) -> None:
    eng, mode = planted
    base = eng.gen()
    before = _state(eng)
    for level in (1, 2, 1, 2):
        s = eng.sleep(level)
        prep = s["prepare"]
        assert prep["protection"] == "ranges"
        assert prep["protected_bytes"] > 0
        w = eng.wake(level)
        v = w["verify"]
        assert v["mismatched"] == [], v
        assert v["mismatched_ranges"] == []
        assert v["verified"] == prep["fingerprinted"]
        assert _state(eng) == before, f"level {level}"
        assert eng.gen() == base, f"level {level}"  # tokens and logprobs
        print(
            f"[ranges] {mode} level {level}: protected {prep['protected_bytes']} B in "
            f"{prep['protected_ranges']} ranges, unnamed {prep['unnamed_bytes']} B in "
            f"{prep['unnamed_ranges']}, prepare {prep['elapsed_s']:.4f} s, restore+verify "
            f"{v['elapsed_s']:.4f} s, pools {prep['pools']}"
        )


@pytest.mark.parametrize(("level", "pool"), [(1, "kv_cache"), (2, "weights")])
def test_by_object_the_same_tensors_are_lost_unseen(
    planted: Planted, level: int, pool: str
) -> None:
    """What range protection fixes: by object the wake verifies clean and serves wrong."""
    eng, mode = planted
    if mode != "eager":
        pytest.skip("the eager engine shows it")
    base = eng.gen()
    eng.rpc("hotswap_test_protect", "objects")
    try:
        assert eng.rpc("hotswap_audit", level, False)["unprotected_bytes"] > 0
        eng.sleep(level)
        v = eng.wake(level)["verify"]
        assert v["ok"], v  # the old answer: nothing differs among the named tensors
        lost = [r["sum"] for r in _state(eng)[pool]]
        print(f"[ranges] by object, level {level}: {pool} tensors read back as {lost}")
        assert lost != [256.0] * 3, "the pool's unnamed bytes came back without protection"
        assert eng.gen() != base
    finally:
        eng.rpc("hotswap_test_protect", None)
        _fill(eng, 1.0)
    assert eng.gen() == base


@pytest.mark.parametrize(("level", "pool", "which"), [(1, "kv_cache", 0), (2, "weights", 1)])
def test_a_range_corrupted_before_verification_fails_the_wake(
    planted: Planted, level: int, pool: str, which: int
) -> None:
    eng, mode = planted
    base = eng.gen()
    eng.sleep(level)
    ptr = eng.rpc("hotswap_test_corrupt_at_verify", pool, which)["ptr"]
    eng.rpc("hotswap_resume", ["weights"])
    if level == 2:
        eng.rpc("hotswap_reload")
    eng.rpc("hotswap_resume", ["kv_cache"])
    v = eng.rpc("hotswap_restore_and_verify", ok=False)
    assert v["ok"] is False, v
    bad = v["mismatched_ranges"]
    assert len(bad) == 1, v
    (r,) = bad
    assert r["pool"] == pool
    assert r["start"] <= ptr < r["end"], (hex(ptr), r)
    assert r["nearest"], r
    assert r["range"] in v["error"]
    assert eng.rpc("hotswap_info")["phase"] == "failed"
    print(f"[ranges] {mode} corrupted {pool} at {ptr:#x}: reported {r}")
    _fill(eng, 1.0)  # undo the corruption: the engine serves as before
    assert eng.gen() == base
