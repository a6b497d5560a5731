"""worker_ext/devext.py: the bench-only RPCs that redraw an engine's weights and switch
its host codec (benchmarks.sidecar loads them into its engines), over a fake backend on CPU
tensors."""

from __future__ import annotations

import sys
from typing import Any

import torch

from worker_ext import cudart
from worker_ext.devext import RealWeightsExtension
from worker_ext.extension import _HotswapState
from worker_ext.settings import Tuning, WorkerSettings


class _Backend:
    def __init__(self) -> None:
        self.settings = WorkerSettings()
        self.asleep: dict[str, str] = {}
        self.warmed: list[str] = []

    def suspended(self) -> dict[str, str]:
        return dict(self.asleep)

    def warm_host(self, wait: bool = False) -> dict[str, Any]:
        self.warmed.append(self.settings.host_codec)
        return {"codec": self.settings.host_codec}


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(64, 32, bias=False, dtype=torch.bfloat16)
        self.input_layernorm = torch.nn.Parameter(torch.zeros(64, dtype=torch.bfloat16))


class _Runner:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def get_model(self) -> torch.nn.Module:
        return self.model


class Worker(RealWeightsExtension):
    rank = 0

    def __init__(self) -> None:
        self.backend = _Backend()
        self.model_runner = _Runner(_Model())
        self._hotswap_st = _HotswapState(WorkerSettings(), self.backend)  # type: ignore[arg-type]


def test_realistic_weights_redraws_every_parameter_and_pins_again() -> None:
    w = Worker()
    model = w.model_runner.model
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out = w.hotswap_bench_realistic_weights(seed=3)
    assert out["ok"], out
    assert out["filled_bytes"] == sum(p.numel() * 2 for p in model.parameters())
    for n, p in model.named_parameters():
        assert not torch.equal(p, before[n]), n
    norm = model.input_layernorm.detach().float()
    assert 0.05 < float(norm.mean()) < 1.6  # norm weights drawn around their mean
    assert w.backend.warmed == ["exp", "exp"]  # joined, then pinned for the new size
    again = Worker()
    again.model_runner.model.load_state_dict(before)
    again.hotswap_bench_realistic_weights(seed=3)
    for (n, p), q in zip(
        model.named_parameters(), again.model_runner.model.parameters(), strict=True
    ):
        assert torch.equal(p, q), n  # deterministic for a seed


def test_realistic_weights_refused_asleep_untouched() -> None:
    w = Worker()
    w.backend.asleep = {"weights": "offloaded"}
    before = w.model_runner.model.proj.weight.detach().clone()
    out = w.hotswap_bench_realistic_weights()
    assert not out["ok"]
    assert "asleep" in out["error"]
    assert torch.equal(w.model_runner.model.proj.weight, before)
    assert w.backend.warmed == []


def test_codec_switch_changes_both_settings_and_pins_for_it() -> None:
    w = Worker()
    out = w.hotswap_bench_codec("none")
    assert out["ok"], out
    assert out["codec"] == "none"
    assert w._hotswap_st is not None
    assert w._hotswap_st.settings.host_codec == "none"
    assert w.backend.settings.host_codec == "none"
    assert w.backend.warmed == ["none", "none"]
    bad = w.hotswap_bench_codec("zstd")
    assert not bad["ok"]
    assert "zstd" in bad["error"]
    assert w.backend.settings.host_codec == "none"
    w.backend.asleep = {"weights": "offloaded"}
    assert not w.hotswap_bench_codec("exp")["ok"]
    assert w.backend.settings.host_codec == "none"


def test_the_kvlate_variant_turns_the_kv_cache_first_off_and_base_back_on() -> None:
    w = Worker()
    try:
        out = w.hotswap_bench_variant("kvlate")
        assert out["ok"], out
        assert out["kv_early"] is False
        assert w.backend.settings.tuning.kv_early is False
        assert w.hotswap_bench_variant("base")["kv_early"] is True
        assert w.backend.settings.tuning.kv_early is True
    finally:
        w.hotswap_bench_variant("base")  # the fingerprint baseline as it was


def test_the_kvthread_variant_turns_the_kv_release_thread_on_and_base_back_to_the_default() -> None:
    w = Worker()
    try:
        out = w.hotswap_bench_variant("kvthread")
        assert out["ok"], out
        assert out["kv_thread"] is True
        assert w.backend.settings.tuning.kv_thread is True
        assert w.backend.settings.tuning.kv_early is True  # it needs the KV cache first
        assert w.hotswap_bench_variant("base")["kv_thread"] is Tuning().kv_thread
        assert w.backend.settings.tuning.kv_thread is Tuning().kv_thread
    finally:
        w.hotswap_bench_variant("base")


def test_the_freelater_variants_turn_free_later_on_and_base_back_to_the_default() -> None:
    w = Worker()
    try:
        out = w.hotswap_bench_variant("freelater")
        assert out["ok"], out
        assert out["free_later"] is True
        assert w.backend.settings.tuning.free_later is True
        assert w.backend.settings.tuning.sleep_stage_share == Tuning().sleep_stage_share
        w.hotswap_bench_variant("freelater50")
        assert w.backend.settings.tuning.free_later is True
        assert w.backend.settings.tuning.sleep_stage_share == 0.5
        assert w.hotswap_bench_variant("base")["free_later"] is Tuning().free_later
        assert w.backend.settings.tuning.sleep_stage_share == Tuning().sleep_stage_share
    finally:
        w.hotswap_bench_variant("base")


def test_the_share_variants_set_the_fused_sleeps_first_stage_and_base_the_default() -> None:
    w = Worker()
    try:
        out = w.hotswap_bench_variant("share70")
        assert out["ok"], out
        assert w.backend.settings.tuning.sleep_stage_share == 0.7
        w.hotswap_bench_variant("share50")
        assert w.backend.settings.tuning.sleep_stage_share == 0.5
        assert w.backend.settings.tuning.free_later is Tuning().free_later
        assert w.backend.settings.tuning.kv_early is True
        w.hotswap_bench_variant("share100")
        assert w.backend.settings.tuning.sleep_stage_share == 1.0
        w.hotswap_bench_variant("base")
        assert w.backend.settings.tuning.sleep_stage_share == 0.3
    finally:
        w.hotswap_bench_variant("base")


def test_loaded_library_without_vllm_reads_this_process_maps(monkeypatch: Any) -> None:
    # a torch-only device bench has no vLLM: the path comes from /proc/self/maps
    monkeypatch.setitem(sys.modules, "vllm.utils.system_utils", None)  # import fails
    path = cudart.loaded_library("libc")
    assert path is not None
    assert "/libc" in path
    assert ".so" in path
    assert cudart.loaded_library("libno-such-library-here") is None
