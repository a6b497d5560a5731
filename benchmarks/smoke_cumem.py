"""Device smoke run of worker_ext.cumem.CuMemBackend alone (no extension), tiny model.

    python3 -m benchmarks.smoke_cumem

Not a pytest module. In-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) driven through
local callables: tag_of, a kv-only suspend, level 1 and level 2 (reload from a host copy,
is_checkpoint_format=False; buffers put back by hand, as the snapshot module would),
tokens and logprobs compared after each. Prints one JSON line per check and exits non-zero
on the first failed check.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

from benchmarks.common import gen, write_config

FAILED: list[str] = []


def check(name: str, ok: bool, **info: Any) -> None:
    print(json.dumps({"check": name, "ok": ok, **info}, default=str), flush=True)
    if not ok:
        FAILED.append(name)


def main() -> int:
    import torch
    from vllm import LLM

    d = write_config("tiny", tempfile.mkdtemp(prefix="tiny-"))
    llm = LLM(
        model=d,
        load_format="dummy",
        skip_tokenizer_init=True,
        enable_sleep_mode=True,
        enforce_eager=True,
        max_model_len=256,
        gpu_memory_utilization=0.05,
        dtype="bfloat16",
        seed=0,
        attention_backend="TRITON_ATTN",
    )
    state: dict[str, Any] = {}

    def backend(w: Any) -> Any:
        if "b" not in state:
            from worker_ext.cumem import CuMemBackend

            state["b"] = CuMemBackend(w.worker)
        return state["b"]

    def rpc(fn: Any) -> Any:
        return llm.collective_rpc(lambda w: fn(w, backend(w)))[0]

    base = gen(llm)
    check("deterministic", gen(llm) == base, tokens=base[0])

    def tags(w: Any, b: Any) -> dict[str, Any]:
        model = w.worker.get_model()
        p = next(iter(model.parameters()))
        kv = w.worker.model_runner.kv_caches if hasattr(w.worker.model_runner, "kv_caches") else []
        kvt = kv[0] if kv else None
        x = torch.empty(1 << 20, device="cuda")
        return {
            "param": b.tag_of(p.data_ptr(), p.nbytes),
            "kv": b.tag_of(kvt.data_ptr(), kvt.nbytes) if kvt is not None else None,
            "fresh": b.tag_of(x.data_ptr(), x.nbytes),
            "pools": b.pools(),
            "runner": type(w.worker.model_runner).__module__,
            "describe": b.describe(),
        }

    t = rpc(tags)
    check(
        "tag_of",
        t["param"] == "weights" and t["fresh"] == "unpooled" and t["kv"] in ("kv_cache", None),
        **t,
    )

    def checksum(w: Any, b: Any) -> float:
        return float(sum(p.double().sum().item() for p in w.worker.get_model().parameters()))

    c0 = rpc(checksum)
    llm.reset_prefix_cache()
    s = rpc(lambda w, b: b.suspend(1, ["kv_cache"]))
    freed_mem = s["memory_after"] - s["memory_before"]
    check(
        "kv_only_suspend",
        s["freed_bytes"] == {"kv_cache": t["pools"]["kv_cache"]}
        and freed_mem >= 0.9 * t["pools"]["kv_cache"]
        and rpc(lambda w, b: b.suspended()) == {"kv_cache": "discarded"},
        suspend=s,
        device_freed=freed_mem,
    )
    check("weights_intact_while_kv_asleep", rpc(checksum) == c0)
    r = rpc(lambda w, b: b.resume(["kv_cache"]))
    check("kv_only_resume", gen(llm) == base, resume=r)

    for cycle in range(2):
        llm.reset_prefix_cache()
        s = rpc(lambda w, b: b.suspend(1, ["weights", "kv_cache"]))
        r1 = rpc(lambda w, b: b.resume(["weights"]))
        r2 = rpc(lambda w, b: b.resume(["kv_cache"]))
        check(f"level1_cycle{cycle}", gen(llm) == base and rpc(checksum) == c0, s=s, r1=r1, r2=r2)

    def save(w: Any, b: Any) -> int:
        model = w.worker.get_model()
        state["params"] = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        state["buffers"] = {n: x.detach().cpu().clone() for n, x in model.named_buffers()}
        return len(state["params"])

    @torch.inference_mode()
    def reload(w: Any, b: Any) -> None:
        w.worker.reload_weights(
            weights_iterator=iter(state["params"].items()), is_checkpoint_format=False
        )
        for n, x in w.worker.get_model().named_buffers():
            x.copy_(state["buffers"][n])

    rpc(save)
    llm.reset_prefix_cache()
    s = rpc(lambda w, b: b.suspend(2, ["weights", "kv_cache"]))
    r1 = rpc(lambda w, b: b.resume(["weights"]))
    zero = rpc(checksum)
    rpc(reload)
    r2 = rpc(lambda w, b: b.resume(["kv_cache"]))
    check(
        "level2_cycle",
        gen(llm) == base and zero == 0.0 and rpc(checksum) == c0,
        s=s,
        zero_checksum=zero,
        r1=r1,
        r2=r2,
    )
    print(json.dumps({"failed": FAILED}), flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
