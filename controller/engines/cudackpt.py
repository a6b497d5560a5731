"""The CUDA driver's process checkpoint: `python -m controller.engines.cudackpt OP PID...`.

The sidecar spawns this per call (docs/contracts.md §2.2) instead of loading libcuda itself:
a process that ran `cuInit` must not fork a CUDA process, and the sidecar forks engines. This
one runs `cuInit(0)`, calls the driver's checkpoint API on other processes and forks nothing.
Standard library and ctypes only, like the keeper (`reaper`): it runs inside the vLLM image too.
`--warm`: the driver is loaded, cuInit and nvmlInit run first, then the one call is read
from stdin (`OP LOCK_TIMEOUT_MS PID...`); EOF instead ends it quietly (the sidecar's spare).

OPs: `probe`/`state` (which PIDs hold a CUDA context, their state, and the device bytes each
holds as NVML counts them; a process the driver knows but NVML lists with no memory beside
one that holds some is `context` false: it ran cuInit and made no context), `checkpoint`
(lock every PID that holds a context, then checkpoint each: every one or none), `restore`
(restore each checkpointed PID, then unlock each). It prints one JSON object: `ok`, `error`
and `code` when not ok, `pids` ({PID: {cuda, state, bytes, context?, s?, error?}}; `bytes`
None after a restore, whose wake does not wait for NVML; `s` the seconds of each driver call
made on it: lock, checkpoint, restore, unlock), `elapsed_s` (the
driver calls' own time), `init_s` (libcuda's load and cuInit), `probe_s` (the states and
bytes read after the calls), `idle_s` (`--warm`: from its start's end to its call's line;
about 0 when the call waited for the start). Exit 0 when ok, 1 when not, 2 on usage.

`HOTSWAP_CUDACKPT_FAKE=DIR` replaces the driver with `FakeDriver`, a file-backed stand-in for
CPU tests: `DIR/cuda` lists the PIDs the driver knows ("PID [BYTES]" a line; BYTES 0: it ran
cuInit and holds no context, NVML lists no memory for it), `DIR/fail`
names an OP to fail ("lock", "checkpoint", "restore", "unlock", or "OP PID" for one PID),
`DIR/noapi` and `DIR/nodriver` make the driver lack the API or be absent; the states live in
`DIR/state.json` across calls, as the real driver keeps them across helper processes.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

USAGE = (
    "usage: python -m controller.engines.cudackpt probe|state|checkpoint|restore "
    "[--lock-timeout-ms N] PID...\n"
    "       python -m controller.engines.cudackpt --warm  (then OP LOCK_TIMEOUT_MS PID... on stdin)"
)
STATES = {0: "running", 1: "locked", 2: "checkpointed", 3: "failed"}
SYMBOLS = (
    "cuCheckpointProcessLock",
    "cuCheckpointProcessCheckpoint",
    "cuCheckpointProcessRestore",
    "cuCheckpointProcessUnlock",
    "cuCheckpointProcessGetState",
)


class DriverError(Exception):
    """A driver call that failed; `code` says which kind (the contract's codes)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class _LockArgs(ctypes.Structure):
    # CUcheckpointLockArgs: timeoutMs (0 = wait forever, never used here), then reserved.
    _fields_ = [("timeoutMs", ctypes.c_uint), ("reserved0", ctypes.c_uint),
                ("reserved1", ctypes.c_uint64 * 7)]  # fmt: skip


class _NvmlProcess(ctypes.Structure):
    # nvmlProcessInfo_t (v2 and v3 share the layout).
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]  # fmt: skip


class CudaDriver:
    """libcuda's five checkpoint calls, and NVML's per-process device bytes."""

    def __init__(self) -> None:
        try:
            self.lib = ctypes.CDLL("libcuda.so.1")
        except OSError as exc:
            raise DriverError("no-driver", f"no CUDA driver: {exc}") from None
        missing = [s for s in SYMBOLS if not hasattr(self.lib, s)]
        if missing:
            raise DriverError(
                "no-api", f"the CUDA driver lacks {', '.join(missing)} (needs >= 570)"
            )
        rc = self.lib.cuInit(0)
        if rc != 0:
            raise DriverError("no-driver", f"cuInit(0) failed: {self._name(rc)}")
        self._nvml: Any = None  # loaded when first asked (nvml())

    def _name(self, rc: int) -> str:
        name = ctypes.c_char_p()
        if self.lib.cuGetErrorName(rc, ctypes.byref(name)) == 0 and name.value:
            return f"{name.value.decode()} ({rc})"
        return f"CUresult {rc}"

    def _call(self, code: str, fn: str, *args: Any) -> None:
        rc = getattr(self.lib, fn)(*args)
        if rc != 0:
            raise DriverError(code, f"{fn}: {self._name(rc)}")

    def state(self, pid: int) -> str:
        st = ctypes.c_int(-1)
        self._call("state", "cuCheckpointProcessGetState", pid, ctypes.byref(st))
        return STATES.get(st.value, f"unknown({st.value})")

    def lock(self, pid: int, timeout_ms: int) -> None:
        args = _LockArgs(timeoutMs=timeout_ms)
        self._call("lock", "cuCheckpointProcessLock", pid, ctypes.byref(args))

    def checkpoint(self, pid: int) -> None:
        self._call("checkpoint", "cuCheckpointProcessCheckpoint", pid, None)

    def restore(self, pid: int) -> None:
        self._call("restore", "cuCheckpointProcessRestore", pid, None)

    def unlock(self, pid: int) -> None:
        self._call("unlock", "cuCheckpointProcessUnlock", pid, None)

    def nvml(self) -> Any:
        """libnvidia-ml loaded and initialised, once per helper (`--warm` does it ahead of
        the call); None where there is none. Never shut down: the helper ends after its call."""
        if self._nvml is None:
            try:
                lib = ctypes.CDLL("libnvidia-ml.so.1")
                self._nvml = lib if lib.nvmlInit_v2() == 0 else False
            except (OSError, AttributeError):
                self._nvml = False
        return self._nvml or None

    def device_bytes(self) -> dict[int, int] | None:
        """Device bytes per PID over every GPU, as nvidia-smi shows them (None: no NVML)."""
        nvml = self.nvml()
        if nvml is None:
            return None
        try:
            get = getattr(nvml, "nvmlDeviceGetComputeRunningProcesses_v3", None)
            get = get or nvml.nvmlDeviceGetComputeRunningProcesses_v2
            count = ctypes.c_uint()
            if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
                return None
            held: dict[int, int] = {}
            for i in range(count.value):
                dev = ctypes.c_void_p()
                if nvml.nvmlDeviceGetHandleByIndex_v2(i, ctypes.byref(dev)) != 0:
                    return None
                infos = (_NvmlProcess * 256)()
                n = ctypes.c_uint(256)
                if get(dev, ctypes.byref(n), infos) != 0:
                    return None
                for p in infos[: n.value]:
                    held[p.pid] = held.get(p.pid, 0) + int(p.usedGpuMemory)
            return held
        except AttributeError:  # an NVML without these calls
            return None


class FakeDriver:
    """The driver as CPU tests see it: states and faults in files of one folder."""

    def __init__(self, folder: str) -> None:
        self.dir = Path(folder)
        if (self.dir / "nodriver").exists():
            raise DriverError("no-driver", "no CUDA driver: libcuda.so.1 not found (fake)")
        if (self.dir / "noapi").exists():
            raise DriverError("no-api", "the CUDA driver lacks cuCheckpointProcessLock (fake)")
        self.cuda: dict[int, int] = {}
        cuda = self.dir / "cuda"
        for line in cuda.read_text().splitlines() if cuda.exists() else ():
            parts = line.split()
            if parts:
                self.cuda[int(parts[0])] = int(parts[1]) if len(parts) > 1 else 1 << 30
        with self._locked():
            self.states = self._read()

    @contextlib.contextmanager
    def _locked(self) -> Any:
        """The state file to this helper alone: helpers for two engines run at once."""
        with open(self.dir / "state.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            yield

    def _read(self) -> dict[int, str]:
        path = self.dir / "state.json"
        return {int(k): v for k, v in json.loads(path.read_text()).items()} if path.exists() else {}

    def _save(self, pid: int) -> None:
        """This process's state into the file, the other processes' as the file has them now
        (another helper may have changed theirs since this one read it)."""
        with self._locked():
            states = {**self._read(), pid: self.states[pid]}
            tmp = self.dir / "state.json.tmp"
            tmp.write_text(json.dumps(states))
            tmp.replace(self.dir / "state.json")

    def _op(self, op: str, pid: int, before: str, after: str) -> None:
        fail = self.dir / "fail"
        told = fail.read_text().split() if fail.exists() else []
        if told and told[0] == op and (len(told) == 1 or int(told[1]) == pid):
            if op == "checkpoint":
                self.states[pid] = "locked"  # the driver leaves a failed checkpoint locked
                self._save(pid)
            raise DriverError(op, f"cuCheckpointProcess{op.title()}: CUDA_ERROR_UNKNOWN (fake)")
        if self.state(pid) != before:
            raise DriverError(
                op, f"cuCheckpointProcess{op.title()}: CUDA_ERROR_ILLEGAL_STATE (fake)"
            )
        self.states[pid] = after
        self._save(pid)

    def state(self, pid: int) -> str:
        if pid not in self.cuda:
            raise DriverError("state", "cuCheckpointProcessGetState: CUDA_ERROR_NOT_FOUND (fake)")
        return str(self.states.get(pid, "running"))

    def lock(self, pid: int, timeout_ms: int) -> None:
        self._op("lock", pid, "running", "locked")

    def checkpoint(self, pid: int) -> None:
        self._op("checkpoint", pid, "locked", "checkpointed")

    def restore(self, pid: int) -> None:
        self._op("restore", pid, "checkpointed", "locked")

    def unlock(self, pid: int) -> None:
        self._op("unlock", pid, "locked", "running")

    def device_bytes(self) -> dict[int, int] | None:
        return {p: (0 if self.states.get(p) == "checkpointed" else b) for p, b in self.cuda.items()}


Driver = CudaDriver | FakeDriver


def probe(drv: Driver, pids: list[int], with_bytes: bool = True) -> dict[int, dict[str, Any]]:
    """Per PID: whether it holds a CUDA context (`cuda`), its state, its bytes (None unless
    `with_bytes`: NVML's start and stop cost time a wake waits for). The driver answers
    GetState for any process that ran cuInit; with the bytes, a running one that NVML lists
    with no device memory while another of `pids` holds some or is checkpointed or locked
    holds no context (a front end that ran cuInit and made none): `cuda` false, `context`
    false, and no call touches it."""
    held = drv.device_bytes() if with_bytes else None
    out: dict[int, dict[str, Any]] = {}
    for pid in pids:
        try:
            out[pid] = {"cuda": True, "state": drv.state(pid)}
        except DriverError as exc:
            out[pid] = {"cuda": False, "state": None, "error": str(exc)}
        out[pid]["bytes"] = None if held is None else held.get(pid, 0)
    if held is None:
        return out
    holds = [p for p, v in out.items() if v["bytes"] or v["state"] in ("checkpointed", "locked")]
    for pid, v in out.items():
        if holds and pid not in holds and v["state"] == "running":
            v.update(cuda=False, context=False)
    return out


def _timed(took: dict[int, dict[str, float]], pid: int, step: str, fn: Callable[[], None]) -> None:
    """`fn()`, its seconds kept in `took[pid][step]` (kept when it raises too)."""
    t0 = time.monotonic()
    try:
        fn()
    finally:
        took.setdefault(pid, {})[step] = time.monotonic() - t0


def _undo(steps: list[Callable[[], None]]) -> list[str]:
    """Run every rollback step, newest first; the errors of those that failed."""
    errors = []
    for undo in reversed(steps):
        try:
            undo()
        except DriverError as exc:
            errors.append(str(exc))
    return errors


def checkpoint(
    drv: Driver, pids: list[int], timeout_ms: int, took: dict[int, dict[str, float]] | None = None
) -> None:
    """Lock every PID, then checkpoint each; on any failure undo what was done (every PID or
    none). A failed rollback raises with code "rollback". `took`: each call's seconds per
    PID."""
    took = {} if took is None else took
    undo: list[Callable[[], None]] = []
    try:
        for pid in pids:
            _timed(took, pid, "lock", functools.partial(drv.lock, pid, timeout_ms))
            undo.append(functools.partial(drv.unlock, pid))
        for pid in pids:
            try:
                _timed(took, pid, "checkpoint", functools.partial(drv.checkpoint, pid))
            except DriverError:
                if drv.state(pid) == "checkpointed":  # it went through after all
                    undo.append(functools.partial(drv.restore, pid))
                raise
            undo.append(functools.partial(drv.restore, pid))
    except DriverError as exc:
        left = _undo(undo)
        if left:
            raise DriverError("rollback", f"{exc}; the rollback failed: {'; '.join(left)}") from exc
        raise


def restore(drv: Driver, pids: list[int], took: dict[int, dict[str, float]] | None = None) -> None:
    """Restore every checkpointed PID, then unlock every locked one. `took`: each call's
    seconds per PID."""
    took = {} if took is None else took
    for pid in pids:
        if drv.state(pid) == "checkpointed":
            _timed(took, pid, "restore", functools.partial(drv.restore, pid))
    for pid in pids:
        if drv.state(pid) == "locked":
            _timed(took, pid, "unlock", functools.partial(drv.unlock, pid))


def load() -> Driver:
    fake = os.environ.get("HOTSWAP_CUDACKPT_FAKE")
    return FakeDriver(fake) if fake else CudaDriver()


def run(
    op: str,
    pids: list[int],
    timeout_ms: int,
    loaded: Driver | DriverError | None = None,
    init_s: float | None = None,
) -> dict[str, Any]:
    """`op` on `pids`; `loaded`: the driver (or its loading's error) made ahead of the call
    (`--warm`), else it is made now."""
    t0 = time.monotonic()
    took: dict[int, dict[str, float]] = {}
    try:
        if isinstance(loaded, DriverError):
            raise loaded
        drv: Driver = loaded if loaded is not None else load()
        init_s = time.monotonic() - t0 if init_s is None else init_s
        t0 = time.monotonic()
        if op in ("checkpoint", "restore"):
            # a checkpoint reads NVML first: a process with no context is left as it is
            found = probe(drv, pids, with_bytes=op == "checkpoint")
            cuda = [p for p in pids if found[p]["cuda"]]
            if not cuda:
                raise DriverError("no-cuda", "no process of the engine holds a CUDA context")
            if op == "checkpoint":
                checkpoint(drv, cuda, timeout_ms, took)
            else:
                restore(drv, cuda, took)
        elapsed = time.monotonic() - t0
        t0 = time.monotonic()
        # after a restore the bytes are not asked for (the wake waits on this answer)
        found = probe(drv, pids, with_bytes=op != "restore")
        for pid, steps in took.items():
            found[pid]["s"] = steps
        return {
            "ok": True,
            "pids": found,
            "elapsed_s": elapsed,
            "init_s": init_s,
            "probe_s": time.monotonic() - t0,
        }
    except DriverError as exc:
        return {
            "ok": False,
            "code": exc.code,
            "error": str(exc),
            "elapsed_s": time.monotonic() - t0,
        }


def parse_call(argv: list[str]) -> tuple[str, int, list[int]] | None:
    """OP, the lock's timeout (ms) and the PIDs of `OP [--lock-timeout-ms N] PID...`; None
    when it is not such a call."""
    timeout = "10000"
    if len(argv) >= 3 and argv[1] == "--lock-timeout-ms":
        timeout, argv = argv[2], [argv[0], *argv[3:]]
    if len(argv) < 2 or argv[0] not in ("probe", "state", "checkpoint", "restore"):
        return None
    try:
        return argv[0], int(timeout), [int(p) for p in argv[1:]]
    except ValueError:
        return None


Loaded = Driver | DriverError | None


def warm(stdin: Any) -> tuple[list[str], Loaded, float, float] | None:
    """`--warm`: the driver loaded and cuInit run now, then one call read from `stdin` as
    `OP LOCK_TIMEOUT_MS PID...`: that call's words, the driver (or its loading's error), the
    seconds the loading took and the seconds from its end to the call's line (about 0: the
    call waited for the loading). The fake is made at the call (its files are read then).
    None at EOF: the sidecar closed this spare, or is gone."""
    t0 = time.monotonic()
    loaded: Loaded = None
    if not os.environ.get("HOTSWAP_CUDACKPT_FAKE"):
        try:
            loaded = CudaDriver()
            loaded.nvml()  # NVML's start too, off the call's path
        except DriverError as exc:
            loaded = exc
    init_s = time.monotonic() - t0
    ready = time.monotonic()
    words = stdin.readline().split()
    if not words:
        return None
    argv = [words[0], "--lock-timeout-ms", *words[1:]] if len(words) >= 2 else words
    return argv, loaded, init_s, time.monotonic() - ready


def main(argv: list[str]) -> int:
    loaded: Loaded = None
    init_s: float | None = None
    idle_s: float | None = None
    if argv == ["--warm"]:
        got = warm(sys.stdin)
        if got is None:
            return 0
        argv, loaded, init_s, idle_s = got
    call = parse_call(argv)
    if call is None:
        print(USAGE, file=sys.stderr)
        return 2
    op, timeout_ms, pids = call
    result = run(op, pids, timeout_ms, loaded, init_s)
    if idle_s is not None:
        result["idle_s"] = idle_s  # warm: how long it waited for its call
    result["pids"] = {str(k): v for k, v in result.get("pids", {}).items()}
    # flushed now: stdout is a pipe (block-buffered unless PYTHONUNBUFFERED is set), and the
    # sidecar reads this line without waiting for the exit (the interpreter's and libcuda's
    # teardown after it)
    print(json.dumps(result), flush=True)
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
