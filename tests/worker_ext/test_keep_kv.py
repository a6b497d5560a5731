"""The KV cache kept across a level-1 sleep on a real in-process vLLM-CPU engine
(docs/contracts.md §1.3): the prefix cache still hits after the wake, the kept KV bytes are
verified, and the cases that cannot keep answer "discard" with the reason.

On CPU the host backend keeps the KV cache in place (host memory already); the controller's
side (no clearing drain, the kv decision) is in tests/controller/test_keep_prefix_cache.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from inproc import VLLM_WARNINGS, generate, in_process_llm, ok, rpc

from controller import protocol

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

PROMPT = [3 + (i * 37) % 90 for i in range(200)]  # several KV blocks (max_model_len 256)


@pytest.fixture(scope="module")
def llm(tiny_model: Any) -> Iterator[Any]:
    path = tiny_model("llama", 0, False)
    with in_process_llm(
        path, kv_cache_memory_bytes=64 << 20, enable_prefix_caching=True, disable_log_stats=False
    ) as engine:
        yield engine


def cached_tokens(llm: Any, prompt: list[int]) -> int:
    """How many of the prompt's tokens vLLM took from its prefix cache (one new token)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], sp, use_tqdm=False)[0]
    return int(out.num_cached_tokens or 0)


def hits(llm: Any) -> float:
    """vLLM's own counter of prefix-cache hit tokens (what /metrics serves)."""
    return sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits")


def sleep_and_wake(llm: Any, keep: bool) -> dict[str, Any]:
    """The controller's level-1 RPCs; without keep, first the clearing its drain does."""
    if not keep:
        llm.reset_prefix_cache()
    params = protocol.Params(level=1, quiesce_timeout_s=10.0, keep_kv=keep)
    rep: dict[str, Any] = {}
    for step in (*protocol.sleep_steps(1), *protocol.wake_steps(1)):
        rep[step.phase] = ok(llm, step.method, *step.call_args(params))[0]
    return rep


def test_a_kept_kv_cache_hits_after_the_wake(llm: Any) -> None:
    base = generate(llm, PROMPT)
    assert cached_tokens(llm, PROMPT) > 0, "prefix caching works on this engine"
    rep = sleep_and_wake(llm, keep=True)
    assert (rep["prepare"]["kv"], rep["prepare"]["kv_reason"]) == ("keep", None)
    assert rep["suspend"]["kv"] == "keep"
    assert rep["suspend"]["offloaded_bytes"]["kv_cache"] > 0
    assert rep["suspend"]["freed_bytes"]["kv_cache"] == 0  # CPU: kept in place
    assert rep["suspend"]["resident_bytes"] == 0  # no device
    verify = rep["restore_and_verify"]
    assert verify["mismatched"] == []
    assert verify["kv_verified"] >= 1
    assert verify["kv_verified_bytes"] >= 64 << 20
    before = hits(llm)
    assert cached_tokens(llm, PROMPT) >= 128, "the prompt's blocks survived the sleep"
    assert hits(llm) - before >= 128
    assert generate(llm, PROMPT) == base


def test_the_default_sleep_misses(llm: Any) -> None:
    generate(llm, PROMPT)
    assert cached_tokens(llm, PROMPT) > 0
    rep = sleep_and_wake(llm, keep=False)
    assert rep["prepare"]["kv"] == "discard"
    assert rep["suspend"]["freed_bytes"]["kv_cache"] > 0
    assert rep["restore_and_verify"]["kv_verified"] == 0
    assert cached_tokens(llm, PROMPT) == 0


def test_cases_that_cannot_keep_say_why(llm: Any) -> None:
    (two,) = ok(llm, "hotswap_prepare", 2, "keep")
    assert two["kv"] == "discard"
    assert "level 1 only" in two["kv_reason"]

    def caching(w: Any, on: bool) -> None:
        w.worker.cache_config.enable_prefix_caching = on

    llm.collective_rpc(caching, args=(False,))
    try:
        (off,) = ok(llm, "hotswap_prepare", 1, "keep")
    finally:
        llm.collective_rpc(caching, args=(True,))
    assert off["kv"] == "discard"
    assert "prefix caching is off" in off["kv_reason"]
    # a suspend asked to keep after a prepare that could not: refused, nothing touched
    before = ok(llm, "hotswap_info")[0]
    (bad,) = rpc(llm, "hotswap_suspend", 1, None, "keep")
    assert bad["ok"] is False
    assert "kv 'keep' needs" in bad["error"]
    (bad,) = rpc(llm, "hotswap_prepare", 1, "maybe")
    assert bad["ok"] is False
    after = ok(llm, "hotswap_info")[0]
    assert (after["phase"], after["transitions"]) == (before["phase"], before["transitions"])
    assert after["suspended"] == {}
    assert after["resident"] == {"bytes": 0, "source": "none"}


def test_a_kept_kv_byte_that_changed_fails_the_wake(llm: Any) -> None:
    """Last in the module: the failed verify leaves the rank failed for good."""
    rows = ok(llm, "hotswap_audit", 1)[0]["tensors"]
    kv = next(r["name"] for r in rows if r["kv"] and r["bytes"])
    ok(llm, "hotswap_prepare", 1, "keep")
    ok(llm, "hotswap_suspend", 1, None, "keep")
    ok(llm, "hotswap_test_flip", kv, 6)  # while asleep: kept in place on CPU
    ok(llm, "hotswap_resume")
    (v,) = rpc(llm, "hotswap_restore_and_verify")
    assert v["ok"] is False
    assert v["mismatched"] == [f"{kv} (KV cache kept)"]
