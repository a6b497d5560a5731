"""Two tensor-parallel ranks (mp executor: the EngineCore and each worker a spawned process):
the gloo barrier, late ranks, poisoning; the extension's answers across vLLM's process
boundary (a failure inside a worker comes back as an answer, the replies stay in step)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from inproc import VLLM_WARNINGS, cycle, generate, in_process_llm, ok, rpc

pytestmark = [pytest.mark.vllm, pytest.mark.slow, *VLLM_WARNINGS]


@pytest.fixture(scope="module")
def llm(tiny_model: Any) -> Iterator[Any]:
    path = tiny_model("llama", 0, False)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    with in_process_llm(
        path,
        env=env,
        plant=1.5,
        kv_cache_memory_bytes=32 << 20,
        tensor_parallel_size=2,
        distributed_executor_backend="mp",
    ) as engine:
        yield engine


def test_barrier_and_cycles_on_two_ranks(llm: Any, baseline: Any) -> None:
    res = ok(llm, "hotswap_quiesce", 10.0)
    assert [r["rank"] for r in res] == [0, 1]
    assert all(r["late_ranks"] == [] for r in res)
    (i0, i1) = ok(llm, "hotswap_info")
    assert i0["world_size"] == i1["world_size"] == 2
    for level in (1, 2):
        rep = cycle(llm, level, poison=True)
        assert rep["verify"]["mismatched"] == []
        assert generate(llm) == baseline


def test_mp_level2_poisoned_cycle_and_failures(llm: Any, baseline: Any) -> None:
    infos = ok(llm, "hotswap_info")
    assert all(i["backend"] == "host" for i in infos), infos
    rep = cycle(llm, 2, poison=True)
    assert "model.embed_tokens.hotswap_test_scale" in rep["prepare"]["at_risk"]
    assert rep["verify"]["mismatched"] == []
    assert generate(llm) == baseline
    # an internal failure in a worker process comes back as an answer, queues in step
    ok(llm, "hotswap_test_fail_next", "audit")
    bad = rpc(llm, "hotswap_audit", 2)
    assert [r["ok"] for r in bad] == [False, False], bad
    assert all("injected failure" in r["error"] for r in bad), bad
    again = ok(llm, "hotswap_info")  # the next replies are this call's, not stale ones
    assert all("pools" in r for r in again), again
    assert generate(llm) == baseline


def test_a_prepare_refused_on_one_rank_releases_nothing_on_any(llm: Any, baseline: Any) -> None:
    """The fused sleep: rank 1's prepare fails, so rank 0 (whose prepare succeeded)
    releases nothing either (before the ranks' agreement it slept alone); both name rank
    1, every pool stays mapped, and a fused cycle the ranks agree on then goes ahead."""
    ok(llm, "hotswap_quiesce", 10.0)
    ok(llm, "hotswap_test_fail_next_on", 1, "prepare")
    llm.reset_prefix_cache()
    res = rpc(llm, "hotswap_sleep", 1)
    assert [r["ok"] for r in res] == [False, False], res
    assert all(r["failed_step"] == "prepare" for r in res), res
    assert all(r["failed_ranks"] == [1] for r in res), res
    infos = ok(llm, "hotswap_info")
    assert all(i["suspended"] == {} for i in infos), infos
    assert all(i["phase"] == "awake_verified" for i in infos), infos
    assert generate(llm) == baseline
    ok(llm, "hotswap_quiesce", 10.0)
    llm.reset_prefix_cache()
    ok(llm, "hotswap_sleep", 1)
    woke = ok(llm, "hotswap_wake")
    assert all(r["mismatched"] == [] for r in woke), woke
    assert generate(llm) == baseline


def test_late_rank_is_named_then_group_is_poisoned(llm: Any, baseline: Any) -> None:
    ok(llm, "hotswap_test_delay_next_quiesce", 1, 3.0)
    res = rpc(llm, "hotswap_quiesce", 1.0)
    assert [r["ok"] for r in res] == [False, False]
    late = sorted({x for r in res for x in r["late_ranks"]})
    assert late == [1]
    assert "1" in res[0]["error"]
    again = rpc(llm, "hotswap_quiesce", 5.0)
    assert all(not r["ok"] and "poisoned" in r["error"] for r in again)
    assert generate(llm) == baseline  # the engine keeps serving
