"""What a sleeping engine leaves on the GPU, by component; and the prefix cache kept across a
level-1 sleep (issue 17, items 4 and 5).

    python3 -m benchmarks.footprint --shape llama3-8b [--keep-kv] [--cuts]

Runs on the lent device (one H200). One in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0:
the worker is this process, so torch's allocator and vLLM's CuMemAllocator are read here),
dummy bf16 weights, CUDA graphs on. Order: the CUDA context alone (before vLLM) -> engine
-> awake -> raw vLLM level 1 -> ours level 1 (as the extension leaves it, then each cut
tried in place) -> [--keep-kv: the prefix cache kept across ours level 1 against the
default, hit counters and first-token time of a long repeated prompt] -> ours level 2 ->
raw vLLM level 2 (the last two wake without a reload: the dummy loader has none, so
nothing is generated after them).

Each measurement: the whole device's used memory (cudaMemGetInfo; this is the only process)
and its parts: vLLM's CuMem pools still mapped, torch's default pool (allocated / cached
free), CUDA-graph pools (torch private pools outside CuMem), and the rest (CUDA context,
module images, communicators: what no allocator of this process accounts for), with NVML's
per-process figure beside it. Writes $OUT/footprint.json and prints tables.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
from typing import Any

from benchmarks.common import SHAPES, GiB, dummy_engine_kwargs, gen, logger, rss, timed
from controller import protocol

log = logger("bench")


def nvml_used() -> dict[str, Any]:
    """NVML's per-process used memory for this pid (None where the container hides it)."""
    try:
        try:
            import pynvml
        except ImportError:
            from vllm.third_party import pynvml  # type: ignore[no-redef]
        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(h)
        mine = [p.usedGpuMemory for p in procs if p.pid == os.getpid()]
        return {
            "self": int(mine[0]) if mine and mine[0] is not None else None,
            "all": [(int(p.pid), int(p.usedGpuMemory or 0)) for p in procs],
            "device_used": int(pynvml.nvmlDeviceGetMemoryInfo(h).used),
        }
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


def parts() -> dict[str, Any]:
    """The device's used bytes and where they are."""
    import torch

    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    used = total - free
    try:
        from vllm.device_allocator.cumem import CuMemAllocator

        inst = CuMemAllocator.instance
        recs = dict(inst.pointer_to_data) if inst is not None else {}
    except Exception:
        recs = {}
    cumem_mapped: dict[str, int] = {}
    cumem_asleep: dict[str, int] = {}
    for data in recs.values():
        into = cumem_asleep if data.is_asleep else cumem_mapped
        into[data.tag] = into.get(data.tag, 0) + int(data.handle[1])
    out: dict[str, Any] = {
        "used": used,
        "total": total,
        "cumem_mapped": cumem_mapped,
        "cumem_asleep": cumem_asleep,
        "default_allocated": 0,
        "default_cached": 0,
        "graph_allocated": 0,
        "graph_cached": 0,
        "graph_pools": 0,
        "default_largest": [],
    }
    pools: set[Any] = set()
    sizes: list[int] = []
    for seg in torch.cuda.memory_snapshot():
        if int(seg["address"]) in recs:
            continue
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        kind = "default" if pool == (0, 0) else "graph"
        if kind == "graph":
            pools.add(pool)
        out[f"{kind}_allocated"] += int(seg["allocated_size"])
        out[f"{kind}_cached"] += int(seg["total_size"]) - int(seg["allocated_size"])
        if kind == "default":
            sizes += [int(b["size"]) for b in seg["blocks"] if b["state"] == "active_allocated"]
    out["graph_pools"] = len(pools)
    out["default_largest"] = sorted(sizes, reverse=True)[:12]
    accounted = (
        sum(cumem_mapped.values())
        + out["default_allocated"]
        + out["default_cached"]
        + out["graph_allocated"]
        + out["graph_cached"]
    )
    out["rest"] = used - accounted  # context, modules, communicators, graph executables
    out["nvml"] = nvml_used()
    return out


def gib(n: Any) -> str:
    return f"{n / GiB:.3f}" if isinstance(n, (int, float)) else "-"


class Ours:
    """The extension's RPCs in controller.protocol's order (in-process collective_rpc)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def rpc(self, method: str, *args: Any) -> dict[str, Any]:
        r = self.llm.collective_rpc(method, args=args)[0]
        if not r.get("ok"):
            raise RuntimeError(f"{method} failed: {r.get('error')}")
        return r  # type: ignore[no-any-return]

    def sleep(self, level: int, keep_kv: bool = False) -> dict[str, Any]:
        if not keep_kv:
            self.llm.reset_prefix_cache()  # the controller's /pause?clear_cache=true
        extra: dict[str, Any] = {"keep_kv": True} if keep_kv else {}
        params = protocol.Params(level=level, quiesce_timeout_s=30.0, **extra)
        out: dict[str, Any] = {}
        t = time.perf_counter()
        for step in protocol.sleep_steps(level):
            if step is protocol.SUSPEND and keep_kv and out["prepare"].get("kv") != "keep":
                # what the controller's kv step does: clear, then discard as usual
                log("kv not kept:", out["prepare"].get("kv_reason"))
                self.llm.reset_prefix_cache()
                params = protocol.Params(level=level, quiesce_timeout_s=30.0)
            out[step.phase] = self.rpc(step.method, *step.call_args(params))
        out["sleep_s"] = time.perf_counter() - t
        return out

    def wake(self, level: int, verify: bool = True) -> dict[str, Any]:
        params = protocol.Params(level=level)
        out: dict[str, Any] = {}
        t = time.perf_counter()
        for step in protocol.wake_steps(level):
            if step is protocol.RELOAD or (step is protocol.VERIFY and not verify):
                continue
            out[step.phase] = self.rpc(step.method, *step.call_args(params))
        out["wake_s"] = time.perf_counter() - t
        return out


def first_token(llm: Any, prompt: list[int]) -> dict[str, Any]:
    """Seconds to the first (only) token of `prompt`, and the tokens the engine says it
    took from its prefix cache (RequestOutput.num_cached_tokens)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False)
    t = time.perf_counter()
    out = llm.generate(TokensPrompt(prompt_token_ids=prompt), sp, use_tqdm=False)
    return {
        "s": time.perf_counter() - t,
        "cached_tokens": getattr(out[0], "num_cached_tokens", None),
        "token": out[0].outputs[0].token_ids[0],
    }


def prefix_counters(llm: Any) -> dict[str, float]:
    """vLLM's own prefix-cache counters (the engine's stat loggers; /metrics serves them)."""
    got: dict[str, float] = {}
    try:
        for m in llm.get_metrics():
            if m.name in ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits"):
                got[m.name] = got.get(m.name, 0.0) + float(getattr(m, "value", 0.0))
    except Exception as e:
        got["error"] = f"{type(e).__name__}: {e}"  # type: ignore[assignment]
    return got


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--util", type=float, default=0.35)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--prompt-len", type=int, default=3000)
    ap.add_argument("--keep-kv", action="store_true", help="the prefix cache across a sleep")
    ap.add_argument("--cuts", action="store_true", help="try each cut in place while asleep")
    ap.add_argument("--raw", action="store_true", help="raw vLLM's level 1 and 2 too")
    ap.add_argument("--compile", default="O0-full", choices=("O0-full", "default"))
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    t0 = time.perf_counter()
    torch.cuda.init()
    torch.empty(1, device="cuda")
    res: dict[str, Any] = {
        "shape": args.shape,
        "util": args.util,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cmd": " ".join(sys.argv),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "context_alone": parts(),  # this process: torch's CUDA context, nothing else yet
    }
    import vllm
    from vllm import LLM

    res["vllm"] = vllm.__version__
    kw = dummy_engine_kwargs(
        args.shape,
        args.max_model_len,
        enable_sleep_mode=True,
        gpu_memory_utilization=args.util,
        disable_log_stats=False,  # the prefix-cache counters
        enable_prefix_caching=True,
    )
    if args.compile == "O0-full":
        kw["compilation_config"] = {"mode": 0, "cudagraph_mode": "FULL"}
    llm, res["llm_start_s"] = timed(LLM, **kw)
    log(f"engine up in {res['llm_start_s']:.1f} s")
    base = gen(llm)
    ours = Ours(llm)
    info = ours.rpc("hotswap_info")
    res["info_awake"] = info
    rows: list[tuple[str, dict[str, Any]]] = [("awake", parts())]
    equal: list[bool] = []
    prompt = [5 + (i * 7919) % 1000 for i in range(args.prompt_len)]

    if args.raw:
        _, ts = timed(llm.sleep, 1)
        rows.append(("raw vLLM level 1", parts()))
        _, tw = timed(llm.wake_up)
        res["raw_l1"] = {"sleep_s": ts, "wake_s": tw}
        equal.append(gen(llm) == base)
        llm.reset_prefix_cache()
        res["raw_l1"]["first_token"] = first_token(llm, prompt)

    # ours level 1, as the extension leaves it; then each cut in place
    s = ours.sleep(1)
    rows.append(("ours level 1", parts()))
    res["ours_l1_suspend"] = s["suspend"]
    res["info_asleep_l1"] = ours.rpc("hotswap_info")
    if args.cuts:
        gc.collect()
        torch.cuda.empty_cache()
        rows.append(("ours level 1 + gc + empty_cache", parts()))
    w = ours.wake(1)
    res["ours_l1"] = {"sleep_s": s["sleep_s"], "wake_s": w["wake_s"], "wake": w}
    llm.reset_prefix_cache()
    res["ours_l1"]["first_token"] = first_token(llm, prompt)
    equal.append(gen(llm) == base)
    rows.append(("awake after ours level 1", parts()))

    if args.keep_kv:
        res["keep_kv"] = keep_kv_proof(llm, ours, prompt, base, equal)

    # ours level 2 (no reload: measured asleep only), then raw vLLM level 2
    s2 = ours.sleep(2)
    rows.append(("ours level 2", parts()))
    res["ours_l2_suspend"] = s2["suspend"]
    res["info_asleep_l2"] = ours.rpc("hotswap_info")
    if args.cuts:
        gc.collect()
        torch.cuda.empty_cache()
        rows.append(("ours level 2 + gc + empty_cache", parts()))
    ours.wake(2, verify=False)
    if args.raw:
        _, ts = timed(llm.sleep, 2)
        rows.append(("raw vLLM level 2", parts()))
        res["raw_l2"] = {"sleep_s": ts}
    res["rows"] = rows
    res["tokens_equal"] = equal
    res["total_s"] = time.perf_counter() - t0

    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "footprint.json"), "w") as f:
        json.dump(res, f, default=str, indent=1)
    print(
        "\n| state | device used | CuMem mapped | default pool alloc / cached"
        " | graph pools alloc / cached (n) | rest (context, modules, comms) | NVML self |"
    )
    print("|---|---|---|---|---|---|---|")
    ctx = res["context_alone"]
    for name, p in [("CUDA context alone (torch init)", ctx), *rows]:
        nv = p["nvml"].get("self") if isinstance(p.get("nvml"), dict) else None
        print(
            f"| {name} | {gib(p['used'])} | {gib(sum(p['cumem_mapped'].values()))}"
            f" | {gib(p['default_allocated'])} / {gib(p['default_cached'])}"
            f" | {gib(p['graph_allocated'])} / {gib(p['graph_cached'])} ({p['graph_pools']})"
            f" | {gib(p['rest'])} | {gib(nv)} |"
        )
    print("times:", {k: res.get(k) for k in ("raw_l1", "llm_start_s", "total_s")})
    for key in ("info_asleep_l1", "info_asleep_l2"):
        print(key, "resident:", res[key].get("resident"))
    print(
        "suspend resident_bytes l1/l2:",
        [res[k].get("resident_bytes") for k in ("ours_l1_suspend", "ours_l2_suspend")],
    )
    kv = res.get("keep_kv") or {}
    if kv:
        print(
            "\n| arm | sleep s | wake s | first token cold / warm / after wake (s) | cached tokens"
            " after wake | vLLM prefix hits (tokens) over the after-wake request | KV verified"
            " bytes | KV host buffer | RSS asleep - awake |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for arm, r in kv.items():
            hits = r["counters_after"].get("vllm:prefix_cache_hits", 0) - r["counters_mid"].get(
                "vllm:prefix_cache_hits", 0
            )
            print(
                f"| {arm} | {r['sleep_s']:.3f} | {r['wake_s']:.3f} | {r['cold']['s']:.3f} /"
                f" {r['warm']['s']:.3f} / {r['after_wake']['s']:.3f} |"
                f" {r['after_wake']['cached_tokens']} | {hits:g} |"
                f" {r['kv_verified_bytes']} | {r['kv_host_bytes']} | {gib(r['rss_delta'])} GiB |"
            )
    print(
        "ours l1:",
        {k: v for k, v in res["ours_l1"].items() if k != "wake"},
        "tokens equal:",
        equal,
        flush=True,
    )
    return 0 if all(equal) else 1


def keep_kv_proof(
    llm: Any, ours: Ours, prompt: list[int], base: Any, equal: list[bool]
) -> dict[str, Any]:
    """The same long prompt after a level-1 wake: default (prefix cache cleared, KV
    discarded) against keep (KV offloaded, cache kept); vLLM's hit counters around each."""
    out: dict[str, Any] = {}
    for arm in ("default", "keep (first: pins its buffer)", "keep"):
        keep = arm.startswith("keep")
        llm.reset_prefix_cache()
        cold = first_token(llm, prompt)  # computes and caches the prompt's blocks
        warm = first_token(llm, prompt)  # a hit while awake: the best case
        before = prefix_counters(llm)
        rss0 = rss()
        s = ours.sleep(1, keep_kv=keep)
        asleep = parts()
        rss1 = rss()
        w = ours.wake(1)
        mid = prefix_counters(llm)
        after_wake = first_token(llm, prompt)
        after = prefix_counters(llm)
        info = ours.rpc("hotswap_info")
        equal.append(after_wake["token"] == cold["token"])
        equal.append(gen(llm) == base)
        out[arm] = {
            "cold": cold,
            "warm": warm,
            "after_wake": after_wake,
            "counters_before": before,
            "counters_mid": mid,
            "counters_after": after,
            "sleep_s": s["sleep_s"],
            "prepare": {k: v for k, v in s["prepare"].items() if k != "at_risk"},
            "suspend": s["suspend"],
            "wake_s": w["wake_s"],
            "wake": w,
            "asleep": asleep,
            "rss_delta": rss1 - rss0,
            "kv_verified_bytes": w.get("restore_and_verify", {}).get("kv_verified_bytes"),
            "kv_host_bytes": info.get("backend_detail", {}).get("kv_host_backup_bytes"),
        }
        log(arm, {k: out[arm][k] for k in ("cold", "warm", "after_wake", "sleep_s", "wake_s")})
    return out


if __name__ == "__main__":
    sys.exit(main())
