"""Does a woken model's KV cache pay the driver's scrub of the memory a victim just released,
and would importing the victim's physical memory avoid it? (issue 31)

    python3 -m benchmarks.kvreuse [--gib 100] [--records 34] [--cases d,a,a_wait,c,b,b_after]

Not a pytest module. The parent never calls cuInit: each case spawns fresh processes (a
victim and a woken model), each with its own CUDA context, driving the driver's VMM calls
through ctypes (worker_ext.cudriver, the handle types the backend asks for), the memory cut
into `--records` equal records like a KV pool (one reserved range, so one memset touches
all of it). Times are host-side, per step, with CLOCK_MONOTONIC stamps comparable across
the processes. Cases:

- d: a fresh process creates, maps, sets access and touches (memset) the memory, no
  release before it in this run (the floor; run first);
- a: the victim creates, maps, touches and releases it; then the woken one creates, maps,
  sets access, touches it twice (a first touch slower than the second: the scrub is lazy);
- a_wait: as a, the woken one starting `--wait-s` after the release ended;
- c: as a, but the woken one starts creating as the victim's release starts (a create
  refused for memory is retried until it fits, counted);
- b: the victim's records made with a POSIX file descriptor handle, exported, the fds
  passed over a Unix socket (socket.send_fds), the victim releases its handles, then the
  woken one imports, maps, sets access and touches them;
- b_after: as b, but the victim releases after the woken one has imported;
- d_late: as d, at the end of the run (what a late create pays once the releases settled).

One JSON line per case on stdout and in $OUT/kvreuse.json (--out). `--driver fake` runs
the same processes and protocol with no CUDA (the tests' CPU check).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import socket
import subprocess
import sys
import time
from typing import Any

GiB = 1 << 30
CASES = ("d", "a", "a_wait", "c", "b", "b_after", "d_late")
_OOM = 2  # CUDA_ERROR_OUT_OF_MEMORY
_POSIX_FD = 1  # CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
_FABRIC = 8  # CU_MEM_HANDLE_TYPE_FABRIC
_REFUSED = (800, 801)  # CUDA_ERROR_NOT_PERMITTED, CUDA_ERROR_NOT_SUPPORTED
_MAX_MSG = 1 << 16


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="benchmarks.kvreuse", description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=100.0, help="memory per case (GiB)")
    ap.add_argument("--records", type=int, default=34, help="records it is cut into")
    ap.add_argument("--cases", default=",".join(CASES), help="comma-separated, in order")
    ap.add_argument("--wait-s", type=float, default=1.0, help="a_wait's pause after release")
    ap.add_argument(
        "--leave-gib", type=float, default=2.0,
        help="the woken one first holds all free memory but this much (< 0: not)",
    )  # fmt: skip
    ap.add_argument("--settle-s", type=float, default=0.5, help="pause between cases")
    ap.add_argument("--device", type=int, default=0)
    ap.add_argument("--driver", choices=("cuda", "fake"), default="cuda")
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for kvreuse.json")
    ap.add_argument("--child", type=int, default=-1, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    cases = [c for c in args.cases.split(",") if c]
    bad = [c for c in cases if c not in CASES]
    if bad or not cases:
        ap.error(f"--cases: unknown {bad or 'none given'}; known: {','.join(CASES)}")
    if args.records < 1 or args.gib <= 0:
        ap.error("--records must be >= 1 and --gib > 0")
    args.case_list = cases
    return args


# -- the child: one CUDA context, driven by JSON messages over a SEQPACKET socket ----------


class Cuda:
    """The driver calls one child makes (ctypes on libcuda; worker_ext.cudriver's Driver)."""

    def __init__(self, device: int) -> None:
        from worker_ext.cudriver import Driver

        self.lib = ctypes.CDLL("libcuda.so.1")
        self._ok(self.lib.cuInit(0), "cuInit")
        dev, ctx = ctypes.c_int(), ctypes.c_void_p()
        self._ok(self.lib.cuDeviceGet(ctypes.byref(dev), device), "cuDeviceGet")
        self._ok(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuCtxRetain")
        self._ok(self.lib.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
        self.drv = Driver(device, lib=self.lib)
        self.granularity = self.drv.granularity

    @staticmethod
    def _ok(err: int, what: str) -> None:
        if err != 0:
            raise RuntimeError(f"{what}: CUresult {err}")

    def handle_type(self) -> str:
        return self.drv.handle_type

    def posix_fd(self) -> None:
        self.drv.prop.requestedHandleTypes = _POSIX_FD

    def reserve(self, n: int) -> int:
        return self.drv.reserve(n)

    def create(self, n: int) -> tuple[int, int]:
        """(handle, CUresult): a refusal is returned, not raised (the OOM retry)."""
        h = ctypes.c_uint64()
        prop = self.drv.prop
        err = self.lib.cuMemCreate(
            ctypes.byref(h), ctypes.c_size_t(n), ctypes.byref(prop), ctypes.c_uint64(0)
        )
        if err in _REFUSED and prop.requestedHandleTypes == _FABRIC:  # as the backend's Driver
            prop.requestedHandleTypes = _POSIX_FD
            self.drv.fabric_refused = True
            return self.create(n)
        return h.value, err

    def map(self, ptr: int, n: int, h: int) -> None:
        self.drv.map(ptr, n, h)

    def access(self, ptr: int, n: int) -> None:
        self.drv.set_access(ptr, n)

    def unmap(self, ptr: int, n: int) -> None:
        self.drv.unmap(ptr, n)

    def release(self, h: int) -> None:
        self.drv.release(h)

    def touch(self, ptr: int, n: int) -> None:
        self._ok(
            self.lib.cuMemsetD32_v2(ctypes.c_uint64(ptr), 0x3F80, ctypes.c_size_t(n // 4)), "memset"
        )
        self._ok(self.lib.cuCtxSynchronize(), "cuCtxSynchronize")

    def export(self, h: int) -> int:
        fd = ctypes.c_int(-1)
        err = self.lib.cuMemExportToShareableHandle(
            ctypes.byref(fd), ctypes.c_uint64(h), _POSIX_FD, ctypes.c_uint64(0)
        )
        self._ok(err, "cuMemExportToShareableHandle")
        return fd.value

    def import_fd(self, fd: int) -> int:
        h = ctypes.c_uint64()
        err = self.lib.cuMemImportFromShareableHandle(
            ctypes.byref(h), ctypes.c_void_p(fd), _POSIX_FD
        )
        self._ok(err, "cuMemImportFromShareableHandle")
        return h.value

    def free_bytes(self) -> int:
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        self._ok(self.lib.cuMemGetInfo_v2(ctypes.byref(free), ctypes.byref(total)), "cuMemGetInfo")
        return free.value


class Fake:
    """The same calls with no device: addresses and handles count up, exports are real
    file descriptors (so the fd passing is exercised)."""

    granularity = 2 << 20

    def __init__(self, device: int) -> None:
        self._next = 1
        self._fd_type = False

    def _id(self) -> int:
        self._next += 1
        return self._next

    def handle_type(self) -> str:
        return "posix_fd" if self._fd_type else "fake"

    def posix_fd(self) -> None:
        self._fd_type = True

    def reserve(self, n: int) -> int:
        return self._id() << 40

    def create(self, n: int) -> tuple[int, int]:
        return self._id(), 0

    def map(self, ptr: int, n: int, h: int) -> None: ...
    def access(self, ptr: int, n: int) -> None: ...
    def unmap(self, ptr: int, n: int) -> None: ...
    def release(self, h: int) -> None: ...
    def touch(self, ptr: int, n: int) -> None: ...

    def export(self, h: int) -> int:
        return os.open(os.devnull, os.O_RDONLY)

    def import_fd(self, fd: int) -> int:
        return self._id()

    def free_bytes(self) -> int:
        return 0


class Child:
    """One process's memory: a reserved range, its records' handles, mapped or not."""

    def __init__(self, cu: Any, nbytes: float, records: int) -> None:
        g = cu.granularity
        self.cu = cu
        self.rec = (int(nbytes) // records + g - 1) // g * g
        self.n = records
        self.base = cu.reserve(self.rec * records)
        self.handles: list[int] = []
        self.ballast_handles: list[int] = []
        self.mapped = 0

    def ptr(self, i: int) -> int:
        return int(self.base + i * self.rec)

    def create(self, retry_s: float = 0.0) -> dict[str, Any]:
        t0, retries, out = time.monotonic(), 0, {}
        for _ in range(self.n):
            while True:
                h, err = self.cu.create(self.rec)
                if err == 0:
                    break
                if err != _OOM or time.monotonic() - t0 > retry_s:
                    raise RuntimeError(f"cuMemCreate: CUresult {err}")
                retries += 1
            self.handles.append(h)
        out["create_s"] = time.monotonic() - t0
        out["oom_retries"] = retries
        return {**out, **self.map_all(), "t_create0": t0}

    def map_all(self) -> dict[str, Any]:
        t0 = time.monotonic()
        for i, h in enumerate(self.handles):
            self.cu.map(self.ptr(i), self.rec, h)
        t1 = time.monotonic()
        for i in range(len(self.handles)):
            self.cu.access(self.ptr(i), self.rec)
        self.mapped = len(self.handles)
        t2 = time.monotonic()
        return {"map_s": t1 - t0, "access_s": t2 - t1, "t_mapped": t2}

    def touch(self) -> dict[str, Any]:
        t0 = time.monotonic()
        self.cu.touch(self.base, self.rec * self.mapped)
        t1 = time.monotonic()
        return {"touch_s": t1 - t0, "touch_gbps": self.rec * self.mapped / 1e9 / max(t1 - t0, 1e-9)}

    def release(self) -> dict[str, Any]:
        t0 = time.monotonic()
        for i in range(self.mapped):
            self.cu.unmap(self.ptr(i), self.rec)
        t1 = time.monotonic()
        for h in self.handles:
            self.cu.release(h)
        t2 = time.monotonic()
        self.handles, self.mapped = [], 0
        return {"unmap_s": t1 - t0, "release_s": t2 - t1, "t_release0": t0, "t_released": t2}

    def ballast(self, leave: int) -> dict[str, Any]:
        """Hold (created, never mapped) all free device memory but `leave` bytes, so what
        this process creates next must come from memory another one releases."""
        held, step = 0, 1 << 30
        while self.cu.free_bytes() - step >= leave:
            h, err = self.cu.create(step)
            if err != 0:
                break
            self.ballast_handles.append(h)
            held += step
        return {"ballast_bytes": held, "free_after_ballast": self.cu.free_bytes()}

    def export(self) -> tuple[dict[str, Any], list[int]]:
        t0 = time.monotonic()
        fds = [self.cu.export(h) for h in self.handles]
        return {"export_s": time.monotonic() - t0}, fds

    def import_fds(self, fds: list[int]) -> dict[str, Any]:
        t0 = time.monotonic()
        self.handles = [self.cu.import_fd(fd) for fd in fds]
        for fd in fds:
            os.close(fd)
        t1 = time.monotonic()
        return {"import_s": t1 - t0, **self.map_all()}


def _send(sock: socket.socket, msg: dict[str, Any], fds: list[int] | None = None) -> None:
    socket.send_fds(sock, [json.dumps(msg).encode()], fds or [])


def _recv(sock: socket.socket, maxfds: int = 0) -> tuple[dict[str, Any], list[int]]:
    data, fds, _flags, _addr = socket.recv_fds(sock, _MAX_MSG, maxfds)
    if not data:
        raise EOFError("the other end closed")
    return json.loads(data), list(fds)


def child_main(args: argparse.Namespace) -> int:
    sock = socket.socket(fileno=args.child)
    t0 = time.monotonic()
    try:
        cu = (Fake if args.driver == "fake" else Cuda)(args.device)
        mem = Child(cu, args.gib * GiB, args.records)
        _send(sock, {"ok": True, "init_s": time.monotonic() - t0, "record_bytes": mem.rec})
    except Exception as e:  # the parent reports it in the case's line
        _send(sock, {"ok": False, "error": repr(e)})
        return 1
    while True:
        try:
            msg, fds = _recv(sock, args.records)
        except EOFError:
            return 0
        op = msg["op"]
        try:
            reply, out_fds = _do(cu, mem, op, msg, fds)
            reply["ok"] = True
        except Exception as e:
            reply, out_fds = {"ok": False, "error": f"{op}: {e!r}"}, []
        _send(sock, reply, out_fds)
        for fd in out_fds:
            os.close(fd)
        if op == "exit":
            return 0


def _do(
    cu: Any, mem: Child, op: str, msg: dict[str, Any], fds: list[int]
) -> tuple[dict[str, Any], list[int]]:
    if op == "create":
        if msg.get("posix_fd"):
            cu.posix_fd()
        return {**mem.create(float(msg.get("retry_s", 0.0))), "handle_type": cu.handle_type()}, []
    if op == "touch":
        return mem.touch(), []
    if op == "release":
        return mem.release(), []
    if op == "export":
        return mem.export()
    if op == "import":
        return mem.import_fds(fds), []
    if op == "ballast":
        return mem.ballast(int(msg["leave"])), []
    if op == "free":
        return {"free_bytes": cu.free_bytes()}, []
    if op == "exit":
        return {}, []
    raise ValueError(f"unknown op {op!r}")


# -- the parent: no CUDA, spawns the children and runs the cases --------------------------


class Proc:
    """A child process and the parent's end of its socket."""

    def __init__(self, args: argparse.Namespace) -> None:
        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        argv = [sys.executable, "-m", "benchmarks.kvreuse", "--child", str(theirs.fileno())]
        argv += ["--gib", str(args.gib), "--records", str(args.records)]
        argv += ["--device", str(args.device), "--driver", args.driver]
        self.p = subprocess.Popen(argv, pass_fds=[theirs.fileno()])
        theirs.close()
        self.sock = mine
        self.sock.settimeout(120)
        self.hello, _ = _recv(self.sock)
        if not self.hello.get("ok"):
            raise RuntimeError(f"child start: {self.hello.get('error')}")

    def send(self, op: str, fds: list[int] | None = None, **kw: Any) -> None:
        _send(self.sock, {"op": op, **kw}, fds)

    def recv(self, maxfds: int = 0) -> tuple[dict[str, Any], list[int]]:
        reply, fds = _recv(self.sock, maxfds)
        if not reply.get("ok"):
            raise RuntimeError(str(reply.get("error")))
        return reply, fds

    def call(
        self, op: str, fds: list[int] | None = None, maxfds: int = 0, **kw: Any
    ) -> dict[str, Any]:
        self.send(op, fds, **kw)
        return self.recv(maxfds)[0]

    def close(self) -> None:
        with contextlib.suppress(OSError, RuntimeError, EOFError):
            self.call("exit")
        self.sock.close()
        try:
            self.p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.p.kill()
            self.p.wait()


def _touches(w: Proc) -> dict[str, Any]:
    first, second = w.call("touch"), w.call("touch")
    return {"touch1_s": first["touch_s"], "touch2_s": second["touch_s"],
            "touch1_gbps": first["touch_gbps"], "touch2_gbps": second["touch_gbps"]}  # fmt: skip


def _woken(args: argparse.Namespace) -> tuple[Proc, dict[str, Any]]:
    """The woken process, holding every free byte but --leave-gib (no ballast when < 0)."""
    w = Proc(args)
    if args.leave_gib < 0:
        return w, {}
    return w, w.call("ballast", leave=int(args.leave_gib * GiB))


def case_d(args: argparse.Namespace) -> dict[str, Any]:
    w = Proc(args)
    try:
        return {"woken": {**w.call("create"), **_touches(w)}}
    finally:
        w.close()


def _victim_up(args: argparse.Namespace, posix_fd: bool = False) -> tuple[Proc, dict[str, Any]]:
    v = Proc(args)
    made = v.call("create", posix_fd=posix_fd)
    made.update(v.call("touch"))
    return v, made


def case_a(args: argparse.Namespace, wait_s: float = 0.0) -> dict[str, Any]:
    v, made = _victim_up(args)
    w, held = _woken(args)
    try:
        rel = v.call("release")
        time.sleep(wait_s)
        woke = w.call("create", retry_s=10.0)
        woke["after_release_s"] = woke["t_create0"] - rel["t_released"]
        return {"victim": {**made, **rel}, "woken": {**woke, **held, **_touches(w)}}
    finally:
        v.close()
        w.close()


def case_c(args: argparse.Namespace) -> dict[str, Any]:
    """The woken one creates while the victim's release is under way (both sent at once)."""
    v, made = _victim_up(args)
    w, held = _woken(args)
    try:
        v.send("release")
        w.send("create", retry_s=10.0)
        rel, _ = v.recv()
        woke, _ = w.recv()
        woke["after_release_s"] = woke["t_create0"] - rel["t_released"]
        woke["created_after_release_end_s"] = (
            woke["t_create0"] + woke["create_s"] - rel["t_released"]
        )
        return {"victim": {**made, **rel}, "woken": {**woke, **held, **_touches(w)}}
    finally:
        v.close()
        w.close()


def case_b(args: argparse.Namespace, release_first: bool = True) -> dict[str, Any]:
    """The victim's physical memory handed over as POSIX fds."""
    v, made = _victim_up(args, posix_fd=True)
    w, held = _woken(args)
    try:
        v.send("export")
        exp, fds = v.recv(args.records)
        exp["fds"] = len(fds)
        rel: dict[str, Any] = {}
        if release_first:
            rel = v.call("release")
        t0 = time.monotonic()
        woke = w.call("import", fds=fds)
        for fd in fds:
            os.close(fd)
        woke["import_map_access_s"] = woke["t_mapped"] - t0
        if not release_first:
            rel = v.call("release")
        return {"victim": {**made, **exp, **rel}, "woken": {**woke, **held, **_touches(w)}}
    finally:
        v.close()
        w.close()


def run_case(name: str, args: argparse.Namespace) -> dict[str, Any]:
    runs = {
        "d": lambda: case_d(args),
        "d_late": lambda: case_d(args),
        "a": lambda: case_a(args),
        "a_wait": lambda: case_a(args, args.wait_s),
        "c": lambda: case_c(args),
        "b": lambda: case_b(args, True),
        "b_after": lambda: case_b(args, False),
    }
    t0 = time.monotonic()
    line: dict[str, Any] = {
        "bench": "kvreuse",
        "case": name,
        "gib": args.gib,
        "records": args.records,
    }
    try:
        line.update(runs[name]())
        line["ok"] = True
    except Exception as e:  # one case's failure is its line; the others still run
        line.update(ok=False, error=repr(e))
    line["wall_s"] = time.monotonic() - t0
    return line


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child >= 0:
        return child_main(args)
    out = open(os.path.join(args.out, "kvreuse.json"), "a") if args.out else None  # noqa: SIM115
    try:
        for i, name in enumerate(args.case_list):
            if i:
                time.sleep(args.settle_s)
            line = run_case(name, args)
            line["date"] = time.strftime("%Y-%m-%d %H:%M:%S %Z")
            text = json.dumps(line, sort_keys=True)
            print(text, flush=True)
            if out is not None:
                out.write(text + "\n")
                out.flush()
    finally:
        if out is not None:
            out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
