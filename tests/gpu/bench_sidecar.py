"""Whole level-1 wake through the sidecar on one GPU, next to vLLM's own wake + warm-up.

    python tests/gpu/bench_sidecar.py [--shape llama3-8b] [--cycles 2] [--budget-s 420]

Not a pytest module. Runs on the lent device after the vLLM bundle, with the sidecar's
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
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import httpx  # noqa: E402

from tests.gpu.bench_wake import UTIL, write_config  # noqa: E402

WARMUP = {"model": "llama", "prompt": [1, 2, 3, 4], "max_tokens": 1, "temperature": 0}
T0 = time.monotonic()


def log(*a: Any) -> None:
    print(f"[sidecar {time.monotonic() - T0:6.1f}s]", *a, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def env_with_root(extra: dict[str, str]) -> dict[str, str]:
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != ROOT]
    env["PYTHONPATH"] = os.pathsep.join([ROOT, *paths])
    env.update(extra)
    return env


class Proc:
    """A child in its own process group, its output in a log file; ended by group."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        self.name = name
        self.log_path = os.path.join(tempfile.gettempdir(), f"bench-sidecar-{name}.log")
        self._log = open(self.log_path, "w")  # noqa: SIM115 (closed in stop)
        self.p = subprocess.Popen(
            argv, env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log(f"started {name} pid {self.p.pid}: {' '.join(argv)}")

    def tail(self, n: int = 40) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-n:])

    def stop(self, grace_s: float = 20.0) -> None:
        if self.p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(grace_s)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
        self._log.close()
        log(f"stopped {self.name} rc={self.p.returncode}")


def wait_ok(url: str, proc: Proc, deadline: float) -> float:
    """Seconds until GET url answers 200; raises when the process dies or time runs out."""
    t = time.monotonic()
    with httpx.Client(timeout=5.0) as c:
        while time.monotonic() < deadline:
            if proc.p.poll() is not None:
                raise RuntimeError(f"{proc.name} exited rc={proc.p.returncode}:\n{proc.tail()}")
            try:
                if c.get(url).status_code == 200:
                    return time.monotonic() - t
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
    raise RuntimeError(f"{url} not 200 in time:\n{proc.tail()}")


def start_vllm(model: str, port: int, shape: str) -> Proc:
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        "llama",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--enable-sleep-mode",
        "--worker-extension-cls",
        "worker_ext.HotSwapExtension",
        "--load-format",
        "dummy",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--gpu-memory-utilization",
        str(UTIL[shape]),
        "--skip-tokenizer-init",
        "--dtype",
        "bfloat16",
        "--seed",
        "0",
        "--max-num-seqs",
        "8",
    ]
    return Proc(f"vllm-{port}", argv, env_with_root({"VLLM_SERVER_DEV_MODE": "1"}))


def ours(model: str, shape: str, cycles: int, deadline: float) -> dict[str, Any]:
    port, cport = free_port(), free_port()
    server = start_vllm(model, port, shape)
    sidecar: Proc | None = None
    res: dict[str, Any] = {"cycles": []}
    try:
        res["server_start_s"] = wait_ok(f"http://127.0.0.1:{port}/health", server, deadline)
        log(f"vLLM healthy after {res['server_start_s']:.1f} s")
        argv = [sys.executable, "-m", "controller", "serve", "--engine"]
        argv += [f"llama=http://127.0.0.1:{port}", "--port", str(cport)]
        sidecar = Proc("sidecar", argv, env_with_root({}))
        base = f"http://127.0.0.1:{cport}"
        res["sidecar_start_s"] = wait_ok(f"{base}/health", sidecar, deadline)
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
        if sidecar is not None:
            if res["cycles"] == []:
                log("sidecar log tail:\n" + sidecar.tail())
            sidecar.stop()
        if not res["cycles"]:
            log("vLLM log tail:\n" + server.tail())
        server.stop()
    return res


def raw(model: str, shape: str, cycles: int, deadline: float) -> dict[str, Any]:
    port = free_port()
    server = start_vllm(model, port, shape)
    res: dict[str, Any] = {"cycles": []}
    try:
        base = f"http://127.0.0.1:{port}"
        res["server_start_s"] = wait_ok(f"{base}/health", server, deadline)
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
            log("vLLM log tail:\n" + server.tail())
        server.stop()
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
