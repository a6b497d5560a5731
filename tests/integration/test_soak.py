"""The soak: many swap cycles of two managed models through the gateway, black-box.

`hotswap serve` runs as its own process on a models file (two tiny managed models, one
awake at a time), as a pod runs it. Each cycle sends a burst of concurrent clients
(streaming and not) for one model and one for the other, so the gateway swaps under
contention; every `kill_every` cycles one engine is SIGKILLed between bursts. The oracle,
for every single HTTP answer: 200 with exactly that model's greedy output (as it answered
at the start, from an engine verified at boot), or 429/503 with `Retry-After` (a client then
retries after it). Nothing lost (a transport error, another status, a broken stream), nothing
hung past its timeout, no verification failure, the gateway's own count of 200s equal to the
clients'. The sidecar's RSS and each awake engine's RSS are sampled every cycle; each
engine's must stay flat (within 10%), the sidecar's within the pod's limit (under load its
drift is reported). The load pauses (no completion in flight) around each kill. At the
end the sidecar is SIGKILLed: no engine process may outlive it.

Under load the whole time (tests/integration/loadgen.py): clients at the gateway's
`max_concurrent` cap on the cycle's model (the same oracle), bodies at the body and depth
caps, a stream of half-open and slow connections, and `/livez` probed every 0.1 s: its p99,
each probe less the time the prober and the sidecar's event loop waited for a CPU during it
(the machine's share, reported beside), must stay within 100 ms, and the sidecar's RSS
within the pod's limit in deploy/ (512 MiB).

CI runs a bounded form (HOTSWAP_SOAK_CYCLES, default 10, an engine killed at cycle 5, and
at least HOTSWAP_SOAK_MIN_S, default 120 s, the 2 minutes the issue asks of CI, of cycles:
every kind of cycle, kill and probe, fewer times); `scripts/dev.sh soak` runs the full
one (at least 20 cycles and 600 s, an engine killed every 10 cycles) and prints the figures
docs/reliability.md quotes (also written as JSON to HOTSWAP_SOAK_REPORT if set).
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from loadgen import Load, StreamedText
from support.engines import forked_core
from support.procs import alive, children, cmdline, descendants, engine_pid, rss_bytes
from support.sidecar import SidecarProcess

from controller.engines.enginespec import EngineSpec, managed_argv

pytestmark = pytest.mark.vllm

A, B = "tiny-a", "tiny-b"
MODELS = (A, B)
CYCLES = int(os.environ.get("HOTSWAP_SOAK_CYCLES", "10"))
KILL_EVERY = int(os.environ.get("HOTSWAP_SOAK_KILL_EVERY", str(max(1, min(20, CYCLES // 2)))))
CLIENTS = 4  # per cycle for the cycle's model, half of them streaming; plus one for the other
PROMPTS = ("hello world, this is", "the quick brown fox", "once upon a time")
MAX_TOKENS = 8
REQUEST_TIMEOUT_S = 200.0  # one HTTP attempt: hold_timeout_s (120) plus generation, generous
REQUEST_DEADLINE_S = 400.0  # one logical request, retries included (an engine restart inside)
RSS_TOLERANCE = 0.10
MIN_S = float(os.environ.get("HOTSWAP_SOAK_MIN_S", "120"))  # cycles go on at least this long
MAX_CONCURRENT = 12  # the gateway's cap in this soak; the load keeps it full
# /livez p99, less the CPU waits: 100 ms in the full form; the CI form (shorter than 600 s)
# is held to 500 ms unless HOTSWAP_SOAK_LIVEZ_P99_MS says otherwise (docs/reliability.md)
LIVEZ_P99_S = (
    float(os.environ.get("HOTSWAP_SOAK_LIVEZ_P99_MS", 100 if MIN_S >= 600 else 500)) / 1000
)
SIDECAR_RSS_LIMIT = 512 * 2**20  # the sidecar container's memory limit in deploy/


def sched(pid: int) -> tuple[float, float]:
    """(seconds on a CPU, seconds runnable but waiting for one) of `pid`'s main thread
    (/proc/PID/schedstat): how much of a slow answer was the machine's, not the sidecar's."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            on_cpu_ns, waiting_ns, _ = (int(x) for x in f.read().split())
    except (OSError, ValueError):
        return 0.0, 0.0
    return on_cpu_ns / 1e9, waiting_ns / 1e9


# ----------------------------------------------------------------------------- clients


@dataclass
class Tally:
    """Every HTTP answer the clients got, by outcome; a lock: clients run on threads."""

    outcomes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    served: int = 0  # logical requests answered 200 with the right output in the end
    latencies: list[float] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def add(self, outcome: str, problem: str | None = None) -> None:
        with self.lock:
            self.outcomes[outcome] += 1
            if problem is not None:
                self.problems.append(problem)


def _body(model: str, prompt: str, stream: bool) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": prompt,
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }


def attempt(client: httpx.Client, model: str, prompt: str, stream: bool) -> tuple[int, str, str]:
    """One HTTP attempt: (status, the generated text or the error body, Retry-After)."""
    body = _body(model, prompt, stream)
    if not stream:
        r = client.post("/v1/completions", json=body)
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        return r.status_code, text, r.headers.get("retry-after", "")
    with client.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, r.text, r.headers.get("retry-after", "")
        streamed = StreamedText()
        for line in r.iter_lines():
            if streamed.line(line):
                break
        return 200, streamed.text(), ""


def request(
    gateway: str, model: str, prompt: str, stream: bool, want: str | None, tally: Tally
) -> str | None:
    """One logical request, retried after each 429/503 as its Retry-After says, until it is
    answered or its deadline passes. Returns the text it got (for the references)."""
    what = f"{model} stream={stream} {prompt!r}"
    t0 = time.monotonic()
    with httpx.Client(base_url=gateway, timeout=REQUEST_TIMEOUT_S) as client:
        while time.monotonic() - t0 < REQUEST_DEADLINE_S:
            started = time.monotonic()
            try:
                status, text, retry_after = attempt(client, model, prompt, stream)
            except httpx.TimeoutException as exc:
                tally.add("hung", f"{what}: no answer within {REQUEST_TIMEOUT_S:g} s: {exc}")
                return None
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                tally.add("lost", f"{what}: {type(exc).__name__}: {exc}")
                return None
            if status == 200:
                if want is not None and text != want:
                    tally.add("wrong", f"{what}: got {text!r}, want {want!r}")
                    return None
                tally.add("ok")
                with tally.lock:
                    tally.served += 1
                    tally.latencies.append(time.monotonic() - t0)
                return text
            if status in (429, 503):
                if not retry_after.isdigit():
                    tally.add("no_retry_after", f"{what}: {status} without Retry-After: {text}")
                    return None
                tally.add(f"refused_{status}")
                time.sleep(min(float(retry_after), 2.0) + 0.05 * (started % 1))
                continue
            tally.add("other", f"{what}: HTTP {status}: {text[:300]}")
            return None
    tally.add("lost", f"{what}: not answered within {REQUEST_DEADLINE_S:g} s of retries")
    return None


# ----------------------------------------------------------------------------- the soak


@pytest.fixture(scope="module")
def sidecar(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarProcess]:
    work = tmp_path_factory.mktemp("soak")
    models = []
    for seed, name in enumerate(MODELS):
        spec = EngineSpec(
            model=tiny_model("llama", seed, True), uds=Path(), served_model_name=name, uni=True
        )
        models.append(
            {
                "name": name,
                "command": forked_core(managed_argv(spec)),
                "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                "served_model_name": name,
            }
        )
    config = {
        "server": {"host": "127.0.0.1", "port": 0},
        "gateway": {
            "port": 0,
            "queue_size": 32,
            "hold_timeout_s": 120.0,
            "retry_after_s": 1,
            "max_concurrent": MAX_CONCURRENT,
        },
        "swap": {"max_awake": 1, "min_awake_s": 0.0},
        "supervisor": {
            "log_dir": str(work / "engines"),
            "restart_backoff_s": 0.5,
            "boot_timeout_s": 300.0,
            "stop_grace_s": 5.0,
        },
        "log": {"format": "text", "level": "INFO"},
        "models": models,
    }
    # In a session of its own, as in a pod its container has a CPU cgroup of its own: the
    # test process driving the load is not the sidecar's to share a CPU share with.
    side = SidecarProcess.over(config, work, own_session=True)
    try:
        side.start()
        wait_booted(side)
        yield side
    finally:
        # The end of the soak is a SIGKILL of the sidecar: no engine, keeper or engine child
        # may outlive it (the keepers' parent-death signal ends their process groups).
        keepers = children(side.pid)
        groups = {k: [k, *descendants(k)] for k in keepers}
        side.kill()
        everything = [p for ps in groups.values() for p in ps]
        deadline = time.monotonic() + 30
        while any(alive(p) for p in everything) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [(p, cmdline(p)[:4]) for p in everything if alive(p)]
        assert keepers, "the sidecar had no engines to leave behind"
        assert not left, f"outlived the SIGKILLed sidecar: {left}"


def wait_booted(side: SidecarProcess, timeout_s: float = 600.0) -> None:
    """Every engine booted: awake or asleep, at least one asleep (one awake at a time)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        states = {m["state"] for m in side.models().values()}
        if states <= {"RUNNING", "SUSPENDED"} and "SUSPENDED" in states:
            return
        time.sleep(0.5)
    pytest.fail(f"the engines did not boot in {timeout_s:.0f} s:\n{side.log_tail()}")


def test_soak_swaps_under_load_with_engines_killed(sidecar: SidecarProcess) -> None:
    tally = Tally()
    t_start = time.monotonic()
    # References: each model's greedy output for each prompt, from engines verified at boot.
    refs: dict[tuple[str, str, bool], str] = {}
    for model in MODELS:
        for prompt in PROMPTS:
            for stream in (False, True):
                got = request(sidecar.gateway_url, model, prompt, stream, None, tally)
                assert got is not None, tally.problems
                refs[(model, prompt, stream)] = got
    for prompt in PROMPTS:
        assert refs[(A, prompt, False)] != refs[(B, prompt, False)], "the models must differ"

    swaps_before = sidecar.metric("hotswap_swaps_total", result="ok")
    sidecar_rss: list[int] = []
    engine_rss: dict[str, list[int]] = {m: [] for m in MODELS}
    kills: list[tuple[int, str, float]] = []
    restarts_before = sidecar.metric("hotswap_engine_restarts_total")
    load = Load(
        sidecar.gateway_url,
        sidecar.url,
        refs,
        A,
        sidecar_pid=sidecar.pid,
        workers=MAX_CONCURRENT,
        max_body_bytes=4 * 2**20,  # the gateway's default max_body_bytes
        max_json_depth=64,  # and max_json_depth
    )
    load.start()
    sched_before = sched(sidecar.pid)
    cycles = 0
    with ThreadPoolExecutor(max_workers=CLIENTS + 1) as pool:
        while cycles < CYCLES or time.monotonic() - t_start < MIN_S:
            cycle, cycles = cycles, cycles + 1
            if cycle and cycle % KILL_EVERY == 0:
                victim = MODELS[(cycle // KILL_EVERY) % 2]
                pid = engine_pid(sidecar.pid, victim)
                assert pid is not None, f"no engine for {victim}:\n{sidecar.log_tail()}"
                load.pause()  # like the soak's own bursts: no stream in flight at the kill
                os.kill(pid, signal.SIGKILL)
                load.resume()
                kills.append((cycle, victim, time.monotonic() - t_start))
            target, other = MODELS[cycle % 2], MODELS[(cycle + 1) % 2]
            load.target = target
            jobs = [
                (target, PROMPTS[(cycle + i) % len(PROMPTS)], i % 2 == 1) for i in range(CLIENTS)
            ]
            jobs.append((other, PROMPTS[cycle % len(PROMPTS)], cycle % 2 == 0))
            futures = [
                pool.submit(request, sidecar.gateway_url, m, p, s, refs[(m, p, s)], tally)
                for m, p, s in jobs
            ]
            for f in futures:
                f.result()
            sidecar_rss.append(rss_bytes(sidecar.pid))
            for m, state in ((m, d["state"]) for m, d in sidecar.models().items()):
                pid = engine_pid(sidecar.pid, m)
                if state == "RUNNING" and pid is not None:
                    engine_rss[m].append(rss_bytes(pid))
    sched_after = sched(sidecar.pid)
    loaded = load.stop()
    elapsed = time.monotonic() - t_start
    sidecar_rss.append(rss_bytes(sidecar.pid))
    swaps = sidecar.metric("hotswap_swaps_total", result="ok") - swaps_before
    restarts = sidecar.metric("hotswap_engine_restarts_total") - restarts_before
    gateway_ok = sidecar.metric("hotswap_gateway_requests_total", code="200")
    verify_failures = sidecar.metric("hotswap_verification_failures_total")

    def drift(samples: list[int]) -> float:
        steady = samples[len(samples) // 5 :] or samples  # after the first fifth (warm-up)
        return (max(steady) - min(steady)) / min(steady) if steady and min(steady) else 0.0

    report = {
        "cycles": cycles,
        "kill_every": KILL_EVERY,
        "kills": kills,
        "swaps_ok": swaps,
        "engine_restarts": restarts,
        "elapsed_s": round(elapsed, 1),
        "outcomes": dict(tally.outcomes),
        "logical_requests_served": tally.served,
        "latency_s": {
            "p50": round(statistics.median(tally.latencies), 3),
            "max": round(max(tally.latencies), 3),
        },
        "gateway_200": gateway_ok,
        "verification_failures": verify_failures,
        # Under load: the sidecar's event loop thread on a CPU, and runnable but waiting for
        # one (the machine's share of /livez's latency, not the sidecar's).
        "sidecar_loop_s": {
            "on_cpu": round(sched_after[0] - sched_before[0], 1),
            "waiting_for_cpu": round(sched_after[1] - sched_before[1], 1),
        },
        "sidecar_rss_mib": [round(min(sidecar_rss) / 2**20, 1), round(max(sidecar_rss) / 2**20, 1)],
        "sidecar_rss_drift": round(drift(sidecar_rss), 3),
        "engine_rss_mib": {
            m: [round(min(v) / 2**20, 1), round(max(v) / 2**20, 1)]
            for m, v in engine_rss.items()
            if v
        },
        "engine_rss_drift": {m: round(drift(v), 3) for m, v in engine_rss.items() if v},
        "problems": tally.problems[:20],
        "load": loaded,
    }
    print("\nsoak:", json.dumps(report, indent=1))
    if out := os.environ.get("HOTSWAP_SOAK_REPORT"):
        Path(out).write_text(json.dumps(report, indent=1) + "\n")

    bad = {k: n for k, n in tally.outcomes.items() if not (k == "ok" or k.startswith("refused_"))}
    assert not bad, report
    assert tally.served == len(refs) + cycles * (CLIENTS + 1), report
    load_bad = {k: n for k, n in loaded["outcomes"].items() if k != "ok" and "refused" not in k}
    assert not load_bad, report  # 0 lost, 0 hung, 0 wrong (an unverified model's answer)
    for probe in ("at_cap", "over_cap", "too_deep"):  # each answered (or closed at once)
        assert {probe, f"{probe}_closed_early"} & set(loaded["caps"]), report
    # what the sidecar made a probe wait; the raw figure (loaded["livez"]) is the machine's
    # too: on a busy CI machine its loop waited for a CPU most of the run
    assert loaded["livez_less_cpu_waits"]["p99_ms"] <= LIVEZ_P99_S * 1000, report
    assert max(sidecar_rss) <= SIDECAR_RSS_LIMIT, report
    # the gateway answered nobody else
    assert gateway_ok == tally.outcomes["ok"] + loaded["outcomes"].get("ok", 0), report
    assert verify_failures == 0, report
    assert swaps >= cycles, report  # every cycle swapped at least once
    assert restarts == len(kills), report
    # under load the sidecar's RSS is held to the pod's limit (above); its drift is reported
    for m, d in report["engine_rss_drift"].items():
        assert d <= RSS_TOLERANCE, (m, report)
