"""The extension in vLLM's default multiprocess layout (EngineCore + a spawned worker)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from inproc import ENGINE_ARGS, VLLM_WARNINGS, cycle, engine_env, generate, ok, rpc, shutdown

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]


@pytest.fixture(scope="module")
def llm(tiny_model: Any) -> Iterator[Any]:
    path = tiny_model("llama", 0, False)
    with engine_env(VLLM_ENABLE_V1_MULTIPROCESSING="1"):
        from vllm import LLM

        engine = LLM(model=str(path), kv_cache_memory_bytes=32 << 20, **ENGINE_ARGS)
    ok(engine, "hotswap_test_plant", 1.5)
    try:
        yield engine
    finally:
        shutdown(engine)


def test_mp_level2_poisoned_cycle_and_failures(llm: Any) -> None:
    (info,) = ok(llm, "hotswap_info")
    assert info["backend"] == "host"
    baseline = generate(llm)
    rep = cycle(llm, 2, poison=True)
    assert "model.embed_tokens.hotswap_test_scale" in rep["prepare"]["at_risk"]
    assert rep["verify"]["mismatched"] == []
    assert generate(llm) == baseline
    # an internal failure in the worker process comes back as an answer, queues in step
    ok(llm, "hotswap_test_fail_next", "audit")
    (bad,) = rpc(llm, "hotswap_audit", 2)
    assert bad["ok"] is False
    assert "injected failure" in bad["error"]
    (again,) = ok(llm, "hotswap_info")  # the next reply is this call's, not a stale one
    assert "pools" in again
    assert generate(llm) == baseline
