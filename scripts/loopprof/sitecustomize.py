"""The event loop's profile of a running `hotswap serve`, for finding what holds the loop.

Diagnosis only, never imported by the project: put this folder on PYTHONPATH and set
LOOPPROF_DIR, and the `python -m controller serve --config FILE` processes started under
them (the soak's, for instance) write `$LOOPPROF_DIR/loopprof-<pid>.json` every 5 s:

    LOOPPROF_DIR=/tmp/prof PYTHONPATH=$PWD:$PWD/scripts/loopprof \\
        python -m pytest -s tests/integration/test_soak.py

What it holds: per callback of the loop (a task's step is named by its coroutine and the
place it resumed from), the count and the thread CPU and wall time in all; the slow ones
(over 2 ms of CPU or 20 ms of wall) with their longest CPU and wall; the stacks a sampler
thread saw while one callback ran past 10 ms of wall; the garbage collector's passes by
generation (count, CPU, longest CPU, wall, longest wall); and the loop thread's time on a
CPU and runnable but waiting for one (/proc schedstat). Thread CPU is what the loop spent;
wall minus CPU is the machine's (a loaded machine preempts the process).

And the loop's lag (`lag`): a tick every 20 ms on the loop, each tick's lateness counted
by bucket; for the ticks more than 20 ms late, the loop thread's schedstat over the
interval since the previous tick splits the lateness into time on a CPU (the loop's own
work: what our code holds), runnable but waiting for a CPU (the machine's: the process not
scheduled) and neither (blocked in a call, the GIL held by another thread, or idle):
`late` is [ticks, lateness, on CPU, waiting, neither] in seconds, `worst` the 25 latest
as [late, on CPU, waiting, interval] in ms.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def _wanted() -> bool:
    argv = sys.argv
    return "serve" in argv and "--config" in argv and not any("vllm" in a for a in argv)


def _install(out_dir: str) -> None:
    import asyncio
    import asyncio.events
    import atexit
    import contextlib
    import gc
    import json
    import threading
    import time
    import traceback

    out = os.path.join(out_dir, f"loopprof-{os.getpid()}.json")
    original = asyncio.events.Handle._run
    totals: dict[str, list[float]] = {}  # key -> [n, cpu, wall]
    slow: dict[str, list[float]] = {}  # key -> [n, cpu max, wall max, >5 ms, >20 ms, wall>50 ms]
    stacks: dict[str, int] = {}
    passes: dict[str, list[float]] = {}  # generation -> [n, cpu, cpu max, wall, wall max]
    current: dict[str, Any] = {"key": None, "wall0": 0.0}
    gc_start = [0.0, 0.0]
    main = threading.get_ident()
    began = time.monotonic()

    def where(coro: Any) -> str | None:
        last = None
        while coro is not None:
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "gi_frame", None)
            if frame is not None:
                name = os.path.basename(frame.f_code.co_filename)
                last = f"{name}:{frame.f_code.co_name}:{frame.f_lineno}"
            coro = getattr(coro, "cr_await", None) or getattr(coro, "gi_yieldfrom", None)
        return last

    def key(handle: asyncio.events.Handle) -> str:
        callback = handle._callback  # type: ignore[attr-defined]
        task = getattr(callback, "__self__", None)
        if isinstance(task, asyncio.Task):
            coro = task.get_coro()
            return f"task {getattr(coro, '__qualname__', '?')} @ {where(coro)}"
        callback = getattr(callback, "__func__", callback)
        module = getattr(callback, "__module__", "?")
        return f"cb {module}.{getattr(callback, '__qualname__', repr(callback))}"

    def run(self: asyncio.events.Handle) -> None:
        try:
            k = key(self)
        except Exception:
            k = "?"
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        current["key"], current["wall0"] = k, wall0
        try:
            original(self)
        finally:
            cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
            current["key"] = None
            t = totals.setdefault(k, [0, 0.0, 0.0])
            t[0] += 1
            t[1] += cpu
            t[2] += wall
            if cpu > 0.002 or wall > 0.02:
                s = slow.setdefault(k, [0, 0.0, 0.0, 0, 0, 0])
                s[0] += 1
                s[1] = max(s[1], cpu)
                s[2] = max(s[2], wall)
                s[3] += cpu > 0.005
                s[4] += cpu > 0.020
                s[5] += wall > 0.050

    asyncio.events.Handle._run = run  # type: ignore[method-assign]

    # The loop's lag: a tick every TICK_S on the loop; each tick's lateness, split by the
    # loop thread's schedstat over the interval since the previous tick into time on a CPU
    # (the loop's own work), runnable but waiting for a CPU (the machine's), and neither
    # (blocked: a synchronous call, the GIL held by another thread, or idle).
    tick_s = 0.02
    lag: dict[str, Any] = {"n": 0, "buckets": {}, "late": [0, 0.0, 0.0, 0.0, 0.0], "worst": []}
    tick_state: dict[str, Any] = {"loop": None}

    sched_fd: list[int] = []  # the loop thread's schedstat, opened once (read with pread)

    def thread_sched() -> tuple[float, float]:
        try:
            if not sched_fd:
                sched_fd.append(os.open(f"/proc/self/task/{os.getpid()}/schedstat", os.O_RDONLY))
            on_cpu, waiting, _ = (int(x) for x in os.pread(sched_fd[0], 128, 0).split())
        except (OSError, ValueError):
            return 0.0, 0.0
        return on_cpu / 1e9, waiting / 1e9

    def tick() -> None:
        now = time.perf_counter()
        on, wait = thread_sched()
        prev = tick_state.get("prev")
        if prev is not None:
            t0, on0, wait0 = prev
            interval = now - t0
            late = max(0.0, interval - tick_s)
            d_on, d_wait = on - on0, wait - wait0
            lag["n"] += 1
            for edge in (0.005, 0.02, 0.05, 0.1, 0.2, 0.5, float("inf")):
                if late < edge:
                    b = f"<{edge * 1000:g}ms"
                    lag["buckets"][b] = lag["buckets"].get(b, 0) + 1
                    break
            if late > 0.02:  # late ticks: [n, lateness, on CPU, waiting, blocked or idle]
                s = lag["late"]
                s[0] += 1
                s[1] += late
                s[2] += d_on
                s[3] += d_wait
                s[4] += max(0.0, interval - d_on - d_wait)
                lag["worst"].append(
                    [
                        round(late * 1000, 1),
                        round(d_on * 1000, 1),
                        round(d_wait * 1000, 1),
                        round(interval * 1000, 1),
                    ]
                )
                lag["worst"] = sorted(lag["worst"], reverse=True)[:25]
        tick_state["prev"] = (time.perf_counter(), *thread_sched())
        tick_state["loop"].call_later(tick_s, tick)

    def start_ticks(handle: asyncio.events.Handle) -> None:
        if tick_state["loop"] is None and threading.get_ident() == main:
            loop = getattr(handle, "_loop", None)
            if loop is not None and loop.is_running():
                tick_state["loop"] = loop
                loop.call_soon(tick)

    def run_and_tick(self: asyncio.events.Handle) -> None:
        if tick_state["loop"] is None:
            start_ticks(self)
        run(self)

    asyncio.events.Handle._run = run_and_tick  # type: ignore[method-assign]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            gc_start[0], gc_start[1] = time.perf_counter(), time.thread_time()
            return
        wall, cpu = time.perf_counter() - gc_start[0], time.thread_time() - gc_start[1]
        g = passes.setdefault(str(info.get("generation")), [0, 0.0, 0.0, 0.0, 0.0])
        g[0] += 1
        g[1] += cpu
        g[2] = max(g[2], cpu)
        g[3] += wall
        g[4] = max(g[4], wall)

    gc.callbacks.append(on_gc)

    def sampler() -> None:
        while True:
            time.sleep(0.005)
            if current["key"] is None or time.perf_counter() - current["wall0"] < 0.010:
                continue
            frame = sys._current_frames().get(main)
            if frame is None:
                continue
            seen = reversed(traceback.extract_stack(frame)[-12:])
            text = " <- ".join(f"{os.path.basename(f.filename)}:{f.name}:{f.lineno}" for f in seen)
            stacks[text] = stacks.get(text, 0) + 1

    def schedstat() -> dict[str, float]:
        try:
            with open(f"/proc/self/task/{os.getpid()}/schedstat") as f:
                on_cpu, waiting, _ = (int(x) for x in f.read().split())
        except (OSError, ValueError):
            return {}
        return {"on_cpu_s": on_cpu / 1e9, "waiting_for_cpu_s": waiting / 1e9}

    def dump() -> None:
        def rounded(v: list[float]) -> list[float]:
            return [round(x, 4) if isinstance(x, float) else x for x in v]

        data = {
            "argv": sys.argv,
            "elapsed_s": round(time.monotonic() - began, 1),
            "process_cpu_s": round(time.process_time(), 2),
            "loop_thread": schedstat(),
            "total": [
                [k, *rounded(v)] for k, v in sorted(totals.items(), key=lambda kv: -kv[1][1])[:60]
            ],
            "slow": [
                [k, *rounded(v)] for k, v in sorted(slow.items(), key=lambda kv: -kv[1][1])[:60]
            ],
            "stacks": sorted(stacks.items(), key=lambda kv: -kv[1])[:40],
            "gc": {g: rounded(v) for g, v in passes.items()},
            "lag": {**lag, "late": rounded(lag["late"]), "tick_s": tick_s},
        }
        with open(out + ".tmp", "w") as f:
            json.dump(data, f, indent=1)
        os.replace(out + ".tmp", out)

    def dumper() -> None:
        while True:
            time.sleep(5)
            with contextlib.suppress(Exception):  # a diagnosis never takes the process down
                dump()

    threading.Thread(target=sampler, daemon=True, name="loopprof-sampler").start()
    threading.Thread(target=dumper, daemon=True, name="loopprof-dumper").start()
    atexit.register(dump)


if os.environ.get("LOOPPROF_DIR") and _wanted():
    _install(os.environ["LOOPPROF_DIR"])
