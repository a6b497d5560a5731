"""Swaps on one GPU through the gateway: two models, memory for one awake, managed mode.

    python3 -m benchmarks.swap [--shape llama3-8b] [--util 0.85] [--swaps 21]
                               [--standalone 2] [--prompt-tokens 1000] [--graphs 1]

Runs on the lent device after the vLLM bundle, with the sidecar's extra wheels on
PYTHONPATH. `python -m controller serve --config FILE`: the sidecar starts both engines
itself (managed mode, device "0", the shape's config, dummy bf16 weights, max_model_len
2048, `--util` of the GPU each, so only one fits awake; `--graphs 1`: vLLM's default
compile and CUDA-graph capture), `swap.max_awake: 1`, `min_awake_s: 0`, the byte budget
measured by the supervisor with both asleep, the gateway in front.

1. the boot sleeps (each engine's first sleep, after its start) from GET /models;
2. `--standalone` cycles of POST /models/X/wake then POST /models/X/sleep for each model,
   nothing else moving: a wake and a sleep alone;
3. `--swaps` requests through the gateway, each naming the model that is asleep (a swap:
   the awake one is evicted), each a fresh `--prompt-tokens`-token prompt and one token
   out: swap time = the request's time (it arrives -> its first token); then a second fresh
   request to the same model (a warm model's first token). After each, both models'
   transitions (phases, start, end) from GET /models/NAME.

Target (issue 16): swap <= 1.2 x max(sleep A, wake B) + B's first token, against the
standalone sleep and wake of step 2. Prints tables, writes one JSON line to $OUT/swap.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from benchmarks.common import free_port, gpu_engine, logger, write_config
from controller.enginespec import EngineSpec
from controller.launcher import EngineProcess

T0 = time.monotonic()
log = logger("swap")
NAMES = ("a", "b")
_rng = random.Random(1)


def engine_argv(model: str, name: str, util: float, graphs: bool) -> list[str]:
    """The engine's argv for the models file: the bench's GPU flags, no address (the
    sidecar adds its own --uds)."""
    spec = gpu_engine(model, 1, name, util=util, dummy=True, eager=not graphs)
    argv = spec.argv()
    out: list[str] = []
    skip = 0
    for i, a in enumerate(argv):
        if skip:
            skip -= 1
            continue
        if a in ("--host", "--port") and i + 1 < len(argv):
            skip = 1
            continue
        out.append(a)
    return out


def config(model: str, args: argparse.Namespace, cport: int, gport: int, out: Path) -> Path:
    cfg = {
        "server": {"host": "127.0.0.1", "port": cport},
        "gateway": {
            "enabled": True,
            "host": "127.0.0.1",
            "port": gport,
            "hold_timeout_s": 120.0,
            "queue_size": 8,
            "request_timeout_s": 120.0,
        },
        "swap": {"max_awake": 1, "min_awake_s": 0.0},
        "supervisor": {"boot_timeout_s": 400.0, "log_dir": str(out / "engine-logs")},
        # (out: a temporary folder; a device run brings back only a few files from $OUT)
        "models": [
            {
                "name": n,
                "command": engine_argv(model, n, args.util, args.graphs),
                "gate": "swappable",
                "device": "0",
                "served_model_name": n,
            }
            for n in NAMES
        ],
    }
    path = out / "swap-config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def prompt(n: int) -> list[int]:
    return [_rng.randrange(10, 30000) for _ in range(n)]


def complete(c: httpx.Client, name: str, n_tokens: int) -> float:
    body = {"model": name, "prompt": prompt(n_tokens), "max_tokens": 1, "temperature": 0}
    t = time.monotonic()
    r = c.post("/v1/completions", json=body)
    s = time.monotonic() - t
    if r.status_code != 200:
        raise RuntimeError(f"{name}: {r.status_code} {r.text[:1000]}")
    return s


def transition(c: httpx.Client, name: str) -> dict[str, Any]:
    tr = c.get(f"/models/{name}").json().get("last_transition") or {}
    return {
        "kind": tr.get("kind"),
        "result": tr.get("result"),
        "started_at": tr.get("started_at"),
        "ended_at": tr.get("ended_at"),
        "duration_s": tr.get("duration_s"),
        "phases": {p["name"]: p["duration_s"] for p in tr.get("phases", [])},
        "ranks": {
            p["name"]: {
                "elapsed_s": (p.get("ranks") or [{}])[0].get("elapsed_s"),
                "timings": (p.get("ranks") or [{}])[0].get("timings"),
            }
            for p in tr.get("phases", [])
            if p.get("ranks")
        },
    }


def wait_booted(c: httpx.Client, deadline: float) -> dict[str, Any]:
    while time.monotonic() < deadline:
        models = c.get("/models").json()
        rows = models.get("models", models) if isinstance(models, dict) else models
        states = {
            m["name"]: m["state"] for m in (rows if isinstance(rows, list) else rows.values())
        }
        if all(states.get(n) in ("SUSPENDED", "RUNNING") for n in NAMES):
            return models  # type: ignore[no-any-return]
        if any(states.get(n) == "FAILED" for n in NAMES):
            raise RuntimeError(f"an engine failed to boot: {json.dumps(models)[:3000]}")
        time.sleep(0.5)
    raise TimeoutError("the engines did not boot in time")


def pct(xs: list[float], p: int) -> float:
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[p - 1]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument("--util", type=float, default=0.85)
    ap.add_argument("--swaps", type=int, default=21)
    ap.add_argument("--standalone", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--graphs", type=int, default=1)
    ap.add_argument("--budget-s", type=float, default=240.0)
    args = ap.parse_args()
    args.graphs = bool(args.graphs)
    deadline = T0 + args.budget_s
    out_dir = Path(os.environ.get("OUT", tempfile.gettempdir()))
    work = Path(tempfile.mkdtemp(prefix="bench-swap-"))  # config and logs: not in $OUT
    model = write_config(args.shape, tempfile.mkdtemp(prefix=f"{args.shape}-"))
    cport, gport = free_port(), free_port()
    cfg = config(model, args, cport, gport, work)
    res: dict[str, Any] = {
        "shape": args.shape,
        "util": args.util,
        "graphs": args.graphs,
        "mode": "managed",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cmd": " ".join(sys.argv),
        "config": yaml.safe_load(cfg.read_text()),
    }
    argv = [sys.executable, "-m", "controller", "serve", "--config", str(cfg)]
    spec = EngineSpec.from_command("sidecar", argv, cport, {"HOTSWAP_LOG__LEVEL": "INFO"})
    side = EngineProcess(spec, work / "swap-sidecar.log")
    side.start()
    rc = 0
    try:
        side.wait_ready(timeout_s=max(1.0, deadline - time.monotonic()))
        ctl = httpx.Client(base_url=f"http://127.0.0.1:{cport}", timeout=120.0)
        gw = httpx.Client(base_url=f"http://127.0.0.1:{gport}", timeout=180.0)
        res["models_after_boot"] = wait_booted(ctl, deadline)
        log(f"both engines booted after {time.monotonic() - T0:.1f} s")
        res["boot_sleeps"] = {n: transition(ctl, n) for n in NAMES}
        standalone: list[dict[str, Any]] = []
        for i in range(args.standalone):
            for n in NAMES:
                r = ctl.post(f"/models/{n}/wake")
                if r.status_code != 200:
                    raise RuntimeError(f"wake {n}: {r.status_code} {r.text[:2000]}")
                wake = transition(ctl, n)
                warm = complete(gw, n, args.prompt_tokens)
                r = ctl.post(f"/models/{n}/sleep", json={"level": 1})
                if r.status_code != 200:
                    raise RuntimeError(f"sleep {n}: {r.status_code} {r.text[:2000]}")
                standalone.append(
                    {"model": n, "wake": wake, "sleep": transition(ctl, n), "first_token_s": warm}
                )
                log(
                    f"standalone {n} #{i + 1}: wake {wake['duration_s']:.3f} s, sleep"
                    f" {standalone[-1]['sleep']['duration_s']:.3f} s, first token {warm:.4f} s"
                )
        res["standalone"] = standalone
        swaps: list[dict[str, Any]] = []
        complete(gw, NAMES[0], args.prompt_tokens)  # a awake, b asleep: the first swap is b's
        res["warm_a_s"] = complete(gw, NAMES[0], args.prompt_tokens)
        for i in range(args.swaps):
            if time.monotonic() > deadline - 15:
                log(f"out of time after {i} swaps")
                break
            name = NAMES[(i + 1) % 2]
            other = NAMES[i % 2]
            swap_s = complete(gw, name, args.prompt_tokens)
            warm_s = complete(gw, name, args.prompt_tokens)
            row = {
                "model": name,
                "evicted": other,
                "swap_s": swap_s,
                "warm_first_token_s": warm_s,
                "wake": transition(ctl, name),
                "sleep": transition(ctl, other),
            }
            w, s = row["wake"], row["sleep"]
            row["overlapped"] = "wait_room" in w["phases"]
            if w["started_at"] and s["ended_at"]:
                row["wake_started_before_sleep_ended_s"] = s["ended_at"] - w["started_at"]
            swaps.append(row)
            log(
                f"swap {i + 1} -> {name}: {swap_s:.3f} s (sleep {s['duration_s']:.3f}, wake"
                f" {w['duration_s']:.3f}, wait_room {w['phases'].get('wait_room', 0):.3f},"
                f" overlapped {row['overlapped']}), warm first token {warm_s:.4f} s"
            )
        res["swaps"] = swaps
        res["models_end"] = ctl.get("/models").json()
        metrics = ctl.get("/metrics").text
        res["metrics_swap"] = [ln for ln in metrics.splitlines() if "hotswap_swap" in ln][:40]
    except Exception as exc:
        res["error"] = f"{type(exc).__name__}: {exc}"
        log("failed:", res["error"][-3000:])
        log("sidecar log tail:\n" + side.log_tail())
        for n in NAMES:
            engine_log = work / "engine-logs" / f"{n}.log"
            if engine_log.exists():
                log(f"engine {n} log tail:\n" + engine_log.read_text()[-3000:])
        rc = 1
    finally:
        side.stop(30.0)
    try:
        report(res)
    except Exception as exc:
        log("report failed:", f"{type(exc).__name__}: {exc}")
        rc = 1
    with open(out_dir / "swap.jsonl", "a") as f:
        f.write(json.dumps(res, default=str) + "\n")
    return rc


def report(res: dict[str, Any]) -> None:
    st = res.get("standalone") or []
    wakes = [r["wake"]["duration_s"] for r in st]
    sleeps = [r["sleep"]["duration_s"] for r in st]
    firsts = [r["first_token_s"] for r in st]
    boot = res.get("boot_sleeps") or {}
    print(f"\n{res['shape']} x2, util {res['util']} each, graphs {res['graphs']}, managed")
    for n, tr in boot.items():
        print(f"boot (first) sleep of {n}: {tr.get('duration_s')} s, phases {tr.get('phases')}")
    if not (wakes and sleeps):
        return
    sw, ss = statistics.median(wakes), statistics.median(sleeps)
    print(
        f"standalone: wake {min(wakes):.3f}-{max(wakes):.3f} s (median {sw:.3f}),"
        f" sleep {min(sleeps):.3f}-{max(sleeps):.3f} s (median {ss:.3f}),"
        f" first token after a wake {min(firsts):.4f}-{max(firsts):.4f} s"
    )
    swaps = res.get("swaps") or []
    if not swaps:
        return
    times = [r["swap_s"] for r in swaps]
    warm = statistics.median(r["warm_first_token_s"] for r in swaps)
    target = 1.2 * max(sw, ss) + warm
    print(
        "\n| swap | to | swap (request -> first token) | evicted's sleep | wake | of which"
        " wait_room | overlapped | warm first token |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(swaps):
        print(
            f"| {i + 1} | {r['model']} | {r['swap_s']:.3f} s | {r['sleep']['duration_s']:.3f} s"
            f" | {r['wake']['duration_s']:.3f} s | {r['wake']['phases'].get('wait_room', 0):.3f} s"
            f" | {r['overlapped']} | {r['warm_first_token_s']:.4f} s |"
        )
    print(
        f"\nswaps: {len(times)}; p50 {pct(times, 50):.3f} s, p95 {pct(times, 95):.3f} s,"
        f" max {max(times):.3f} s; max(sleep, wake) alone {max(sw, ss):.3f} s, their sum"
        f" {sw + ss:.3f} s; warm first token (median) {warm:.4f} s; target 1.2 x max + first"
        f" token = {target:.3f} s; p50/target {pct(times, 50) / target:.2f},"
        f" p95/target {pct(times, 95) / target:.2f}; p50 / (sum + first token)"
        f" {pct(times, 50) / (sw + ss + warm):.2f}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
