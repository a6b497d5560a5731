"""vLLM's own sleep and wake on a real GPU with only the `hotswap` sleep-mode backend
(`worker_cls="worker_ext.HotSwapWorker"`, no sidecar; docs/contracts.md §1.5).

`LLM.sleep(level)` and `LLM.wake_up(tags)` reach the backend through vLLM's engine core,
executor and worker. Levels 1 and 2 with CUDA graphs give the same tokens and logprobs, the
tensors planted where no walk reaches survive; the sidecar's wake of vLLM's sleep leaves
vLLM's own state awake after vLLM's wake_up; a weight flipped before the verify ends the
engine (no completion after it); Gemma3n's level 2 in vLLM's own order keeps its scales.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.conftest import Engine
from worker_ext.sleepbackend import EXIT_STATUS

pytestmark = pytest.mark.gpu

BACKEND = {"worker_cls": "worker_ext.HotSwapWorker"}
GRAPHS = {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL"}, "enforce_eager": False}
GEMMA_PROMPT = [2, 5, 9, 12, 7, 3]
RELOAD = "hotswap_test_reload_host"


def sums(eng: Engine) -> dict[str, list[float]]:
    planted = eng.rpc("hotswap_test_planted")["planted"]
    return {pool: [t["sum"] for t in ts] for pool, ts in planted.items()}


@pytest.fixture(scope="module")
def llama(model_dir: Callable[[str], Path], engines: Callable[..., Engine]) -> Engine:
    """With HOTSWAP_TEST_UNREACHABLE=1 (gpu_ext plants its unreachable tensors in both
    pools, before the graphs are captured; tests/gpu/test_gpu_ranges.py)."""
    old = os.environ.get("HOTSWAP_TEST_UNREACHABLE")
    os.environ["HOTSWAP_TEST_UNREACHABLE"] = "1"  # the engine's process inherits it
    try:
        return engines(model_dir("llama"), **GRAPHS, **BACKEND)
    finally:
        if old is None:
            os.environ.pop("HOTSWAP_TEST_UNREACHABLE", None)
        else:
            os.environ["HOTSWAP_TEST_UNREACHABLE"] = old


@pytest.mark.parametrize("level", [1, 2])
def test_vllms_own_sleep_and_wake_with_graphs(llama: Engine, level: int) -> None:
    llama.rpc("hotswap_test_planted", 1.25)  # read by every forward: a lost one shows
    llama.llm.reset_prefix_cache()  # no KV cache computed before the fill is reused
    planted = sums(llama)
    assert set(planted) == {"weights", "kv_cache"}, planted
    assert all(s == [320.0] * 3 for s in planted.values()), planted
    base = llama.gen()
    for cycle in range(2):
        llama.llm.sleep(level)
        asleep = llama.rpc("hotswap_info")
        assert asleep["phase"] == "suspended", asleep["phase_reason"]
        assert asleep["phase_level"] == level
        if level == 2:  # vLLM's documented order: the verify runs in the last wake
            llama.llm.wake_up(["weights"])
            llama.llm.collective_rpc("reload_weights")
            llama.llm.wake_up(["kv_cache"])
        else:
            llama.llm.wake_up()
        awake = llama.rpc("hotswap_info")
        assert awake["phase"] == "awake_verified", awake["phase_reason"]
        assert awake["verified_transition"] == awake["transitions"]
        assert sums(llama) == planted, f"level {level} cycle {cycle}"
        assert llama.gen() == base, f"level {level} cycle {cycle}"


@pytest.mark.parametrize("level", [1, 2])
def test_the_sidecars_wake_of_vllms_sleep_then_vllms_wake_up(llama: Engine, level: int) -> None:
    """vLLM sleeps through the backend, the sidecar's RPCs wake and verify; the ranks say
    vLLM's own sleep is still in force until vLLM's wake_up (what the sidecar's
    resume_engine sends as /wake_up), which maps nothing and runs vLLM's own steps after
    it (level 2: its saved buffers copied back); then vLLM's own cycle runs the backend
    again (docs/contracts.md §1.5)."""
    planted = sums(llama)
    base = llama.gen()
    llama.llm.sleep(level)
    assert llama.rpc("hotswap_info")["vllm_sleep"] is True
    if level == 2:  # the sidecar's level-2 wake: the weights, their reload, then the rest
        llama.rpc("hotswap_resume", ["weights"])
        llama.rpc("hotswap_reload")
    woke = llama.rpc("hotswap_wake")
    assert woke["mismatched"] == [], woke["mismatched"]
    assert woke["vllm_sleep"] is True
    t = llama.rpc("hotswap_info")["transitions"]
    llama.llm.wake_up()
    after = llama.rpc("hotswap_info")
    assert after["vllm_sleep"] is False
    assert after["transitions"] == t  # nothing mapped or written by the backend
    assert sums(llama) == planted
    assert llama.gen() == base
    llama.llm.sleep(1)
    assert llama.rpc("hotswap_info")["phase"] == "suspended"
    llama.llm.wake_up()
    assert llama.rpc("hotswap_info")["phase"] == "awake_verified"
    assert llama.gen() == base


def test_gemma3n_level2_through_vllms_calls_three_cycles(
    model_dir: Callable[[str], Path], engines: Callable[..., Engine]
) -> None:
    """LLM.sleep(level=2), wake_up(tags=["weights"]), the reload (from a host copy: the tiny
    config has no checkpoint), wake_up(tags=["kv_cache"]): 3 of 3 cycles keep the scales
    vLLM's own level 2 zeroes (tests/gpu/test_gpu_gemma3n.py) and the tokens."""
    eng = engines(model_dir("gemma3n"), load_format="dummy", max_num_seqs=1, **BACKEND)
    eng.rpc("hotswap_test_keep_host_copy")
    base = eng.gen(prompt=GEMMA_PROMPT)
    scales = eng.rpc("hotswap_test_scales")["scales"]
    assert any(k.endswith("embed_scale") for k in scales), scales
    for cycle in range(3):
        eng.llm.sleep(level=2)
        eng.llm.wake_up(tags=["weights"])
        eng.rpc(RELOAD)
        eng.llm.wake_up(tags=["kv_cache"])
        assert eng.rpc("hotswap_info")["phase"] == "awake_verified", f"cycle {cycle}"
        assert eng.rpc("hotswap_test_scales")["scales"] == scales, f"cycle {cycle}"
        assert eng.gen(prompt=GEMMA_PROMPT) == base, f"cycle {cycle}"


def test_a_flipped_weight_fails_closed(
    model_dir: Callable[[str], Path], engines: Callable[..., Engine]
) -> None:
    """The engine core (its own process here) ends at the verify with status 70; no
    completion is answered after it. vLLM's in-process client leaves the in-flight
    `wake_up` waiting for good (its SyncMPClient resolves no utility call of a dead engine),
    so the wake runs in a thread here. Last: the engine is gone."""
    eng = engines(model_dir("llama"), **BACKEND)
    eng.gen()
    eng.llm.sleep(1)
    eng.rpc("hotswap_test_flip_at_verify")
    client = eng.llm.llm_engine.engine_core
    waker = threading.Thread(target=raised, args=(eng.llm.wake_up,), daemon=True)
    waker.start()
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline and not client.resources.engine_dead:
        time.sleep(0.2)
    assert client.resources.engine_dead, "the engine core still runs after a failed verify"
    codes = [p.exitcode for p in client.resources.engine_manager.processes]
    print("engine core exit codes:", codes)
    assert codes == [EXIT_STATUS], codes
    assert raised(eng.gen) is not None, "a completion was answered after a failed verify"


def raised(fn: Callable[[], Any]) -> BaseException | None:
    """What `fn` raised (vLLM's EngineDeadError, or what wraps it), printed; None if not."""
    try:
        fn()
    except Exception as exc:
        print(f"{getattr(fn, '__name__', fn)} raised {type(exc).__name__}: {str(exc)[:300]}")
        return exc
    return None
