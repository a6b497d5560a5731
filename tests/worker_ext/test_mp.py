"""The extension in vLLM's default multiprocess layout (EngineCore + a spawned worker)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from inproc import VLLM_WARNINGS, cycle, generate, in_process_llm, ok, rpc

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]


@pytest.fixture(scope="module")
def llm(tiny_model: Any) -> Iterator[Any]:
    path = tiny_model("llama", 0, False)
    multi = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
    with in_process_llm(path, env=multi, plant=1.5, kv_cache_memory_bytes=32 << 20) as engine:
        yield engine


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
