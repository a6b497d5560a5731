"""What the CUDA driver's process checkpoint and restore cost depends on, one part at a time.

    python3 -m benchmarks.ckptcost [--configs base,stack16,...] [--cycles 2] [--budget-s 120]

Runs on the lent device (torch from the vLLM bundle). Each config is a child process that
holds a CUDA context and one part more: device memory in one allocation or many, a raised or
shrunk per-thread stack (`cuCtxSetLimit(CU_LIMIT_STACK_SIZE)`: the context's local-memory
reserve is the stack times every thread the device holds), CUDA graphs (how many, how many
kernel nodes each), pinned host memory (`cudaHostRegister` of touched pages, as a sleeper's
host copy of its weights) or device address space reserved with nothing mapped
(`cuMemAddressReserve`, as a sleeper's released pools). The children start at once (this
process never touches CUDA: the driver is called through the sidecar's own helper,
`controller.engines.cudackpt`, one spawn per call as the sidecar does). Per config and
cycle, one after the other: NVML's device bytes of the child, the helper's checkpoint (its
`elapsed_s`: the driver's calls alone), the bytes after, the restore, then the child replays
its graphs and checks the result. Prints a JSON line per config and cycle and writes
$OUT/ckptcost.jsonl.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import logger

log = logger("ckptcost")

# name: (MiB in one allocation, allocations it is split into, stack bytes or 0, graphs, nodes,
# MiB of pinned host memory, GiB of device address space reserved with nothing mapped)
CONFIGS: dict[str, tuple[int, int, int, int, int, int, int]] = {  # the most telling first
    "base": (0, 0, 0, 0, 0, 0, 0),
    "stack16": (0, 0, 16, 0, 0, 0, 0),
    "g1000x10": (0, 0, 0, 1000, 10, 0, 0),
    "mem1g": (1024, 1, 0, 0, 0, 0, 0),
    "stack4k": (0, 0, 4096, 0, 0, 0, 0),
    "g2000x10": (0, 0, 0, 2000, 10, 0, 0),
    "mem1g_x512": (1024, 512, 0, 0, 0, 0, 0),
    "g100x300": (0, 0, 0, 100, 300, 0, 0),
    "g1000x10_stack16": (0, 0, 16, 1000, 10, 0, 0),
    "g100x10": (0, 0, 0, 100, 10, 0, 0),
    "stack16_pin4g": (0, 0, 16, 0, 0, 4096, 0),
    "stack16_pin8g": (0, 0, 16, 0, 0, 8192, 0),
    "stack16_va64g": (0, 0, 16, 0, 0, 0, 64),
}


def _hold_host_and_address_space(pin_mib: int, va_gib: int, cu: Any) -> list[Any]:
    """Pinned host pages (touched, then registered) and reserved device address space."""
    import torch

    held: list[Any] = []
    if pin_mib:
        host = torch.ones(pin_mib << 20, dtype=torch.uint8)  # every page touched
        rc = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), host.numel(), 0)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister: {rc}")
        held.append(host)
    if va_gib:
        ptr = ctypes.c_uint64()
        size, align = ctypes.c_size_t(va_gib << 30), ctypes.c_size_t(2 << 20)
        rc = cu.cuMemAddressReserve(ctypes.byref(ptr), size, align, ctypes.c_uint64(0), 0)
        if rc != 0:
            raise RuntimeError(f"cuMemAddressReserve: {rc}")
        held.append(ptr.value)
    return held


def child(
    mib: int, allocs: int, stack: int, graphs: int, nodes: int, pin_mib: int = 0, va_gib: int = 0
) -> None:
    """Hold a context and the config's part, say ready, wait for a line per cycle
    ("check": replay, answer), end at EOF."""
    import torch

    dev = torch.device("cuda")
    base = torch.ones(4 << 20, dtype=torch.float32, device=dev)  # the context + 16 MiB
    cu = ctypes.CDLL("libcuda.so.1")
    held = []
    for _ in range(allocs):
        ptr = ctypes.c_uint64()
        rc = cu.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t((mib << 20) // allocs))
        if rc != 0:
            raise RuntimeError(f"cuMemAlloc_v2: {rc}")
        held.append(ptr.value)
    held.extend(_hold_host_and_address_space(pin_mib, va_gib, cu))
    made = []
    y = torch.zeros(1024, device=dev)
    if graphs:
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            y.add_(1)  # the eager warm-up before capture
        torch.cuda.current_stream().wait_stream(s)
        torch.cuda.synchronize()
        pool = torch.cuda.graph_pool_handle()
        for _ in range(graphs):
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                for _ in range(nodes):
                    y.add_(1)
            made.append(g)
    if stack:
        rc = cu.cuCtxSetLimit(0, ctypes.c_size_t(stack))  # CU_LIMIT_STACK_SIZE
        if rc != 0:
            raise RuntimeError(f"cuCtxSetLimit: {rc}")
    torch.cuda.synchronize()
    y.zero_()
    print(json.dumps({"ready": True, "pid": os.getpid()}), flush=True)
    while sys.stdin.readline():
        y.zero_()
        for g in made:
            g.replay()
        total = float((base.sum() + y[0]).item())
        want = float(base.numel() + len(made) * nodes)
        print(json.dumps({"ok": total == want, "got": total, "want": want}), flush=True)


def helper(op: str, pid: int) -> dict[str, Any]:
    """One call of the sidecar's helper, spawned for it (timed from the spawn)."""
    t = time.monotonic()
    argv = [sys.executable, "-S", "-m", "controller.engines.cudackpt", op, str(pid)]
    p = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    try:
        out: dict[str, Any] = json.loads(p.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        out = {"ok": False, "error": (p.stdout + p.stderr)[-2000:]}
    out["call_s"] = time.monotonic() - t
    return out


def pid_bytes(answer: dict[str, Any], pid: int) -> Any:
    return (answer.get("pids") or {}).get(str(pid), {}).get("bytes")


def one_cycle(name: str, proc: subprocess.Popen[str], cycle: int) -> dict[str, Any]:
    pid = proc.pid
    before = helper("probe", pid)
    ck = helper("checkpoint", pid)
    row: dict[str, Any] = {
        "config": name,
        "cycle": cycle,
        "bytes": pid_bytes(before, pid),
        "checkpoint_ok": ck.get("ok"),
        "checkpoint_s": ck.get("elapsed_s"),
        "checkpoint_call_s": ck.get("call_s"),
        "bytes_after": pid_bytes(ck, pid),
    }
    if not ck.get("ok"):
        row["error"] = ck.get("error")
        return row
    rs = helper("restore", pid)
    row.update(
        restore_ok=rs.get("ok"), restore_s=rs.get("elapsed_s"), restore_call_s=rs.get("call_s")
    )
    if not rs.get("ok"):
        row["error"] = rs.get("error")
        return row
    assert proc.stdin is not None
    assert proc.stdout is not None
    t = time.monotonic()
    proc.stdin.write("check\n")
    proc.stdin.flush()
    row["check"] = json.loads(proc.stdout.readline() or "{}")
    row["first_work_s"] = time.monotonic() - t  # the child's replay and read after the restore
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument("--budget-s", type=float, default=120.0)
    args = ap.parse_args()
    deadline = time.monotonic() + args.budget_s
    names = [n for n in args.configs.split(",") if n]
    procs: dict[str, subprocess.Popen[str]] = {}
    dest = Path(os.environ.get("OUT", ".")) / "ckptcost.jsonl"
    try:
        for n in names:
            argv = [sys.executable, "-m", "benchmarks.ckptcost", "child", *map(str, CONFIGS[n])]
            procs[n] = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
        for n, p in procs.items():
            assert p.stdout is not None
            line = p.stdout.readline()
            log(n, "child", line.strip() or f"exited {p.poll()}")
        for n, p in procs.items():
            for c in range(args.cycles):
                if time.monotonic() > deadline or p.poll() is not None:
                    log(n, "skipped: out of time or the child is gone")
                    break
                row = one_cycle(n, p, c)
                print(json.dumps(row), flush=True)
                with dest.open("a") as f:
                    f.write(json.dumps(row) + "\n")
            if p.stdin is not None:
                p.stdin.close()  # the child ends, its device memory goes before the next
            p.wait(30)
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()


if __name__ == "__main__":
    if len(sys.argv) == 9 and sys.argv[1] == "child":
        child(*(int(a) for a in sys.argv[2:]))
    else:
        main()
