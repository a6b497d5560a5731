"""Sleep/wake through the extension's RPC on a real GPU: tokens, bytes, selective, graphs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.gpu.conftest import Engine, audit_table

pytestmark = pytest.mark.gpu

GRAPHS = {"compilation_config": {"mode": 0, "cudagraph_mode": "FULL"}, "enforce_eager": False}


@pytest.fixture(scope="module")
def llama(model_dir: Callable[[str], Path], engines: Callable[..., Engine]) -> Engine:
    return engines(model_dir("llama"))


def _check_bytes(eng: Engine, pools: dict[str, int], sus: dict[str, Any], tags: list[str]) -> None:
    freed = sus["freed_bytes"]
    assert set(freed) == set(tags)
    for t in tags:
        assert freed[t] == pools[t] > 0, (t, freed, pools)
    # cudaMemGetInfo must see (nearly) all of it come back to the device
    device_freed = sus["memory_after"] - sus["memory_before"]
    assert device_freed >= 0.95 * sum(freed.values()), (device_freed, freed)


@pytest.mark.parametrize("level", [1, 2])
def test_cycle_identical_tokens_and_logprobs(llama: Engine, level: int) -> None:
    base = llama.gen()
    assert llama.gen() == base, "not deterministic before any sleep"
    pools = llama.rpc("hotswap_info")["pools"]
    for _ in range(2):
        s = llama.sleep(level)
        _check_bytes(llama, pools, s["suspend"], ["weights", "kv_cache"])
        info = llama.rpc("hotswap_info")
        assert info["suspended"] == {
            "weights": "offloaded" if level == 1 else "discarded",
            "kv_cache": "discarded",
        }
        w = llama.wake(level)
        assert w["verify"]["mismatched"] == [], w["verify"]
        assert w["weights"]["restored_bytes"] == {"weights": pools["weights"]}
        assert llama.rpc("hotswap_info")["suspended"] == {}
        assert llama.gen() == base


def test_kv_only_suspend_keeps_weights(llama: Engine) -> None:
    base = llama.gen()
    pools = llama.rpc("hotswap_info")["pools"]
    before = llama.rpc("hotswap_test_checksum")["checksum"]
    s = llama.sleep(1, ["kv_cache"])
    _check_bytes(llama, pools, s["suspend"], ["kv_cache"])
    assert s["suspend"]["offloaded_bytes"] == {"kv_cache": 0}
    assert llama.rpc("hotswap_info")["suspended"] == {"kv_cache": "discarded"}
    assert llama.rpc("hotswap_test_checksum")["checksum"] == before  # weights never left
    w = llama.wake(1, ["kv_cache"])
    assert "weights" not in w
    assert w["verify"]["mismatched"] == []
    assert llama.gen() == base


def test_suspending_a_sleeping_pool_is_refused(llama: Engine) -> None:
    base = llama.gen()
    llama.sleep(1, ["kv_cache"])
    again = llama.rpc("hotswap_suspend", 1, ["kv_cache"], ok=False)
    assert not again["ok"]
    assert "already suspended" in again["error"]
    llama.wake(1)
    assert llama.gen() == base


def test_cuda_graphs_survive_level1_and_level2(
    model_dir: Callable[[str], Path], engines: Callable[..., Engine]
) -> None:
    eng = engines(model_dir("llama"), **GRAPHS)
    base = eng.gen()
    for level in (1, 2, 1):
        eng.sleep(level)
        w = eng.wake(level)
        assert w["verify"]["mismatched"] == []
        assert eng.gen() == base, f"level {level}"


def test_audit_table_tiny_llama(llama: Engine) -> None:
    for level in (1, 2):
        rep = llama.rpc("hotswap_audit", level, True)
        assert rep["count"] == len(rep["tensors"]) > 0
        assert any(r["pool"] == "weights" for r in rep["tensors"])
        print(audit_table("tiny Llama (GPU, cumem)", rep))


def test_demote_releases_the_host_copy_and_the_wake_reloads_verified(llama: Engine) -> None:
    """A level-1 sleeper demoted to level 2 (the host budget's second resort): its host copy
    is released, the wake is level 2's (reload, restore, verify) and serves the same tokens
    and logprobs; refused while awake and, untouched, without the level-2 protection."""
    base = llama.gen()
    before = llama.rpc("hotswap_info")
    awake = llama.rpc("hotswap_demote", ok=False)
    assert awake["ok"] is False
    assert "not asleep at level 1" in awake["error"]
    after = llama.rpc("hotswap_info")
    assert (after["phase"], after["transitions"]) == (before["phase"], before["transitions"])
    pools = before["pools"]
    s = llama.sleep(1)
    prep = s["prepare"]
    assert prep["demotable"] is True
    assert prep["pools"]["weights"]["discarded"] == 1  # level 2's ranges, planned at level 1
    held = s["suspend"]["host_backup_bytes"]
    assert held > 0
    d = llama.rpc("hotswap_demote")
    assert d["level"] == 2
    assert d["freed_host_bytes"]["weights"] > 0
    assert sum(d["freed_host_bytes"].values()) == held
    assert d["host_backup_bytes"] == 0
    assert d["protected_bytes"] == prep["pools"]["weights"]["protected_bytes"]
    info = llama.rpc("hotswap_info")
    assert info["host_backup_bytes"] == 0
    assert info["wake_scratch_bytes"] == 0
    assert info["suspended"] == {"weights": "discarded", "kv_cache": "discarded"}
    assert (info["phase"], info["phase_level"], info["level"]) == ("suspended", 2, 2)
    w = llama.wake(2)
    assert w["reload"]["source"] == "reload"
    assert w["weights"]["restored_bytes"] == {"weights": pools["weights"]}
    assert w["verify"]["mismatched"] == [], w["verify"]
    assert w["verify"]["verified"] == prep["fingerprinted"]
    assert llama.rpc("hotswap_info")["phase"] == "awake_verified"
    assert llama.gen() == base  # tokens and logprobs
    print(
        f"[demote] freed host {d['freed_host_bytes']}, protected {d['protected_bytes']} B, "
        f"demote {d['elapsed_s']:.4f} s, prepare {prep['elapsed_s']:.4f} s, "
        f"reload {w['reload']['reload_s']:.3f} s"
    )
    # by object (no level-2 protection at level 1): refused, nothing touched
    llama.rpc("hotswap_test_protect", "objects")
    try:
        s = llama.sleep(1)
        assert s["prepare"]["demotable"] is False
        before = llama.rpc("hotswap_info")
        refused = llama.rpc("hotswap_demote", ok=False)
        assert refused["ok"] is False
        assert "level-2 wake needs" in refused["error"]
        after = llama.rpc("hotswap_info")
        assert after["transitions"] == before["transitions"]
        assert after["host_backup_bytes"] == before["host_backup_bytes"] > 0
        assert after["suspended"]["weights"] == "offloaded"
        assert llama.wake(1)["verify"]["mismatched"] == []
    finally:
        llama.rpc("hotswap_test_protect", None)
    assert llama.gen() == base


def test_one_flipped_weight_element_after_resume_is_named(llama: Engine) -> None:
    base = llama.gen()
    llama.sleep(1)
    llama.rpc("hotswap_resume", ["weights"])
    llama.rpc("hotswap_resume", ["kv_cache"])
    flip = llama.rpc("hotswap_test_flip")
    print("flipped", flip)
    v = llama.rpc("hotswap_restore_and_verify", ok=False)
    assert not v["ok"]
    assert v["mismatched"] == [flip["name"]], v
    assert flip["name"] in v["error"]
    # the bit flipped on the device after the copies back: the host copy holds the baseline
    hc = v["host_copy_check"]
    assert hc is not None, v
    assert hc["error"] is None, hc
    assert (hc["pieces"], hc["host_good"], hc["host_bad"], hc["not_in_copy"]) == (1, 1, 0, 0), hc
    assert hc["equal_to_device"] == 0, hc
    assert "(host copy: " in v["error"], v["error"]
    llama.rpc("hotswap_test_flip", flip["name"])  # undo: the same bit back
    assert llama.gen() == base
    # the next cycle verifies clean again
    llama.sleep(1)
    assert llama.wake(1)["verify"]["mismatched"] == []
    assert llama.gen() == base


def test_a_wrong_host_copy_is_told_from_a_wrong_restore(llama: Engine) -> None:
    """A byte of the weights' host copy changed while asleep: the wake brings it back
    wrong, the verify fails, and its host copy check says the host copy does not hold the
    baseline (the sleep's fault) and is what the device holds now; both bytes put back,
    the engine serves as before and the next cycle verifies clean."""
    base = llama.gen()
    llama.sleep(1)
    llama.rpc("hotswap_test_spoil_host_copy")
    llama.rpc("hotswap_resume", ["weights"])
    llama.rpc("hotswap_resume", ["kv_cache"])
    v = llama.rpc("hotswap_restore_and_verify", ok=False)
    assert not v["ok"], v
    hc = v["host_copy_check"]
    assert hc is not None, v
    assert hc["error"] is None, hc
    assert (hc["pieces"], hc["host_good"], hc["host_bad"], hc["not_in_copy"]) == (1, 0, 1, 0), hc
    assert hc["equal_to_device"] == 1, hc
    assert "the sleep wrote the host copy wrong" in v["error"], v["error"]
    llama.rpc("hotswap_test_spoil_host_copy", True)
    assert llama.gen() == base
    llama.sleep(1)
    assert llama.wake(1)["verify"]["mismatched"] == []
    assert llama.gen() == base


@pytest.mark.parametrize("level", [1, 2])
def test_the_fused_wake_maps_back_and_verifies_in_one_rpc(llama: Engine, level: int) -> None:
    """The controller's default wake (`fused_wake`): at level 1 one hotswap_wake maps both
    pools back, restores and verifies; at level 2 the weights' resume and the reload run
    first. Tokens and logprobs equal; nothing left asleep."""
    base = llama.gen()
    llama.sleep(level)
    w = llama.wake(level, fused=True)
    assert list(w) == (["verify"] if level == 1 else ["weights", "reload", "verify"]), list(w)
    assert w["verify"]["mismatched"] == [], w["verify"]
    assert llama.rpc("hotswap_info")["suspended"] == {}
    assert llama.gen() == base


@pytest.mark.parametrize("level", [1, 2])
def test_the_fused_sleep_prepares_under_the_copies_and_the_wake_verifies(
    llama: Engine, level: int
) -> None:
    """The controller's default sleep (`fused_sleep`): one hotswap_sleep; at level 1 the
    prepare runs while the weights' copies are on the link (staged: its protected copies
    ahead of most of them). The wake verifies every byte it fingerprinted; tokens and
    logprobs equal. A second coded sleep of the same weights reuses the codec's plan."""
    base = llama.gen()
    s = llama.sleep(level, fused=True)["prepare_and_suspend"]
    assert "failed_step" not in s, s
    assert s["overlapped"] is (level == 1), s
    assert s["fingerprinted"] > 0
    assert s["protected_bytes"] > 0
    assert set(s["tags"]) == {"weights", "kv_cache"}
    assert {"prepare_s", "suspend_s", "prepare_under_copies_s"} <= set(s["timings"]), s
    w = llama.wake(level, fused=True)
    assert w["verify"]["mismatched"] == [], w["verify"]
    assert w["verify"]["verified"] == s["fingerprinted"]
    assert llama.gen() == base
    if level == 1:
        again = llama.sleep(1, fused=True)["prepare_and_suspend"]
        codec = llama.rpc("hotswap_info")["backend_detail"]["codec"]
        if codec["setting"] == "exp" and codec["warm"] and codec["warm"]["ok"]:
            assert codec["last_suspend"]["plan"] == "reused", codec["last_suspend"]
            assert again["timings"]["codec_plan_s"] < 0.05, again["timings"]
        assert llama.wake(1, fused=True)["verify"]["mismatched"] == []
        assert llama.gen() == base


def test_kv_records_released_first_are_lent_and_mapped_by_another_handle(llama: Engine) -> None:
    """worker_ext.cumem.kvlend on the driver: with a rank of this device listening (the
    test's inbox in the worker), the fused sleep exports its KV records released first and
    lends them; each lent allocation is imported and mapped at another address (the same
    size; a larger record with a new allocation after it), written and read back, and
    freed; the engine's own wake and tokens are as ever (it wakes whatever the checks say)."""
    base = llama.gen()
    llama.sleep(1, fused=True)  # a prepare names the KV records that hold only the KV cache
    assert llama.wake(1, fused=True)["verify"]["mismatched"] == []
    assert llama.rpc("hotswap_test_lend_inbox")["listening"]
    s = llama.sleep(1, fused=True)["prepare_and_suspend"]
    try:
        t = s["timings"]
        m = llama.rpc("hotswap_test_map_lent")  # the inbox closed whatever came
        if not t.get("kv_early_records"):
            pytest.skip(f"no KV record held only the KV cache here: none released first ({t})")
        assert t.get("kv_lent_records", 0) >= 1, t
        assert "kv_lend_export_failed" not in t, t
        assert m["received"] == t["kv_lent_records"], m
        assert m["mapped"], m
        assert all(r["mapped"] and r["readback"] for r in m["mapped"]), m
        # lent on as it came: the same physical memory, at its own size
        assert all(r.get("same_memory") and r["lent_on"] == r["lent"] for r in m["mapped"]), m
    finally:
        w = llama.wake(1, fused=True)
        assert w["verify"]["mismatched"] == [], w["verify"]
    assert llama.gen() == base


@pytest.mark.parametrize("mode", ["kv_thread", "free_later"])
def test_the_release_modes_free_every_byte_and_the_wake_verifies(llama: Engine, mode: str) -> None:
    """The tuning's kv_thread (the KV cache's releases on threads of their own) and
    free_later (each record's memory freed as its exported descriptor closes on a thread)
    on the driver: every byte is back on the device when the fused sleep answers
    (cudaMemGetInfo), the wake verifies, tokens and logprobs equal; off again, as before."""
    base = llama.gen()
    pools = llama.rpc("hotswap_info")["pools"]
    llama.sleep(1, fused=True)  # a prepare names the KV records that hold only the KV cache
    assert llama.wake(1, fused=True)["verify"]["mismatched"] == []
    assert llama.rpc("hotswap_test_release_mode", mode, True)[mode] is True
    try:
        for _ in range(2):
            s = llama.sleep(1, fused=True)["prepare_and_suspend"]
            assert "failed_step" not in s, s
            t = s["timings"]
            assert t[mode] == 1.0, t
            if mode == "free_later":
                assert t.get("free_later_records", 0) > 0, t
                assert "free_later_not_exported" not in t, t
            else:
                assert "discard_join_wait_s" in t, t
            _check_bytes(llama, pools, s, ["weights", "kv_cache"])
            w = llama.wake(1, fused=True)
            assert w["verify"]["mismatched"] == [], w["verify"]
            assert llama.gen() == base
    finally:
        llama.rpc("hotswap_test_release_mode", mode, False)
    s = llama.sleep(1, fused=True)["prepare_and_suspend"]
    assert mode not in s["timings"], s["timings"]
    assert llama.wake(1, fused=True)["verify"]["mismatched"] == []
    assert llama.gen() == base


def test_a_flipped_bit_fails_the_fused_wake(llama: Engine) -> None:
    """A weight flipped after the weights are back and before the fused call verifies: the
    call maps the KV cache back, then names the tensor and fails; undone, the next fused
    wake is clean."""
    base = llama.gen()
    llama.sleep(1)
    llama.rpc("hotswap_resume", ["weights"])
    flip = llama.rpc("hotswap_test_flip")
    v = llama.rpc("hotswap_wake", ok=False)
    assert not v["ok"]
    assert v["failed_step"] == "restore_and_verify", v
    assert v["mismatched"] == [flip["name"]], v
    llama.rpc("hotswap_test_flip", flip["name"])  # the same bit back
    assert llama.gen() == base
    llama.sleep(1)
    assert llama.wake(1, fused=True)["verify"]["mismatched"] == []
    assert llama.gen() == base


def test_drop_backup_frees_the_kept_pinned_copy(llama: Engine) -> None:
    """Awake, the pinned copy kept for the next sleep is released (the host budget's first
    resort); serving is untouched; the next sleep pins anew; asleep, the drop is refused."""
    base = llama.gen()
    s = llama.sleep(1)
    codec = llama.rpc("hotswap_info")["backend_detail"]["codec"]
    coded = bool((codec.get("warm") or {}).get("ok")) and codec["setting"] == "exp"
    assert (s["suspend"]["wake_scratch_bytes"] > 0) is coded, (s["suspend"], codec)
    assert s["suspend"]["host_backup_bytes"] > 0  # the pinned copy it sleeps in
    w = llama.wake(1)
    kept = llama.rpc("hotswap_info")["host_backup_bytes"]
    assert kept > 0
    assert w["kv_cache"]["host_backup_bytes"] == kept
    d = llama.rpc("hotswap_drop_backup")
    assert sum(d["freed_host_bytes"].values()) == kept
    assert d["host_backup_bytes"] == 0
    assert llama.rpc("hotswap_info")["host_backup_bytes"] == 0
    assert llama.gen() == base
    llama.sleep(1)
    refused = llama.rpc("hotswap_drop_backup", ok=False)
    assert refused["ok"] is False
    assert "not awake" in refused["error"]
    w = llama.wake(1)
    assert w["verify"]["mismatched"] == []
    assert llama.rpc("hotswap_info")["host_backup_bytes"] > 0  # pinned anew
    assert llama.gen() == base


def test_graphs_replay_right_from_a_poisoned_graph_pool(
    model_dir: Callable[[str], Path],
    engines: Callable[..., Engine],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The CUDA graphs' CuMem pool (worker_ext.graphpool) sleeps with the KV cache and comes
    back empty; with HOTSWAP_GRAPH_POOL=poison every wake fills it with 0xFF (NaN in bf16)
    before anything runs, so a replay that read a byte from before the sleep would change
    the tokens or logprobs: they must equal the reference after every cycle."""
    monkeypatch.setenv("HOTSWAP_GRAPH_POOL", "poison")  # the engine's processes inherit it
    eng = engines(model_dir("llama"), **GRAPHS)
    info = eng.rpc("hotswap_info")
    assert info["graph_pool"]["pool"] == "cumem", info["graph_pool"]
    graphs = info["pools"]["cudagraph"]
    assert graphs > 0
    base = eng.gen()
    for level in (1, 2, 1):
        awake = eng.rpc("hotswap_info")["resident"]["graph_pools"]
        s = eng.sleep(level)
        assert s["suspend"]["freed_bytes"]["cudagraph"] == graphs
        assert eng.rpc("hotswap_info")["resident"]["graph_pools"] == awake - graphs
        w = eng.wake(level)
        assert w["kv_cache"]["restored_bytes"]["cudagraph"] == graphs
        assert w["kv_cache"]["timings"]["cudagraph_poisoned"] == 1.0
        assert w["verify"]["mismatched"] == []
        assert eng.gen() == base, f"level {level}"
