"""vLLM's own level-1 `wake_up` through the `hotswap` sleep-mode backend, against the
sidecar's in-worker wake and plain vLLM (cumem), on one engine (docs/contracts.md §1.5):

    python3 -m benchmarks.vllmsleep --shape llama3-8b [--cycles 3] [--graphs 0]

Runs on the lent device (benchmarks/run-on-device.sh step `vllmsleep:SHAPE`). One in-process
engine (VLLM_ENABLE_V1_MULTIPROCESSING=0) started with `worker_cls=worker_ext.HotSwapWorker`,
dummy bf16 weights redrawn like a trained model's (benchmarks/realweights.py). Order: plain
vLLM cycles first (the worker's backend swapped for vLLM's own `CuMemBackend` for them, then
put back), then, in turn per cycle, (a) `LLM.sleep(1)`/`LLM.wake_up()`, which reach the
backend through vLLM's engine core, executor and worker, and (b) the sidecar's RPCs,
`hotswap_quiesce` + `hotswap_sleep(1)` and `hotswap_wake()`, through `collective_rpc`. Each
call is timed caller-side; tokens and logprobs are compared after every wake. Prints a table
and writes one JSON line to $OUT/vllmsleep.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import GB, gen, logger, timed, write_config
from benchmarks.wake import engine_kwargs, find_backend

log = logger("bench", clock=False)


def rpc(llm: Any, method: str, *args: Any) -> dict[str, Any]:
    r: dict[str, Any] = llm.collective_rpc(method, args=args)[0]
    if not r.get("ok"):
        raise RuntimeError(f"{method} failed: {r.get('error')}")
    return r


def use_cumem(w: Any) -> str:
    """In the worker: keep the hotswap backend aside and give the worker vLLM's own."""
    from vllm.device_allocator.sleep_mode_backend import CuMemBackend

    w.worker._hotswap_bench_saved = w.worker._sleep_mode_backend
    w.worker._sleep_mode_backend = CuMemBackend()
    return type(w.worker._sleep_mode_backend).__name__


def use_hotswap(w: Any) -> str:
    w.worker._sleep_mode_backend = w.worker._hotswap_bench_saved
    return type(w.worker._sleep_mode_backend).__name__


def median(rows: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in rows) if rows else float("nan")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--raw-cycles", type=int, default=2)
    ap.add_argument("--graphs", type=int, default=0, help="1: vLLM's compile and CUDA graphs")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch
    import vllm
    from vllm import LLM

    from benchmarks import realweights

    res: dict[str, Any] = {
        "shape": args.shape,
        "graphs": bool(args.graphs),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cmd": " ".join(sys.argv),
    }
    d = write_config(args.shape, tempfile.mkdtemp(prefix=f"{args.shape}-"))
    kw = engine_kwargs(d, args.shape, graphs=bool(args.graphs))
    kw["worker_cls"] = "worker_ext.HotSwapWorker"
    llm, res["llm_start_s"] = timed(LLM, **kw)

    def fill(w: Any) -> int:
        model = w.worker.model_runner.get_model()
        return realweights.fill_model_(model.named_parameters(), seed=1)

    filled = llm.collective_rpc(fill)
    res["backend_class"] = llm.collective_rpc(
        lambda w: type(w.worker._sleep_mode_backend).__name__
    )[0]
    info = rpc(llm, "hotswap_info")  # the extension's state, its warm prepare
    llm.collective_rpc(lambda w: find_backend(w.worker).warm_host(wait=True))
    res["weights_bytes"] = int(info["pools"]["weights"])
    log(f"{res['weights_bytes'] / GB:.2f} GB of weights ({filled[0] / GB:.2f} GB redrawn)")
    base = gen(llm)
    equal: list[bool] = []

    raw: list[dict[str, Any]] = []
    res["raw_backend"] = llm.collective_rpc(use_cumem)[0]
    for _ in range(args.raw_cycles):
        _, ts = timed(llm.sleep, 1)
        _, tw = timed(llm.wake_up)
        equal.append(gen(llm) == base)
        raw.append({"sleep_s": ts, "wake_s": tw})
        log("cumem", raw[-1], "equal", equal[-1])
    llm.collective_rpc(use_hotswap)
    torch._C._host_emptyCache()  # vLLM's per-record pinned copies stay cached after its wake

    via_vllm: list[dict[str, Any]] = []
    via_rpc: list[dict[str, Any]] = []
    for _ in range(args.cycles):
        _, ts = timed(llm.sleep, 1)
        _, tw = timed(llm.wake_up)
        phase = rpc(llm, "hotswap_info")["phase"]
        equal.append(gen(llm) == base and phase == "awake_verified")
        via_vllm.append({"sleep_s": ts, "wake_s": tw, "phase": phase})
        log("backend (vLLM's sleep/wake_up)", via_vllm[-1], "equal", equal[-1])
        llm.reset_prefix_cache()
        t = time.perf_counter()
        rpc(llm, "hotswap_quiesce", 30.0)
        slept = rpc(llm, "hotswap_sleep", 1)
        ts = time.perf_counter() - t
        woke, tw = timed(rpc, llm, "hotswap_wake")
        equal.append(gen(llm) == base and woke["mismatched"] == [])
        via_rpc.append({"sleep_s": ts, "wake_s": tw, "verified": woke["verified"]})
        log("sidecar RPCs", via_rpc[-1], "protected", slept["protected_bytes"], equal[-1])

    res.update(cumem=raw, backend=via_vllm, rpc=via_rpc, all_equal=all(equal))
    wb, wr, wc = (median(x, "wake_s") for x in (via_vllm, via_rpc, raw))
    sb, sr, sc = (median(x, "sleep_s") for x in (via_vllm, via_rpc, raw))
    res["ratios"] = {"wake_backend_over_rpc": wb / wr, "wake_backend_over_cumem": wb / wc}
    print(f"\n| {args.shape}, level 1 (median) | sleep s | wake s | wake / sidecar RPC |")
    print("|---|---|---|---|")
    print(f"| vLLM's /wake_up, hotswap backend | {sb:.3f} | {wb:.3f} | {wb / wr:.3f}x |")
    print(f"| sidecar's RPCs (hotswap_sleep, hotswap_wake) | {sr:.3f} | {wr:.3f} | 1.000x |")
    print(f"| vLLM's /wake_up, cumem (plain vLLM) | {sc:.3f} | {wc:.3f} | {wc / wr:.3f}x |")
    print(f"tokens and logprobs equal after every wake: {all(equal)}")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "vllmsleep.jsonl"), "a") as f:
            f.write(json.dumps(res) + "\n")
    return 0 if all(equal) else 1


if __name__ == "__main__":
    sys.exit(main())
