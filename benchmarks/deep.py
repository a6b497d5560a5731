"""The deep sleep beside the plain level-1 sleep, through the sidecar, on one GPU.

    python3 -m benchmarks.deep [--shapes llama32-1b,llama3-8b] [--graphs 1] [--cycles 2]
                               [--shape-env SHAPE:K=V,...] [--variant SHAPE:K=V,...]
                               [--level2 0|1|2] [--budget-s 480]

Runs on the lent device after the vLLM bundle, with the sidecar's wheels on PYTHONPATH.
Every shape's vLLM 0.26 server is booted at once (dummy bf16 weights, the shape's
utilization, `--graphs 1`: vLLM's compile and CUDA graphs), each on a Unix socket in its
own process group, and attached to one sidecar by socket (so the sidecar reaches its
processes: docs/contracts.md §2.2). `--threads-variant 1` boots one more small engine with
TORCHINDUCTOR_COMPILE_THREADS=1 (vLLM 0.26 sets it itself: off by default).
`--shape-env SHAPE:K=V,...` boots that shape's engine with those variables too (e.g. a
worker setting such as HOTSWAP_DISK_DIR=... on the small shape, the other shapes
at the defaults: an experiment beside the product in one call, without a third engine);
`--variant SHAPE:K=V,...` boots one more engine of SHAPE with them (`SHAPE-v`, measured
after the largest shape, through the same kinds): the same shape with and without a setting
in one call. `--eager-variant SHAPE[:KV_GIB]` boots one more engine of SHAPE eager (no
compile, no CUDA graphs; its KV cache KV_GIB, 8 by default; `SHAPE-eager`, measured
likewise): what compile and the graphs cost a sleeper on the device, in the driver's
checkpoint and restore, and in host PSS.
Per model, one after the other:
the reference greedy tokens and logprobs, the device bytes (nvidia-smi per process) and the
host PSS by process role awake; then per cycle and kind (level 1, deep, ...): POST sleep
(timed to its answer; the checkpoint phase's own time and the driver's), the device bytes
and PSS asleep, 1 s asleep, POST wake timed to the model's first /models/NAME/health 200,
tokens and logprobs compared with the reference. After a level-1 sleep the ranks' own account
of what they still hold (hotswap_info `resident`: torch's blocks, the CUDA-graph pools, the
context) is kept beside nvidia-smi's figure: it is what a deep sleep's checkpoint copies.
Host PSS is split by role and by kind (anon, file, shmem), and per process (`awake_procs`,
`asleep_procs`: pid, role, PSS and its kinds); after the first sleep of each kind the two largest
processes' PSS by mapping (`asleep_maps`: a file's path, [heap], [anon]). `--level2 2` ends
every model with a level-2 sleep measured asleep and not woken (its host PSS; a dummy-weights
engine cannot reload), `--level2 1` the first (the largest) only. Prints one JSON line per
cycle and writes $OUT/deep.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.common import UTIL, free_port, gpu_engine, logger, write_config
from benchmarks.fleetbench import (
    engine_pids,
    env_with,
    gpu_bytes,
    host_pss,
    launch_on_socket,
    pss,
    pss_by_mapping,
    pss_by_process,
    sidecar_on,
    uds_client,
    wait_all,
)
from controller.engines.launcher import EngineProcess

log = logger("deep")
PROMPT = [101, 203, 331, 409, 17, 911, 512, 733, 12, 880, 3, 64]


def reference(sock: Path) -> str:
    """The greedy answer to a fixed prompt, 16 tokens, with its logprobs and token ids
    where the server gives them (compared as a whole after every wake)."""
    body: dict[str, Any] = {"model": "m", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    with uds_client(sock) as c:
        r = c.post("/v1/completions", json={**body, "logprobs": 1, "return_token_ids": True})
        if r.status_code >= 400:
            r = c.post("/v1/completions", json=body)
        r.raise_for_status()
        choice = r.json()["choices"][0]
    return json.dumps({k: choice.get(k) for k in ("text", "logprobs", "token_ids")})


def timed_wake(side: str, name: str) -> dict[str, Any]:
    """POST wake in a thread while /models/NAME/health is polled every 2 ms."""
    box: dict[str, Any] = {}
    with (
        httpx.Client(base_url=side, timeout=300.0) as w,
        httpx.Client(base_url=side, timeout=5.0) as h,
    ):
        w.get("/livez")
        h.get("/livez")
        sent = threading.Event()

        def wake() -> None:
            box["t0"] = time.monotonic()
            sent.set()
            r = w.post(f"/models/{name}/wake")
            box["answer_s"] = time.monotonic() - box["t0"]
            box["status"], box["body"] = r.status_code, r.json()

        th = threading.Thread(target=wake)
        th.start()
        sent.wait(10)
        while time.monotonic() - box["t0"] < 120:
            if "status" in box and box["status"] != 200:
                break  # the wake failed: it will not become healthy
            if h.get(f"/models/{name}/health").status_code == 200:
                box["health_s"] = time.monotonic() - box["t0"]
                break
            time.sleep(0.002)
        th.join(300)
    return box


def resident(sock: Path) -> list[Any]:
    """What each rank says it holds on its device beside its pools (hotswap_info's
    `resident`: torch's allocated and cached blocks, the CUDA-graph pools, the rest: the
    context and module images; `stack`: what a stack shrink did), and in host RAM for its
    pools' copies (`host_backup_bytes`: the coded weights, `kv_host_backup_bytes`), asked
    over the engine's socket. Only of a sleeper that is not checkpointed: a checkpointed
    process answers no CUDA call."""
    body = {"method": "hotswap_info", "args": [], "kwargs": {}}
    try:
        with uds_client(sock, 60.0) as c:
            r = c.post("/collective_rpc", json=body)
            return [
                {
                    "resident": x.get("resident"),
                    # whether the CUDA graphs are in the CuMem pool a sleep releases, and
                    # the pools' bytes (with `cudagraph` when they are)
                    "graph_pool": x.get("graph_pool"),
                    "pools": x.get("pools"),
                    "host_backup_bytes": x.get("host_backup_bytes"),
                    "kv_host_backup_bytes": (x.get("backend_detail") or {}).get(
                        "kv_host_backup_bytes"
                    ),
                }
                for x in r.json().get("results", [])
            ]
    except (httpx.HTTPError, ValueError, AttributeError) as exc:
        return [f"{type(exc).__name__}: {exc}"]


def phases(tr: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for p in tr.get("phases", []):
        d = p.get("detail") or {}
        # each driver call per process, the helper's own start and its read-back
        keep = (
            *("driver_s", "device_bytes", "driver_by_pid", "helper_init_s", "helper_idle_s"),
            *("probe_s", "call_s"),
        )
        out[p["name"]] = {"s": p["duration_s"], **{k: d[k] for k in keep if k in d}}
        if "pids" in d:  # the processes the driver checkpointed or restored, one after another
            out[p["name"]]["cuda_processes"] = len(d["pids"])
        ranks = [r for r in p.get("ranks") or [] if isinstance(r, dict)]
        if any("host_trim" in r for r in ranks):  # what the sleep gave back to the host
            out[p["name"]]["host_trim"] = [r.get("host_trim") for r in ranks]
        steps = ("trim_s", "cache_release_s", "stack_restore_s", "host_trim_s")
        timed = [{k: v for k, v in (r.get("timings") or {}).items() if k in steps} for r in ranks]
        if any(timed):
            out[p["name"]]["rank_steps"] = timed
    return out


GiB_ = 1 << 30
DEEP_WAKE_OVER_S = 0.35  # issue 29's targets: deep wake <= level-1 wake + this (8B)
DEEP_SLEEP_OVER_S = 1.0  # deep sleep <= level-1 sleep + this
PSS_OVER_CODED = 1.5 * GiB_  # a level-1 sleeper's host PSS <= its coded weights + this
EAGER_UTIL = 0.2  # an eager variant's utilization (its start's free-memory check only)


def _median(xs: list[Any]) -> float | None:
    got = [float(x) for x in xs if x is not None]
    return statistics.median(got) if got else None


def summary(res: dict[str, Any]) -> dict[str, Any]:
    """The model's figures against the targets, from its cycles: the medians of each kind's
    sleep and wake, deep less level 1, the driver's checkpoint and restore, and per kind the
    host PSS asleep against the coded weights (the ranks' host_backup_bytes after a level-1
    sleep) plus 1.5 GiB."""
    by: dict[str, list[dict[str, Any]]] = {}
    for c in res["cycles"]:
        by.setdefault(c["kind"], []).append(c)
    out: dict[str, Any] = {}
    for kind, cs in by.items():
        out[kind] = {
            "n": len(cs),
            "sleep_s": _median([c["sleep_s"] for c in cs]),
            "wake_health_s": _median([c.get("wake_health_s") for c in cs]),
            "pss_asleep": _median([c["asleep_pss"]["total"] for c in cs]),
            "gpu_asleep": _median([c["asleep_gpu"] for c in cs]),
            "equal": all(c.get("equal", True) for c in cs),
        }
        for ph, key in (("checkpoint", "sleep_phases"), ("restore", "wake_phases")):
            got = [c[key][ph] for c in cs if ph in (c.get(key) or {})]
            if got:
                out[kind][ph] = {
                    "s": _median([g["s"] for g in got]),
                    "driver_s": _median([g.get("driver_s") for g in got]),
                }
    l1, deep = out.get("l1"), out.get("deep")
    if l1 and deep:
        for k, over in (("sleep_s", DEEP_SLEEP_OVER_S), ("wake_health_s", DEEP_WAKE_OVER_S)):
            if l1[k] is not None and deep[k] is not None:
                d = deep[k] - l1[k]
                out[f"deep_minus_l1_{k}"] = {"s": d, "target_s": over, "met": d <= over}
    coded = [
        sum(
            int(r.get("host_backup_bytes") or 0)
            for r in c.get("asleep_resident") or []
            if isinstance(r, dict)
        )
        for c in by.get("l1", [])
    ]
    if coded and max(coded) > 0 and l1 and l1["pss_asleep"] is not None:
        bound = max(coded) + PSS_OVER_CODED
        out["pss_target"] = {
            "coded_weights": max(coded),
            "bound": bound,
            **{f"{k}_over_coded": v["pss_asleep"] - max(coded) for k, v in by_pss(out)},
            "l1_met": l1["pss_asleep"] <= bound,
        }
    return out


def by_pss(out: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    return [(k, v) for k, v in out.items() if isinstance(v, dict) and v.get("pss_asleep")]


def one_model(
    side: str, name: str, sock: Path, kinds: list[str], deadline: float, into: list[Any]
) -> dict[str, Any]:
    """The model's cycles, put in `into` as they are measured (a failure keeps those before
    it), and its summary against the targets at the end, failed or not."""
    pids = engine_pids(sock)
    ref = reference(sock)
    res: dict[str, Any] = {
        "model": name,
        "pids": len(pids),
        "awake_gpu": gpu_bytes(pids),
        "awake_pss": host_pss(pids),
        "awake_procs": pss_by_process(pids),
        "cycles": [],
    }
    into.append(res)
    try:
        return _cycles(side, name, sock, kinds, deadline, res, ref)
    finally:
        res["summary"] = summary(res)
        log(name, "summary", json.dumps(res["summary"]))


def _cycles(
    side: str,
    name: str,
    sock: Path,
    kinds: list[str],
    deadline: float,
    res: dict[str, Any],
    ref: str,
) -> dict[str, Any]:
    res["awake_resident"] = resident(sock)
    log(
        name, "awake", json.dumps({k: res[k] for k in ("awake_gpu", "awake_pss", "awake_resident")})
    )
    with httpx.Client(base_url=side, timeout=600.0) as c:
        for kind in kinds:
            if time.monotonic() > deadline - 30:
                log("out of time before", name, kind)
                break
            level = 2 if kind.startswith("l2") else 1
            body = {"level": level, "deep": kind == "deep"}
            t = time.monotonic()
            r = c.post(f"/models/{name}/sleep", json=body)
            sleep_s = time.monotonic() - t
            if r.status_code != 200:
                raise RuntimeError(f"{name} sleep {kind}: {r.status_code} {r.text[:1500]}")
            snap = c.get(f"/models/{name}").json()
            pids = engine_pids(sock)
            cyc: dict[str, Any] = {
                "kind": kind,
                "sleep_s": sleep_s,
                "sleep_phases": phases(r.json().get("transition") or {}),
                "deep": snap.get("deep"),
                "deep_error": snap.get("deep_error"),
                "resident_bytes": snap.get("resident_bytes"),
                "asleep_gpu": gpu_bytes(pids),
                "asleep_pss": host_pss(pids),
                "asleep_procs": pss_by_process(pids),
                # what the driver would copy at a checkpoint, by kind (a level-1 sleeper)
                "asleep_resident": resident(sock) if kind == "l1" else None,
            }
            if not any(c["kind"] == kind for c in res["cycles"]):
                # the first of each kind: what holds the two largest processes' PSS
                cyc["asleep_maps"] = {
                    f"{r['role']}:{r['pid']}": pss_by_mapping(r["pid"])
                    for r in cyc["asleep_procs"][:2]
                }
            if kind == "l2-nowake":
                res["cycles"].append(cyc)  # measured asleep only: dummy weights cannot reload
                log(name, json.dumps(cyc))
                break
            time.sleep(1.0)
            box = timed_wake(side, name)
            if box.get("status") != 200:
                raise RuntimeError(f"{name} wake {kind}: {json.dumps(box.get('body'))[:1500]}")
            cyc["wake_answer_s"] = box["answer_s"]
            cyc["wake_health_s"] = box.get("health_s")
            cyc["wake_phases"] = phases(box["body"].get("transition") or {})
            cyc["equal"] = reference(sock) == ref
            res["cycles"].append(cyc)
            log(name, json.dumps(cyc))
    return res


def _plan(
    args: argparse.Namespace, out: dict[str, Any]
) -> list[tuple[str, str, dict[str, str], int | None]]:
    """The engines to boot: (name, shape, environment, KV bytes of an eager variant or None)
    per shape, then `--variant`'s, `--eager-variant`'s and `--threads-variant`'s."""
    extra: dict[str, dict[str, str]] = {}
    if args.shape_env:
        shape, _, kvs = args.shape_env.partition(":")
        extra[shape] = dict(kv.split("=", 1) for kv in kvs.split(","))
        out["shape_env"] = extra
    plan: list[tuple[str, str, dict[str, str], int | None]] = [
        (s, s, env_with(**extra.get(s, {})), None) for s in args.shapes.split(",")
    ]
    if args.variant:
        shape, _, kvs = args.variant.partition(":")
        env = env_with(**dict(kv.split("=", 1) for kv in kvs.split(",")))
        plan.append((f"{shape}-v", shape, env, None))
        out["variant"] = args.variant
    if args.eager_variant:
        shape, _, gib = args.eager_variant.partition(":")
        plan.append((f"{shape}-eager", shape, env_with(), int(float(gib or 8) * GiB_)))
        out["eager_variant"] = args.eager_variant
    if args.threads_variant:
        small = args.shapes.split(",")[0]
        plan.append((f"{small}-t1", small, env_with(TORCHINDUCTOR_COMPILE_THREADS="1"), None))
    return plan


def _order(names: list[str], shapes: str) -> list[str]:
    """The order the models are measured in: the last shape named (the largest) first, then
    the variants, then the other shapes (the last ones measured are the first a budget
    cuts)."""
    main = shapes.split(",")
    rest = [n for n in names if n not in main]
    return [main[-1], *rest, *reversed(main[:-1])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="llama32-1b,llama3-8b")
    ap.add_argument("--graphs", type=int, default=1)
    ap.add_argument("--cycles", type=int, default=2)
    # vLLM 0.26 sets TORCHINDUCTOR_COMPILE_THREADS=1 itself: the variant is the same engine
    ap.add_argument("--threads-variant", type=int, default=0)
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--boot-s", type=float, default=240.0)
    ap.add_argument("--level2", type=int, default=0)
    ap.add_argument("--shape-env", default="", help="SHAPE:K=V,...: that engine's extra variables")
    ap.add_argument(
        "--variant", default="", help="SHAPE:K=V,...: one more engine of SHAPE with them (SHAPE-v)"
    )
    ap.add_argument(
        "--eager-variant",
        default="",
        help="SHAPE[:KV_GIB]: one more engine of SHAPE, eager (no compile, no CUDA graphs), its"
        " KV cache that many GiB (8): what compile and graphs cost a sleeper (SHAPE-eager)",
    )
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget_s
    work = Path(tempfile.mkdtemp(prefix="bench-deep-"))
    socks = Path(tempfile.mkdtemp(prefix="socks-"))
    os.chmod(socks, 0o700)
    engines: dict[str, EngineProcess] = {}
    side: EngineProcess | None = None
    out: dict[str, Any] = {"graphs": args.graphs, "models": []}
    plan = _plan(args, out)
    try:
        for name, shape, env, eager_kv in plan:
            d = write_config(shape, str(work / name))
            eager = not args.graphs or eager_kv is not None
            # an eager variant's KV cache is sized in bytes: its utilization is only vLLM's
            # check of the free memory at its start, kept low beside the others booting
            util = UTIL[shape] if eager_kv is None else min(UTIL[shape], EAGER_UTIL)
            spec = gpu_engine(
                d, 0, "m", util=util, dummy=True, eager=eager, env=env, kv_bytes=eager_kv
            )
            engines[name] = launch_on_socket(name, spec.argv(), socks / f"{name}.sock", env, work)
        out["boot_s"] = wait_all(engines, args.boot_s)
        log("booted", json.dumps(out["boot_s"]))
        models = [
            {"name": n, "uds": str(socks / f"{n}.sock"), "served_model_name": "m"} for n in engines
        ]
        port = free_port()
        side = EngineProcess(sidecar_on(port, models), work / "sidecar.log")
        side.start()
        side.wait_ready(timeout_s=120)
        base = side.base_url
        out["sidecar_pss"] = pss(side.pid or 0)
        kinds = ["l1", "deep"] * args.cycles
        for i, name in enumerate(_order(list(engines), args.shapes)):
            # every engine here has dummy weights, which vLLM cannot reload (its level-2
            # wake fails): a level-2 sleep is measured asleep and not woken (its host PSS),
            # at the end of the first model (`--level2 1`) or of every model (`--level2 2`);
            # the variant only at level 1
            last = args.level2 == 2 or (args.level2 == 1 and i == 0)
            ks = [*kinds, "l2-nowake"] if last else kinds
            ks = ["l1"] if name.endswith("-t1") else ks
            try:
                one_model(base, name, socks / f"{name}.sock", ks, deadline, out["models"])
            except Exception as exc:  # keep the others' figures
                log(name, "failed:", f"{type(exc).__name__}: {exc}"[-3000:])
                out.setdefault("errors", []).append(f"{name}: {exc}"[-3000:])
            # what is done so far, should the stops outlast the caller's bound
            (Path(os.environ.get("OUT", ".")) / "deep.partial.json").write_text(json.dumps(out))
    finally:
        if side is not None:
            if out.get("errors"):
                log("sidecar log tail:\n" + side.log_tail(80))
            side.stop(20.0)
        for p in engines.values():
            p.stop(20.0)
    print(json.dumps(out), flush=True)
    dest = Path(os.environ.get("OUT", ".")) / "deep.jsonl"
    with dest.open("a") as f:
        f.write(json.dumps(out) + "\n")


if __name__ == "__main__":
    main()
