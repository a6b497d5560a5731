"""The sidecar's side of the driver's process checkpoint: which processes an engine has, and
one call of the helper (`python -m controller.engines.cudackpt`) per operation, each in a
helper process started ahead of it (warm: libcuda loaded, cuInit run).

The helper runs in its own process so the sidecar never loads libcuda (docs/contracts.md
§2.2); each call is bounded by `call_timeout_s` (the helper's lock has its own, shorter,
bound) and a helper that outlives it is killed. Its one JSON line becomes a `CkptResult`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import socket
import sys
import time
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.engines.reaper import members
from controller.engines.sockets import process_group, socket_peer_pid

log = logging.getLogger("hotswap.checkpoint")

# The helper's codes that mean the engine cannot be checkpointed at all (a 422, not a failure).
INCAPABLE = frozenset({"no-driver", "no-api", "no-cuda", "no-pids"})


@dataclass(frozen=True)
class CkptResult:
    """One helper call's answer: per PID `cuda`, `state`, `bytes` (NVML; None: unknown)."""

    ok: bool
    code: str | None = None
    error: str | None = None
    pids: Mapping[int, Mapping[str, Any]] = field(default_factory=dict)
    elapsed_s: float = 0.0
    # the helper's own start (libcuda's load, cuInit, NVML's start) and its read-back after
    # the calls: None when it did not say
    init_s: float | None = None
    probe_s: float | None = None
    idle_s: float | None = None  # a warm helper's wait for its call (about 0: it was late)
    call_s: float | None = None  # the call's round trip, as the sidecar timed it

    @property
    def cuda_pids(self) -> tuple[int, ...]:
        return tuple(p for p, v in self.pids.items() if v.get("cuda"))

    @property
    def states(self) -> set[str]:
        return {str(v.get("state")) for v in self.pids.values() if v.get("cuda")}

    @property
    def device_bytes(self) -> int | None:
        """What the CUDA processes hold on the devices now; None when NVML could not say."""
        held = [v.get("bytes") for v in self.pids.values() if v.get("cuda")]
        if not held or any(b is None for b in held):
            return None
        return sum(int(b or 0) for b in held)

    def by_pid(self) -> dict[str, Any]:
        """A phase's detail from the answer: `driver_by_pid` {PID: {call: seconds}} (the
        driver's calls on each process), `left_running` (the processes the driver knows
        that hold no CUDA context: not locked, not checkpointed), `helper_init_s` (the
        helper's start, ahead of the call when it was warm), `helper_idle_s` (how long the
        warm helper waited for the call: about 0 when the call waited for its start),
        `probe_s` and `call_s` (the round trip); each only when known."""
        said = (
            ("helper_init_s", self.init_s),
            ("helper_idle_s", self.idle_s),
            ("probe_s", self.probe_s),
            ("call_s", self.call_s),
        )
        out: dict[str, Any] = {k: v for k, v in said if v is not None}
        took = {str(p): dict(v["s"]) for p, v in self.pids.items() if v.get("s")}
        if took:
            out["driver_by_pid"] = took
        idle = [p for p, v in self.pids.items() if v.get("context") is False]
        if idle:
            out["left_running"] = idle
        return out

    @property
    def incapable(self) -> bool:
        return not self.ok and self.code in INCAPABLE

    def to_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "code": self.code,
            "error": self.error,
            "elapsed_s": self.elapsed_s,
            "pids": {str(p): dict(v) for p, v in self.pids.items()},
        }


class Checkpointer:
    """Runs the helper, one process per call. After each call the next call's helper is
    started (`--warm`: libcuda loaded and cuInit run while nothing waits for it), so a deep
    sleep or wake does not wait for Python's start and cuInit; the spare exits at EOF on its
    stdin (`aclose`, or this process gone). A call's answer is its helper's one line: the
    caller does not wait for the helper's exit (its interpreter's and the driver's teardown),
    which goes on in the background; `settle` and `aclose` wait for it. `env` adds to its
    environment (HOTSWAP_CUDACKPT_FAKE in CPU tests)."""

    def __init__(
        self,
        *,
        lock_timeout_s: float,
        call_timeout_s: float,
        env: Mapping[str, str] | None = None,
        python: str = sys.executable,
    ) -> None:
        self.lock_timeout_s = lock_timeout_s
        self.call_timeout_s = call_timeout_s
        self.env = {**os.environ, **(env or {})}
        self.python = python
        self._spare: asyncio.subprocess.Process | None = None
        # helpers that answered and are still ending
        self._behind: set[asyncio.Task[None]] = set()

    async def _spawn(self) -> asyncio.subprocess.Process:
        # -S: no site-packages (the helper is stdlib and ctypes only): its start is on the
        # path of a deep sleep or wake whenever no spare is ready
        return await asyncio.create_subprocess_exec(
            *(self.python, "-S", "-m", "controller.engines.cudackpt", "--warm"),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=self.env,
            cwd=_root(),
        )

    def _take(self) -> asyncio.subprocess.Process | None:
        """The spare helper, if one is alive (no await: two calls never share one)."""
        proc, self._spare = self._spare, None
        return proc if proc is not None and proc.returncode is None else None

    async def _refill(self) -> None:
        if self._spare is not None:
            return
        proc = await self._spawn()
        if self._spare is None:
            self._spare = proc
        else:  # another call refilled meanwhile: this one ends at EOF
            await _close(proc)

    async def prewarm(self) -> None:
        """Start the first call's helper now (its spawn only; it warms on its own), so the
        first probe or checkpoint does not wait for Python's start, cuInit and NVML's."""
        await self._refill()

    def _background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._behind.add(task)
        task.add_done_callback(self._behind.discard)

    async def settle(self) -> None:
        """Wait for the helpers that answered and are still ending."""
        while self._behind:
            await asyncio.gather(*self._behind, return_exceptions=True)

    async def aclose(self) -> None:
        """End the spare helper (EOF on its stdin; killed if it does not go), after the
        helpers still ending."""
        await self.settle()
        proc, self._spare = self._spare, None
        if proc is not None:
            await _close(proc)

    async def call(self, op: str, pids: tuple[int, ...]) -> CkptResult:
        """`op` (probe, state, checkpoint, restore) on `pids`; never raises for the driver's
        answers: a helper that died or overran is a result with code "helper"."""
        if not pids:
            return CkptResult(False, "no-pids", "no process of the engine can be reached")
        proc = self._take() or await self._spawn()
        line = " ".join([op, str(int(self.lock_timeout_s * 1000)), *map(str, pids)]) + "\n"
        t0 = time.monotonic()
        try:
            out = await asyncio.wait_for(_answer(proc, line.encode()), self.call_timeout_s)
        except ValueError:  # a line past the reader's limit: not an answer of this helper
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            await self._refill()
            return CkptResult(False, "helper", f"the checkpoint helper ({op}) answered too long")
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
            await self._refill()
            why = f"the checkpoint helper ({op}) did not answer within {self.call_timeout_s:g} s"
            return CkptResult(False, "helper", why)
        if out.strip():
            # answered: its exit (the interpreter's and the driver's teardown) is not waited
            # for; the next call's helper is started (its spawn only: it warms while
            # nothing waits; a spawn is never left to a background task, whose cancellation
            # at the loop's end would wait for the child it kills)
            call_s = time.monotonic() - t0
            self._background(_close(proc))
            await self._refill()
            return dataclasses.replace(parse(op, out, b"", None), call_s=call_s)
        # no answer line: it ended (usage, a crash); its stderr and status say why
        _, err = await proc.communicate()
        await self._refill()
        return parse(op, out, err, proc.returncode)


async def _answer(proc: asyncio.subprocess.Process, line: bytes) -> bytes:
    """Send the helper its call and read its one answer line (b"" when it ends without)."""
    assert proc.stdin is not None
    assert proc.stdout is not None
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        proc.stdin.write(line)
        await proc.stdin.drain()
        proc.stdin.close()
    return await proc.stdout.readline()


async def _close(proc: asyncio.subprocess.Process) -> None:
    try:
        await asyncio.wait_for(proc.communicate(b""), 5.0)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()


def parse(op: str, out: bytes, err: bytes, code: int | None) -> CkptResult:
    try:
        raw = json.loads(out.decode().strip().splitlines()[-1])
    except (ValueError, IndexError):
        if code is None:  # it answered, but not with the JSON line
            said = out.decode(errors="replace").strip()[-400:]
            return CkptResult(False, "helper", f"the checkpoint helper ({op}) answered: {said}")
        tail = err.decode(errors="replace").strip()[-400:]
        return CkptResult(False, "helper", f"the checkpoint helper ({op}) exited {code}: {tail}")
    pids = {int(p): v for p, v in raw.get("pids", {}).items()}
    return CkptResult(
        bool(raw.get("ok")),
        raw.get("code"),
        raw.get("error"),
        pids,
        raw.get("elapsed_s", 0.0),
        raw.get("init_s"),
        raw.get("probe_s"),
        raw.get("idle_s"),
    )


def _root() -> str:
    """The folder that holds the `controller` package, so `-m` finds this checkout's."""
    return str(Path(__file__).resolve().parents[2])


def group_pids(pgid: int | None) -> tuple[int, ...]:
    """Every live process of an engine's process group (the keeper's, or the socket peer's)."""
    return () if pgid is None else tuple(sorted(members(pgid)))


def peer_group(uds: Path) -> int | None:
    """The process group of whatever listens on `uds`: seen only in a shared process
    namespace (else the peer's pid is 0 or not ours to read)."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(2.0)
        try:
            s.connect(str(uds))
            pid = socket_peer_pid(s)
        except OSError:
            return None
    return process_group(pid) if pid > 0 else None
