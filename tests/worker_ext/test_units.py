"""Pure CPU unit tests (no vLLM engine): the ownership walk, snapshots, the RPC wrapper
(fingerprints: test_fingerprint.py)."""

from __future__ import annotations

from typing import Any

import torch

from worker_ext import ownership, snapshot
from worker_ext.barrier import late_from_error
from worker_ext.extension import plain, rpc


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("buf", torch.arange(4.0))
        self.const = torch.tensor([8.0])  # a plain attribute: invisible to named_buffers
        self.tables = [torch.ones(2), {"k": torch.zeros(3)}]
        self.alias = self.lin.weight.detach()[0]  # same storage as the weight


class _Runner:
    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.kv_caches = [torch.zeros(16), torch.zeros(16)]
        self.input_batch = type("IB", (), {})()
        self.input_batch.block_table = torch.zeros(4, dtype=torch.int32)


def test_walk_names_kinds_and_aliases() -> None:
    model = _Tiny()
    runner = _Runner(model)
    recs = {r.name: r for r in ownership.walk(model, runner)}
    assert recs["runner.kv_caches.0"].is_kv
    assert recs["lin.weight"].kind == ownership.PARAMETER
    assert recs["buf"].kind == ownership.BUFFER
    assert recs["const"].kind == ownership.ATTRIBUTE
    assert "tables.0" in recs
    assert "tables.1.k" in recs
    assert "alias" not in recs  # deduplicated into lin.weight, which keeps both slots
    assert len(recs["lin.weight"].slots) == 2
    assert recs["runner.input_batch.block_table"].kind == ownership.RUNNER
    assert "runner.model" not in recs


def test_judge_level_semantics() -> None:
    model = _Tiny()
    runner = _Runner(model)
    recs = ownership.walk(model, runner)
    model_ptrs = {r.tensor.untyped_storage().data_ptr() for r in recs if r.kind != "runner"}
    kv_ptrs = {r.tensor.untyped_storage().data_ptr() for r in recs if r.is_kv}

    def tag_of(ptr: int, n: int) -> str:
        return "weights" if ptr in model_ptrs else "kv_cache" if ptr in kv_ptrs else "unpooled"

    l1 = {r["name"]: r for r in ownership.judge(recs, 1, tag_of)}
    l2 = {r["name"]: r for r in ownership.judge(recs, 2, tag_of)}
    assert not any(r["at_risk"] for r in l1.values())
    assert l2["const"]["at_risk"]
    assert l2["buf"]["at_risk"]
    assert not l2["lin.weight"]["at_risk"]  # the reload refills parameters
    assert not l2["runner.kv_caches.0"]["at_risk"]  # the KV cache itself is never at risk
    assert not l2["runner.input_batch.block_table"]["at_risk"]


def test_snapshot_restores_in_place_and_rebinds() -> None:
    model = _Tiny()
    recs = ownership.walk(model, None)
    snap = snapshot.prepare(2, recs, {"const", "buf"}, pin=False)
    ptr = model.const.data_ptr()
    model.const.fill_(0.0)  # discarded at the same address
    model.buf.fill_(-1.0)
    old_w = model.lin.weight
    new = torch.nn.Parameter(old_w.detach().clone())
    model.lin.weight = new  # a reload that pointed the slot at new storage
    rebound = snapshot.rebind(snap)
    assert snapshot.restore(snap) == 2
    checked, mismatched, _ = snapshot.verify(snap)
    assert mismatched == []
    assert checked == len(snap.entries)
    assert rebound == ["lin.weight"]
    assert model.lin.weight is old_w
    assert model.const.data_ptr() == ptr
    assert model.const.item() == 8.0
    # a single element nothing restores is named
    model.lin.bias.data[1] += 1.0
    assert snapshot.verify(snap)[1] == ["lin.bias"]


def test_rpc_wrapper_never_raises() -> None:
    class W:
        rank = 3

        @rpc
        def hotswap_boom(self) -> dict[str, Any]:
            raise ZeroDivisionError("x")

        @rpc
        def hotswap_fine(self) -> dict[str, Any]:
            return {"t": (1, 2), "d": {1: torch.tensor(2.0)}}

    bad = W().hotswap_boom()
    assert bad["ok"] is False
    assert bad["rank"] == 3
    assert "ZeroDivisionError" in bad["error"]
    good = W().hotswap_fine()
    assert good == {
        "ok": True,
        "t": [1, 2],
        "d": {"1": 2.0},
        "rank": 3,
        "elapsed_s": good["elapsed_s"],
    }
    assert plain({"x": object()})["x"].startswith("<object")


def test_late_ranks_parsed_from_gloo_message() -> None:
    msg = "[Rank 0]: Ranks 1, 3 failed to pass monitoredBarrier in 1000 ms"
    assert late_from_error(msg, [4, 5, 6, 7]) == [5, 7]
    assert late_from_error("Rank 2 failed to pass monitoredBarrier in 5 ms", [0, 1, 2]) == [2]
    assert late_from_error("connection reset", [0, 1]) == []


def test_a_verify_mismatch_asks_the_backend_about_its_host_copy() -> None:
    """After a mismatch the extension hands the kernel's differing pieces (the weights'
    plan's, then a kept KV cache's) to the backend's host copy check; no pieces or no such
    backend: None; a check that raises: its error, never the RPC's."""
    from types import SimpleNamespace

    from worker_ext.extension.waking import WakeRPCs

    class _Rank(WakeRPCs):
        def __init__(self, backend: Any) -> None:
            self._backend = backend

        def _hotswap_state(self) -> Any:
            return SimpleNamespace(backend=self._backend)

    asked: list[Any] = []

    class _Backend:
        def check_host_copy(self, bad: Any) -> dict[str, Any]:
            asked.append(list(bad))
            return {"pieces": len(bad), "summary": "looked"}

    snap: Any = SimpleNamespace(
        plan=SimpleNamespace(kernel_differing=[(64, 16, 1, 2)]),
        kv_plan=SimpleNamespace(kernel_differing=[(128, 8, 3, 4)]),
    )
    assert _Rank(_Backend())._hotswap_host_copy_check(snap) == {"pieces": 2, "summary": "looked"}
    assert asked == [[(64, 16, 1, 2), (128, 8, 3, 4)]]
    assert _Rank(object())._hotswap_host_copy_check(snap) is None  # the host backend
    none: Any = SimpleNamespace(plan=SimpleNamespace(kernel_differing=[]), kv_plan=None)
    assert _Rank(_Backend())._hotswap_host_copy_check(none) is None  # the eager check

    class _Failing:
        def check_host_copy(self, bad: Any) -> dict[str, Any]:
            raise RuntimeError("boom")

    out = _Rank(_Failing())._hotswap_host_copy_check(snap)
    assert out is not None
    assert out["error"] == "RuntimeError: boom"
    assert out["summary"] == "not checked: boom"
