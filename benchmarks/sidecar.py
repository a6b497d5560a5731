"""Whole level-1 wake through the sidecar on one GPU, next to vLLM's own wake + warm-up.

    python3 -m benchmarks.sidecar [--shape llama3-8b] [--cycles 2] [--budget-s 420]

Runs on the lent device after the vLLM bundle, with the sidecar's
extra wheels on PYTHONPATH. Two vLLM 0.26 HTTP servers, one after the other, same flags
(Llama-3-8B shape config, dummy bf16 weights, eager, max_model_len 2048, util 0.45,
--skip-tokenizer-init, sleep mode, the worker extension, VLLM_SERVER_DEV_MODE=1, 127.0.0.1,
own process group):

1. ours: `python -m controller serve --engine llama=URL`; per cycle POST
   /models/llama/sleep {"level": 1}, then POST /models/llama/wake while /health is polled
   every 5 ms: wall time POST -> first /health 200 and the wake's phase breakdown (resume,
   restore+verify, /resume, 1-token warm-up) from the response.
2. raw (a fresh server, so vLLM's sleep never meets our backend on one engine): per cycle
   POST /sleep?level=1, POST /wake_up, then the controller's warm-up completion, timed.

Prints two tables and writes one JSON line to $OUT/sidecar.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import UTIL, free_port, gpu_engine, logger, sidecar, write_config
from controller.enginespec import EngineSpec
from controller.launcher import EngineProcess

T0 = time.monotonic()
log = logger("sidecar")

WARMUP = {"model": "llama", "prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 0}


def launch(spec: EngineSpec, name: str) -> EngineProcess:
    proc = EngineProcess(spec, Path(tempfile.gettempdir()) / f"bench-sidecar-{name}.log")
    proc.start()
    log(f"started {name} pid {proc.pid}: {' '.join(spec.argv())}")
    return proc


def wait_up(proc: EngineProcess, deadline: float) -> float:
    """Seconds until its /health answers 200; raises when it exits or time runs out."""
    return proc.wait_ready(timeout_s=max(1.0, deadline - time.monotonic()))


def start_vllm(model: str, port: int, shape: str) -> EngineProcess:
    spec = gpu_engine(model, port, "llama", util=UTIL[shape], dummy=True)
    return launch(spec, f"vllm-{port}")


def ours(model: str, shape: str, cycles: int, deadline: float) -> dict[str, Any]:
    port, cport = free_port(), free_port()
    server = start_vllm(model, port, shape)
    side: EngineProcess | None = None
    res: dict[str, Any] = {"cycles": []}
    try:
        res["server_start_s"] = wait_up(server, deadline)
        log(f"vLLM healthy after {res['server_start_s']:.1f} s")
        side = launch(sidecar([("llama", server.base_url)], cport), "sidecar")
        base = side.base_url
        res["sidecar_start_s"] = wait_up(side, deadline)
        log(f"sidecar ready after {res['sidecar_start_s']:.1f} s")
        with httpx.Client(base_url=base, timeout=300.0) as c:
            time.sleep(3.0)  # the extension pins its host buffer in the background
            info = c.get("/models/llama").json()
            log("model", info.get("state"), info.get("ready"))
            for i in range(cycles):
                t = time.monotonic()
                r = c.post("/models/llama/sleep", json={"level": 1})
                sleep_s = time.monotonic() - t
                if r.status_code != 200:
                    raise RuntimeError(f"sleep {r.status_code}: {r.text[:2000]}")
                health_503 = c.get("/health").status_code
                box: dict[str, Any] = {}

                def wake(box: dict[str, Any] = box) -> None:
                    with httpx.Client(base_url=base, timeout=300.0) as w:
                        t1 = time.monotonic()
                        resp = w.post("/models/llama/wake")
                        box["answer_s"] = time.monotonic() - t1
                        box["status"] = resp.status_code
                        box["body"] = resp.json()

                th = threading.Thread(target=wake)
                health_s = None
                # the poll client exists and has connected before the clock starts (measured:
                # up to 1 s for a new client's first request on a busy 2-core machine)
                with httpx.Client(base_url=base, timeout=5.0) as h:
                    h.get("/health")  # its first request sets the connection up: not timed
                    t = time.monotonic()
                    th.start()
                    while time.monotonic() - t < 120:
                        if h.get("/health").status_code == 200:
                            health_s = time.monotonic() - t
                            break
                        time.sleep(0.005)
                th.join(300)
                body = box.get("body") or {}
                if box.get("status") != 200:
                    raise RuntimeError(f"wake {box.get('status')}: {json.dumps(body)[:2000]}")
                tr = body.get("transition") or {}
                phases = {p["name"]: p["duration_s"] for p in tr.get("phases", [])}
                sleep_tr = r.json().get("transition") or {}
                cyc = {
                    "sleep_post_s": sleep_s,
                    "sleep_phases": {
                        p["name"]: p["duration_s"] for p in sleep_tr.get("phases", [])
                    },
                    "health_after_sleep": health_503,
                    "wake_post_s": box["answer_s"],
                    "post_to_health_200_s": health_s,
                    "wake_transition_s": tr.get("duration_s"),
                    "wake_phases": phases,
                    "verify_ranks": [
                        {k: p2.get(k) for k in ("verified", "mismatched", "elapsed_s")}
                        for p in tr.get("phases", [])
                        if p["name"] == "restore_and_verify"
                        for p2 in (p.get("ranks") or [])
                    ],
                }
                res["cycles"].append(cyc)
                log(f"ours cycle {i + 1}", json.dumps(cyc))
    finally:
        if side is not None:
            if res["cycles"] == []:
                log("sidecar log tail:\n" + side.log_tail())
            side.stop(20.0)
        if not res["cycles"]:
            log("vLLM log tail:\n" + server.log_tail())
        server.stop(20.0)
    return res


def raw(model: str, shape: str, cycles: int, deadline: float) -> dict[str, Any]:
    port = free_port()
    server = start_vllm(model, port, shape)
    res: dict[str, Any] = {"cycles": []}
    try:
        base = server.base_url
        res["server_start_s"] = wait_up(server, deadline)
        log(f"vLLM (raw) healthy after {res['server_start_s']:.1f} s")
        with httpx.Client(base_url=base, timeout=300.0) as c:
            c.post("/v1/completions", json=WARMUP).raise_for_status()
            for i in range(cycles):
                t = time.monotonic()
                c.post("/sleep", params={"level": 1}).raise_for_status()
                sleep_s = time.monotonic() - t
                t = time.monotonic()
                c.post("/wake_up").raise_for_status()
                wake_s = time.monotonic() - t
                t1 = time.monotonic()
                r = c.post("/v1/completions", json=WARMUP)
                r.raise_for_status()
                warm_s = time.monotonic() - t1
                cyc = {
                    "sleep_s": sleep_s,
                    "wake_up_s": wake_s,
                    "warmup_s": warm_s,
                    "wake_plus_warmup_s": time.monotonic() - t,
                }
                res["cycles"].append(cyc)
                log(f"raw cycle {i + 1}", json.dumps(cyc))
    finally:
        if not res["cycles"]:
            log("vLLM log tail:\n" + server.log_tail())
        server.stop(20.0)
    return res


PHASES = ("resume_weights", "resume_kv_cache", "restore_and_verify", "resume_engine", "warmup")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=420.0)
    args = ap.parse_args()
    deadline = T0 + args.budget_s
    model = write_config(args.shape, tempfile.mkdtemp(prefix=f"{args.shape}-"))
    out: dict[str, Any] = {"shape": args.shape, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    rc = 0
    try:
        out["ours"] = ours(model, args.shape, args.cycles, deadline)
    except Exception as exc:
        out["ours_error"] = f"{type(exc).__name__}: {exc}"
        log("ours failed:", out["ours_error"][-3000:])
        rc = 1
    try:
        out["raw"] = raw(model, args.shape, args.cycles, deadline)
    except Exception as exc:
        out["raw_error"] = f"{type(exc).__name__}: {exc}"
        log("raw failed:", out["raw_error"][-3000:])
        rc = 1
    cols = " | ".join(PHASES)
    print(
        f"\n| {args.shape}: through the sidecar | sleep POST | wake POST | POST -> /health 200"
        f" | {cols} |"
    )
    print("|---" * (4 + len(PHASES)) + "|")
    for i, c in enumerate((out.get("ours") or {}).get("cycles", [])):
        ph = " | ".join(f"{c['wake_phases'].get(p, float('nan')):.4f} s" for p in PHASES)
        h = c["post_to_health_200_s"]
        print(
            f"| cycle {i + 1} | {c['sleep_post_s']:.3f} s | {c['wake_post_s']:.3f} s"
            f" | {h:.3f} s | {ph} |"
            if h is not None
            else f"| cycle {i + 1} | {c['sleep_post_s']:.3f} s | {c['wake_post_s']:.3f} s"
            f" | never | {ph} |"
        )
    print(
        f"\n| {args.shape}: raw vLLM over HTTP | POST /sleep?level=1 | POST /wake_up"
        " | warm-up completion | wake + warm-up |"
    )
    print("|---|---|---|---|---|")
    for i, c in enumerate((out.get("raw") or {}).get("cycles", [])):
        print(
            f"| cycle {i + 1} | {c['sleep_s']:.3f} s | {c['wake_up_s']:.3f} s"
            f" | {c['warmup_s']:.4f} s | {c['wake_plus_warmup_s']:.3f} s |"
        )
    print(flush=True)
    with open(os.path.join(os.environ.get("OUT", "."), "sidecar.jsonl"), "a") as f:
        f.write(json.dumps(out, default=str) + "\n")
    return rc


if __name__ == "__main__":
    sys.exit(main())
