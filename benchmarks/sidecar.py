"""Whole level-1 sleep and wake through the sidecar on one GPU, next to raw vLLM's.

    python3 -m benchmarks.sidecar [--shape llama3-8b] [--cycles 3] [--graphs 1]
                                  [--ttft-tokens 1000] [--budget-s 420] [--fused 0,1]
                                  [--serial-boot 0] [--wait-pinned 1] [--variants V,...]

Runs on the lent device after the vLLM bundle, with the sidecar's extra wheels on
PYTHONPATH. First the pinned-copy bandwidth (torch, this process: the bound is weights
bytes / bandwidth), then two vLLM 0.26 HTTP servers, booted at once and measured one after
the other (each while the other idles), same flags
(the shape's config, dummy bf16 weights, max_model_len 2048, the shape's utilization,
--skip-tokenizer-init, sleep mode, the worker extension, VLLM_SERVER_DEV_MODE=1,
127.0.0.1, own process group; `--graphs 1`: vLLM's default compile and CUDA-graph capture,
`0`: --enforce-eager):

1. ours: `python -m controller serve --config FILE` (the engine attached as `llama`, its
   `fused_wake` as `--fused` names it: one sidecar per value, one after the other, on the
   same engine, `--cycles` cycles each; `0`: the wake's three RPCs, `1`: one hotswap_wake);
   three first-token requests
   (`--ttft-tokens` distinct prompt tokens, 1 token out) on the never-slept engine; per
   cycle POST /models/llama/sleep {"level": 1} (its phases and the ranks' own step timings
   kept), 1 s asleep, then POST /models/llama/wake while /health is polled every 2 ms:
   the seconds from the POST's send to its answer and to the first /health 200 (both
   clients connected before the clock starts), the wake's phases, then the first request
   after the wake (same prompt length, a prompt never seen: no prefix-cache hit).
2. raw (its own server, so vLLM's sleep never meets our backend on one engine): the same
   first-token requests, then per cycle POST /sleep?level=1, 1 s asleep, POST /wake_up,
   the controller's warm-up completion, then the first request.

`--serial-boot 1`: raw vLLM's server starts only after ours is done (slower, but the two
never boot at once). `--wait-pinned 1` (the default): before ours' first sleep, rank 0's
`hotswap_info` is polled until the host buffer is pinned; what it said (the pin's time,
`warm_prepare`) is kept as `engine_info`.

Prints tables and writes one JSON line to $OUT/sidecar.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.common import GB, UTIL, free_port, gpu_engine, logger, write_config
from controller.engines.enginespec import EngineSpec
from controller.engines.launcher import EngineProcess

T0 = time.monotonic()
log = logger("sidecar")

WARMUP = {"model": "llama", "prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 0}
ASLEEP_S = 1.0
_rng = random.Random(0)


def launch(spec: EngineSpec, name: str) -> EngineProcess:
    # Engine logs stay out of $OUT (a device run brings back only a few files); a failed
    # step prints their tails.
    proc = EngineProcess(spec, Path(tempfile.gettempdir()) / f"bench-sidecar-{name}.log")
    proc.start()
    log(f"started {name} pid {proc.pid}: {' '.join(spec.argv())}")
    return proc


def wait_up(proc: EngineProcess, deadline: float) -> float:
    """Seconds until its /health answers 200; raises when it exits or time runs out."""
    return proc.wait_ready(timeout_s=max(1.0, deadline - time.monotonic()))


REAL_EXT = "worker_ext.devext.RealWeightsExtension"


def start_vllm(
    model: str,
    port: int,
    util: float,
    graphs: bool,
    extension: str = "worker_ext.HotSwapExtension",
    codec: str | None = None,
) -> EngineProcess:
    # the bench's own worker settings (HOTSWAP_HOST_CODEC=none, ...) reach its engines; the
    # sidecar's (HOTSWAP_SECTION__KEY) do not; `codec` sets HOTSWAP_HOST_CODEC for this one
    env = {k: v for k, v in os.environ.items() if k.startswith("HOTSWAP_") and "__" not in k}
    if codec is not None:
        env["HOTSWAP_HOST_CODEC"] = codec
    spec = gpu_engine(
        model, port, "llama", util=util, dummy=True, eager=not graphs, env=env, extension=extension
    )
    return launch(spec, f"vllm-{port}")


def switch_variant(url: str, name: str) -> dict[str, Any]:
    """worker_ext/devext.py's hotswap_bench_variant, awake."""
    with httpx.Client(base_url=url, timeout=60.0) as c:
        r = c.post(
            "/collective_rpc", json={"method": "hotswap_bench_variant", "kwargs": {"name": name}}
        )
    r.raise_for_status()
    return dict(r.json())


def switch_codec(url: str, codec: str) -> dict[str, Any]:
    """The engine's host codec becomes `codec` (worker_ext/devext.py's RPC), awake."""
    with httpx.Client(base_url=url, timeout=120.0) as e:
        r = e.post(
            "/collective_rpc", json={"method": "hotswap_bench_codec", "kwargs": {"codec": codec}}
        )
        r.raise_for_status()
        res = (r.json().get("results") or [{}])[0]
    if not res.get("ok"):
        raise RuntimeError(f"switch codec: {res}")
    return {"codec": res.get("codec"), "elapsed_s": res.get("elapsed_s")}


def realistic(url: str, seed: int = 1) -> dict[str, Any]:
    """Redraw the engine's weights like a trained model's (worker_ext/devext.py's RPC;
    the dummy loader's uniform values code smaller than trained weights do)."""
    with httpx.Client(base_url=url, timeout=120.0) as e:
        r = e.post(
            "/collective_rpc",
            json={"method": "hotswap_bench_realistic_weights", "kwargs": {"seed": seed}},
        )
        r.raise_for_status()
        res = (r.json().get("results") or [{}])[0]
    if not res.get("ok"):
        raise RuntimeError(f"realistic weights: {res}")
    return {"filled_bytes": res.get("filled_bytes"), "elapsed_s": res.get("elapsed_s")}


def first_token(c: httpx.Client, n_tokens: int, model: str = "llama") -> float:
    """Seconds of one completion of a fresh `n_tokens`-token prompt, one token out."""
    prompt = [_rng.randrange(10, 30000) for _ in range(n_tokens)]
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
    t = time.monotonic()
    r = c.post("/v1/completions", json=body)
    s = time.monotonic() - t
    r.raise_for_status()
    return s


def phases_of(tr: dict[str, Any]) -> dict[str, float]:
    return {p["name"]: p["duration_s"] for p in tr.get("phases", [])}


def rank_detail(tr: dict[str, Any]) -> dict[str, Any]:
    """Rank 0's own timings per phase (elapsed, and the extension's `timings`)."""
    out: dict[str, Any] = {}
    for p in tr.get("phases", []):
        ranks = p.get("ranks") or []
        if ranks:
            r = ranks[0]
            out[p["name"]] = {"elapsed_s": r.get("elapsed_s"), "timings": r.get("timings")}
    return out


def timed_wake(base: str, post: Any) -> dict[str, Any]:
    """POST the wake on a connected client in a thread while /health is polled; seconds
    from the POST's send to its answer and to the first /health 200."""
    box: dict[str, Any] = {}
    sent = threading.Event()
    with (
        httpx.Client(base_url=base, timeout=300.0) as w,
        httpx.Client(base_url=base, timeout=5.0) as h,
    ):
        w.get("/livez")  # both connected before the clock starts
        h.get("/health")

        def wake() -> None:
            box["t_sent"] = time.monotonic()
            sent.set()
            resp = post(w)
            box["t_answer"] = time.monotonic()
            box["status"] = resp.status_code
            box["body"] = resp.json()

        th = threading.Thread(target=wake)
        th.start()
        sent.wait(10)
        t_health = None
        while time.monotonic() - box["t_sent"] < 120:
            if h.get("/health").status_code == 200:
                t_health = time.monotonic()
                break
            time.sleep(0.002)
        th.join(300)
    t0 = box["t_sent"]
    box["answer_s"] = box["t_answer"] - t0
    box["health_s"] = None if t_health is None else t_health - t0
    return box


def attached(url: str, port: int, fused: bool, fused_sleep: bool = True) -> EngineSpec:
    """`hotswap serve --config FILE` with one attached engine, `fused_wake` and
    `fused_sleep` as given."""
    cfg = Path(tempfile.mkdtemp(prefix="bench-sidecar-")) / "sidecar.yaml"
    model = {"name": "llama", "url": url, "fused_wake": fused, "fused_sleep": fused_sleep}
    cfg.write_text(yaml.safe_dump({"models": [model]}))
    argv = [sys.executable, "-m", "controller", "serve", "--config", str(cfg)]
    return EngineSpec.from_command("sidecar", argv, port, {})


def wait_pinned(url: str, until: float) -> dict[str, Any]:
    """Poll rank 0's hotswap_info (the engine's /collective_rpc) until its host buffer is
    pinned; what it said of that and of the prepare ahead of time, and the seconds waited."""
    t0 = time.monotonic()
    info: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=30.0) as e:
        while time.monotonic() < until:
            r = e.post("/collective_rpc", json={"method": "hotswap_info"})
            info = (r.json().get("results") or [{}])[0] if r.status_code == 200 else {}
            if (info.get("backend_detail") or {}).get("host_backup_state") != "pinning":
                break
            time.sleep(0.1)
    d = info.get("backend_detail") or {}
    return {
        "waited_s": time.monotonic() - t0,
        "host_backup_state": d.get("host_backup_state"),
        "host_backup_pin_s": d.get("host_backup_pin_s"),
        "host_backup_bytes": d.get("host_backup_bytes"),
        "warm_prepare": info.get("warm_prepare"),
    }


def ours(server: EngineProcess, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    side: EngineProcess | None = None
    res: dict[str, Any] = {"cycles": [], "sidecar_start_s": []}
    try:
        res["server_start_s"] = wait_up(server, deadline)
        log(f"vLLM healthy after {res['server_start_s']:.1f} s")
        if args.weights == "realistic":
            res["realistic"] = realistic(server.base_url)
            log("realistic weights", json.dumps(res["realistic"]))
        with httpx.Client(base_url=server.base_url, timeout=300.0) as e:
            e.post("/v1/completions", json=WARMUP).raise_for_status()
            res["ttft_never_slept_s"] = [first_token(e, args.ttft_tokens) for _ in range(3)]
            log("ttft never slept", res["ttft_never_slept_s"])
        time.sleep(max(0.0, 3.0 - (time.monotonic() - T0)))  # the host buffer pins early
        # One sidecar per --fused value, one after the other, attached to the same engine
        # (each finds it RUNNING and verified at its start).
        for fused, fsleep in [(f, s) for f in args.fused for s in args.fused_sleeps]:
            spec = attached(server.base_url, free_port(), fused, fsleep)
            side = launch(spec, f"sidecar-f{int(fused)}{int(fsleep)}")
            res["sidecar_start_s"].append(wait_up(side, deadline))
            log(
                f"sidecar (fused_wake {fused}, fused_sleep {fsleep}) ready after"
                f" {res['sidecar_start_s'][-1]:.1f} s"
            )
            if args.wait_pinned and "engine_info" not in res:
                res["engine_info"] = wait_pinned(server.base_url, time.monotonic() + 60)
                log("engine info before the first sleep", json.dumps(res["engine_info"]))
            n = len(res["cycles"])
            runs = [(c, v) for c in args.codec_list or [None] for v in args.variant_list]
            for j, (codec, variant) in enumerate(runs):
                try:  # a failed codec's run leaves the others' cycles in res
                    if codec is not None and j and codec != runs[j - 1][0]:
                        switched = switch_codec(server.base_url, codec)
                        res.setdefault("switched", []).append(switched)
                        log("codec switched", json.dumps(switched))
                    if variant is not None:
                        log("variant", json.dumps(switch_variant(server.base_url, variant)))
                    k = len(res["cycles"])
                    cycles(side, server, args, deadline, fused, res, codec)
                    for cyc in res["cycles"][k:]:
                        cyc["variant"] = variant
                except Exception as exc:
                    res.setdefault("errors", []).append(f"{codec}: {type(exc).__name__}: {exc}")
                    log("ours failed:", res["errors"][-1][-3000:])
                    break
            for cyc in res["cycles"][n:]:
                cyc["fused_sleep"] = fsleep
            side.stop(20.0)
            side = None
    finally:
        if side is not None:
            if res["cycles"] == []:
                log("sidecar log tail:\n" + side.log_tail())
            side.stop(20.0)
        if not res["cycles"]:
            log("vLLM log tail:\n" + server.log_tail())
        server.stop(20.0)
    return res


def cycles(
    side: EngineProcess,
    server: EngineProcess,
    args: argparse.Namespace,
    deadline: float,
    fused: bool,
    res: dict[str, Any],
    codec: str | None = None,
) -> None:
    base = side.base_url
    with (
        httpx.Client(base_url=base, timeout=300.0) as c,
        httpx.Client(base_url=server.base_url, timeout=300.0) as e,
    ):
        for i in range(args.cycles):
            if time.monotonic() > deadline - 20:
                log("out of time after", i, "cycles")
                break
            t = time.monotonic()
            r = c.post("/models/llama/sleep", json={"level": 1})
            sleep_s = time.monotonic() - t
            if r.status_code != 200:
                raise RuntimeError(f"sleep {r.status_code}: {r.text[:2000]}")
            sleep_tr = r.json().get("transition") or {}
            health_503 = c.get("/health").status_code
            asleep = args.asleep[i % len(args.asleep)]
            time.sleep(asleep)
            box = timed_wake(base, lambda w: w.post("/models/llama/wake"))
            body = box.get("body") or {}
            if box.get("status") != 200:
                raise RuntimeError(f"wake {box.get('status')}: {json.dumps(body)[:2000]}")
            ttft = first_token(e, args.ttft_tokens)
            ttft2 = first_token(e, args.ttft_tokens)
            tr = body.get("transition") or {}
            cyc = {
                "sleep_post_s": sleep_s,
                "sleep_transition_s": sleep_tr.get("duration_s"),
                "sleep_phases": phases_of(sleep_tr),
                "sleep_ranks": rank_detail(sleep_tr),
                "freed_bytes": next(
                    (
                        p["detail"].get("freed_bytes")
                        for p in sleep_tr.get("phases", [])
                        if "freed_bytes" in (p.get("detail") or {})
                    ),
                    None,
                ),
                "health_after_sleep": health_503,
                "wake_post_s": box["answer_s"],
                "post_to_health_200_s": box["health_s"],
                "wake_transition_s": tr.get("duration_s"),
                "wake_phases": phases_of(tr),
                "wake_ranks": rank_detail(tr),
                "ttft_after_wake_s": ttft,
                "ttft_second_s": ttft2,
                "fused": fused,
                "codec": codec,
                "asleep_s": asleep,
            }
            res["cycles"].append(cyc)
            log(f"ours cycle {i + 1} (fused_wake {fused})", json.dumps(cyc))


def raw(server: EngineProcess, args: argparse.Namespace, deadline: float) -> dict[str, Any]:
    res: dict[str, Any] = {"cycles": []}
    try:
        base = server.base_url
        res["server_start_s"] = wait_up(server, deadline)
        log(f"vLLM (raw) healthy after {res['server_start_s']:.1f} s")
        if args.weights == "realistic":
            res["realistic"] = realistic(base)
        with httpx.Client(base_url=base, timeout=300.0) as c:
            c.post("/v1/completions", json=WARMUP).raise_for_status()
            res["ttft_never_slept_s"] = [first_token(c, args.ttft_tokens) for _ in range(3)]
            for i in range(args.cycles):
                if time.monotonic() > deadline - 20:
                    log("out of time after", i, "raw cycles")
                    break
                t = time.monotonic()
                c.post("/sleep", params={"level": 1}).raise_for_status()
                sleep_s = time.monotonic() - t
                time.sleep(ASLEEP_S)
                t = time.monotonic()
                c.post("/wake_up").raise_for_status()
                wake_s = time.monotonic() - t
                t1 = time.monotonic()
                c.post("/v1/completions", json=WARMUP).raise_for_status()
                warm_s = time.monotonic() - t1
                total = time.monotonic() - t
                ttft = first_token(c, args.ttft_tokens)
                cyc = {
                    "sleep_s": sleep_s,
                    "wake_up_s": wake_s,
                    "warmup_s": warm_s,
                    "wake_plus_warmup_s": total,
                    "ttft_after_wake_s": ttft,
                }
                res["cycles"].append(cyc)
                log(f"raw cycle {i + 1}", json.dumps(cyc))
    finally:
        if not res["cycles"]:
            log("vLLM log tail:\n" + server.log_tail())
        server.stop(20.0)
    return res


PHASES = (
    "resume_weights",
    "resume_kv_cache",
    "restore_and_verify",
    "resume_and_verify",
    "resume_engine",
    "warmup",
)
SLEEP_PHASES = ("drain", "quiesce", "prepare", "suspend", "prepare_and_suspend")


def f3(v: Any) -> str:
    return f"{v:.3f}" if isinstance(v, int | float) else "-"


def f4(v: Any) -> str:
    return f"{v:.4f}" if isinstance(v, int | float) else "-"


def report(out: dict[str, Any]) -> None:
    runs = out.get("ours_by_codec") or {"": out.get("ours") or {}}
    for codec, run in runs.items():
        report_ours(out, run, f" HOTSWAP_HOST_CODEC={codec}" if codec else "")
    report_raw(out)


def report_ours(out: dict[str, Any], run: dict[str, Any], label: str) -> None:
    shape = out["shape"]
    bw = out.get("bandwidth") or {}
    cyc = run.get("cycles", [])
    weights = next((c["freed_bytes"].get("weights") for c in cyc if c.get("freed_bytes")), None)
    h2d = weights / bw["h2d_Bps"] if weights and bw else None
    d2h = weights / bw["d2h_Bps"] if weights and bw else None
    if weights:
        out["weights_bytes"], out["h2d_bound_s"], out["d2h_bound_s"] = weights, h2d, d2h
    if weights and bw:
        print(
            f"\n{shape}{label}: weights {weights / GB:.2f} GB; pinned H2D"
            f" {bw['h2d_Bps'] / GB:.1f} GB/s, D2H {bw['d2h_Bps'] / GB:.1f} GB/s; H2D bound"
            f" {h2d:.3f} s, D2H bound {d2h:.3f} s; graphs {out['graphs']};"
            f" weights {out.get('weights')}"
        )

    def x(v: Any, b: Any) -> str:
        return f"{v / b:.2f}x" if isinstance(v, int | float) and b else "-"

    print(
        f"\n| {shape}{label}: wake through the sidecar | fused | POST -> answer"
        f" | POST -> /health 200 | x H2D | {' | '.join(PHASES)} | first token after | 2nd |"
    )
    print("|---" * (7 + len(PHASES)) + "|")
    for i, c in enumerate(cyc):
        ph = " | ".join(f4(c["wake_phases"].get(p)) for p in PHASES)
        h = c["post_to_health_200_s"]
        print(
            f"| cycle {i + 1} ({c.get('asleep_s', ASLEEP_S):g} s asleep)"
            f" | {int(c.get('fused', False))} | {f3(c['wake_post_s'])} | {f3(h)}"
            f" | {x(h, h2d)} | {ph} | {f4(c['ttft_after_wake_s'])} | {f4(c['ttft_second_s'])} |"
        )
    for i, c in enumerate(cyc):  # the ranks' own figures: the copies' GPU time, by phase
        ranks = {
            name: {
                "elapsed_s": r.get("elapsed_s"),
                **{
                    k: v
                    for k, v in (r.get("timings") or {}).items()
                    if k in ("copies_gpu_s", "wait_copies_s", "weights_s", "kv_cache_s")
                },
            }
            for name, r in (c.get("wake_ranks") or {}).items()
        }
        print(f"cycle {i + 1} ranks: {json.dumps(ranks)}")
    print(
        f"\n| {shape}{label}: sleep through the sidecar | POST | transition | x D2H"
        f" | {' | '.join(SLEEP_PHASES)} |"
    )
    print("|---" * (4 + len(SLEEP_PHASES)) + "|")
    for i, c in enumerate(cyc):
        ph = " | ".join(f4(c["sleep_phases"].get(p)) for p in SLEEP_PHASES)
        t = c["sleep_transition_s"]
        print(f"| cycle {i + 1} | {f3(c['sleep_post_s'])} | {f3(t)} | {x(t, d2h)} | {ph} |")
    for i, c in enumerate(cyc):  # the rank's own sleep: where its prepare ends, by step
        ranks = {
            name: {
                "elapsed_s": r.get("elapsed_s"),
                **{k: v for k, v in (r.get("timings") or {}).items() if k in SLEEP_RANK_KEYS},
            }
            for name, r in (c.get("sleep_ranks") or {}).items()
        }
        print(f"cycle {i + 1} ({c.get('variant')}) sleep ranks: {json.dumps(ranks)}")
    print(f"\nours{label}: first token, never slept: {run.get('ttft_never_slept_s')}")
    print(f"ours{label}: engine before the first sleep: {run.get('engine_info')}")


# The rank's sleep timings printed per cycle (all of them are in sidecar.jsonl).
SLEEP_RANK_KEYS = (
    "sleep_s",
    "records_s",
    "audit_s",
    "protect_plan_s",
    "queue_s",
    "kv_early_s",
    "at_queued_first_s",
    "at_kv_early_s",
    "kv_early_bytes",
    "at_prepared_s",
    "at_discarded_s",
    "at_released_s",
    "at_link_done_s",
    "link_s",
    "copy_unmap_s",
    "trim_s",
    "host_trim_s",
    "answer_s",
    "copy_wait_s",
    "snap_copied_s",
    "snap_plan_s",
    "snap_baseline_s",
    "snap_check_reused",
    "snap_sync_s",
    "kv_thread",
    "kv_join_wait_s",
    "discard_join_wait_s",
    "free_later_wait_s",
    "free_later_close_s",
    "prepare_under_copies_s",
    "discard_s",
)


def report_raw(out: dict[str, Any]) -> None:
    shape = out["shape"]
    h2d, d2h = out.get("h2d_bound_s"), out.get("d2h_bound_s")

    def x(v: Any, b: Any) -> str:
        return f"{v / b:.2f}x" if isinstance(v, int | float) and b else "-"

    rc = (out.get("raw") or {}).get("cycles", [])
    print(
        f"\n| {shape}: raw vLLM over HTTP | POST /sleep?level=1 | x D2H | POST /wake_up"
        " | warm-up | wake + warm-up | x H2D | first token after |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for i, c in enumerate(rc):
        print(
            f"| cycle {i + 1} | {f3(c['sleep_s'])} | {x(c['sleep_s'], d2h)} | {f3(c['wake_up_s'])}"
            f" | {f4(c['warmup_s'])} | {f3(c['wake_plus_warmup_s'])}"
            f" | {x(c['wake_plus_warmup_s'], h2d)} | {f4(c['ttft_after_wake_s'])} |"
        )
    print(f"raw: first token, never slept: {(out.get('raw') or {}).get('ttft_never_slept_s')}")
    print(flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--cycles", type=int, default=3)
    ap.add_argument("--graphs", type=int, default=1, help="1: compile + CUDA graphs; 0: eager")
    ap.add_argument("--ttft-tokens", type=int, default=1000)
    ap.add_argument("--raw", type=int, default=1, help="0: skip raw vLLM")
    ap.add_argument("--util", type=float, default=None, help="GPU share of each server")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument(
        "--fused", default="1", help="fused_wake per sidecar run, comma-separated (e.g. 0,1)"
    )
    ap.add_argument(
        "--fused-sleeps",
        default="1",
        help="fused_sleep per sidecar run (each --fused value with each), comma-separated",
    )
    ap.add_argument(
        "--serial-boot",
        type=int,
        default=0,
        help="1: raw vLLM's server starts after ours is done (15:16 UTC: booted at once, "
        "ours' 8B engine failed its engine-core start)",
    )
    ap.add_argument(
        "--wait-pinned",
        type=int,
        default=1,
        help="1: before the first sleep, wait (up to 60 s) until the engine's host buffer is "
        "pinned (hotswap_info), so the first sleep's prepare is not measured beside the pinning",
    )
    ap.add_argument(
        "--asleep-s",
        default=str(ASLEEP_S),
        help="seconds asleep before each wake of ours, comma-separated, taken in turn by the"
        " cycles (e.g. 1,0,2: the driver scrubs released memory for a while after a sleep)",
    )
    ap.add_argument(
        "--weights",
        choices=("realistic", "dummy"),
        default="realistic",
        help="realistic: every engine's weights redrawn like a trained model's once it is up"
        " (worker_ext/devext.py's RPC; the host codec's ratio depends on them); dummy: vLLM's",
    )
    ap.add_argument(
        "--codecs",
        default="",
        help="HOTSWAP_HOST_CODEC per run of ours' cycles, comma-separated (e.g. exp,none): one"
        " engine, the codec switched while awake (worker_ext/devext.py; needs --weights"
        " realistic's extension); empty: the environment's setting",
    )
    ap.add_argument(
        "--variants",
        default="",
        help="worker_ext/devext.py's hotswap_bench_variant per run of ours' cycles (each"
        " codec with each), comma-separated (e.g. storagepass,base: before/after on one engine);"
        " empty: none set",
    )
    args = ap.parse_args()
    args.variant_list = [v.strip() for v in args.variants.split(",") if v.strip()] or [None]
    args.graphs = bool(args.graphs)
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    args.asleep = [float(x) for x in args.asleep_s.split(",") if x.strip()] or [ASLEEP_S]
    args.fused = [f.strip() not in ("0", "false") for f in args.fused.split(",") if f.strip()]
    args.fused_sleeps = [
        f.strip() not in ("0", "false") for f in args.fused_sleeps.split(",") if f.strip()
    ]
    args.serial_boot, args.wait_pinned = bool(args.serial_boot), bool(args.wait_pinned)
    deadline = T0 + args.budget_s
    from benchmarks.wake import bandwidth

    out: dict[str, Any] = {
        "shape": args.shape,
        "graphs": args.graphs,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cmd": " ".join(sys.argv),
        "bandwidth": bandwidth(),
        "weights": args.weights,
    }
    # the bench's RPCs (redraw the weights, switch the codec) live in worker_ext/devext.py
    ext = REAL_EXT if args.weights == "realistic" or codecs else "worker_ext.HotSwapExtension"
    model = write_config(args.shape, tempfile.mkdtemp(prefix=f"{args.shape}-"))
    rc = 0
    # Both servers boot at once (each takes the shape's share of the GPU); each is measured
    # while the other idles, and raw vLLM's sleep never meets our backend on one engine.
    util = args.util if args.util is not None else UTIL[args.shape]
    out["util"] = util
    args.codec_list = codecs
    # one engine for every codec (HOTSWAP_HOST_CODEC switched between them while awake)
    ours_server = start_vllm(model, free_port(), util, args.graphs, ext, (codecs or [None])[0])
    raw_server = None
    if args.raw and not args.serial_boot:
        raw_server = start_vllm(model, free_port(), util, args.graphs, ext)
    try:
        try:
            out["ours"] = ours(ours_server, args, deadline)
        except Exception as exc:
            out["ours_error"] = f"{type(exc).__name__}: {exc}"
            log("ours failed:", out["ours_error"][-3000:])
            rc = 1
        if codecs and out.get("ours"):
            got = out["ours"]
            out["ours_by_codec"] = {
                c: {**got, "cycles": [cy for cy in got["cycles"] if cy.get("codec") == c]}
                for c in codecs
            }
        if args.raw and args.serial_boot:  # ours has stopped: raw boots alone
            raw_server = start_vllm(model, free_port(), util, args.graphs, ext)
        if raw_server is not None:
            try:
                out["raw"] = raw(raw_server, args, deadline)
            except Exception as exc:
                out["raw_error"] = f"{type(exc).__name__}: {exc}"
                log("raw failed:", out["raw_error"][-3000:])
                rc = 1
    finally:
        ours_server.stop(20.0)
        if raw_server is not None:
            raw_server.stop(20.0)
    try:
        report(out)
    except Exception as exc:  # the JSON line is still written
        log("report failed:", f"{type(exc).__name__}: {exc}")
        rc = 1
    with open(os.path.join(os.environ.get("OUT", "."), "sidecar.jsonl"), "a") as f:
        f.write(json.dumps(out, default=str) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
