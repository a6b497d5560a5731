"""Why a coded wake's host-to-device copies run below the link: a torch-only micro-bench.

Needs torch with CUDA and Triton only (no vLLM): `python3 -m benchmarks.h2d --out DIR`.
Realistic bf16 tensors (benchmarks/realweights.py, an 8B layer's shapes) are coded by
worker_ext.codec into the pieces a level-1 sleep makes; their coded bytes are then copied
from the host into the device by every combination of

- host memory: torch's pinned tensor (cudaHostAlloc), cudaHostAlloc itself (also
  write-combined), worker_ext.cudart.HostBuffer as the cumem backend makes it (anonymous
  mmap, huge pages asked for, touched and cudaHostRegister'ed in REGISTER_BYTES pieces by
  the tuning's pin_threads threads) and its variants (one thread, no huge pages, one
  registration of the whole buffer, threads bound to the GPU's NUMA node);
- copy pattern: the raw path's (cumem `_queue`: CHUNK_BYTES copies round-robin on two
  streams, or one), the coded pieces into staging slots (one or two streams), into one
  contiguous destination, fixed copy sizes, with a busy kernel beside them, and the real
  codec.WakeQueue (decode included, one or two copy streams, 32- or 64-chunk pieces);

each timed on the GPU (CUDA events, the streams held by a sleep kernel until everything is
queued, so the CPU's queueing is not in the time) and as wall time. The wakes are checked
bit-exact against the original tensors. Then the level-2 disk tier's warm read: the coded
bytes as one file in the page cache, read by parallel preads (threads x read size) into a
pinned buffer, and the file's pages mapped and registered for DMA straight from the page
cache. Every result goes to OUT/h2d.json as it is measured.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from benchmarks.codec import make_tensors
from worker_ext import codec, cudart

GB = 1e9
MiB = 1 << 20
CHUNK = cudart.CHUNK_BYTES  # divides REGISTER_BYTES: a copy cut at it spans no registration
_HOST_ALLOC_PORTABLE = 1
_HOST_ALLOC_WRITE_COMBINED = 4
_REGISTER_READ_ONLY = 8


class Bench:
    def __init__(self, out: Path, reps: int) -> None:
        self.out = out
        self.reps = reps
        self.rt = cudart.CudaRT()
        lib = self.rt._lib
        lib.cudaHostAlloc.argtypes = [
            ctypes.POINTER(ctypes.c_void_p),
            ctypes.c_size_t,
            ctypes.c_uint,
        ]
        lib.cudaHostAlloc.restype = ctypes.c_int
        lib.cudaFreeHost.argtypes = [ctypes.c_void_p]
        lib.cudaFreeHost.restype = ctypes.c_int
        self.lib = lib
        self.report: dict[str, Any] = {
            "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
            "device": torch.cuda.get_device_name(0),
            "torch": torch.__version__,
            "results": {},
        }
        self.s = [torch.cuda.Stream() for _ in range(3)]
        self.gate = torch.cuda.Stream()

    def save(self) -> None:
        (self.out / "h2d.json").write_text(json.dumps(self.report, indent=1))

    def put(self, key: str, value: Any) -> None:
        self.report["results"][key] = value
        self.save()
        print(key, json.dumps(value)[:400], flush=True)

    # timing ---------------------------------------------------------------------------

    def timed(
        self,
        queue: Callable[[list[Any]], None],
        nbytes: int,
        streams: int = 2,
        measured: int | None = None,
        gate: int = 60_000_000,
    ) -> dict[str, Any]:
        """GPU seconds of what `queue(streams)` puts on the streams (to the last end of the
        first `measured` of them), held behind a sleep kernel until all of it is queued;
        best and median of reps, and wall time."""
        gpu, wall = [], []
        use = self.s[:streams]
        for _ in range(self.reps):
            torch.cuda.synchronize()
            with torch.cuda.stream(self.gate):
                torch.cuda._sleep(gate)  # 30 ms at 2 GHz: the queueing ends before it
            start = torch.cuda.Event(enable_timing=True)
            start.record(self.gate)
            for s in use:
                s.wait_event(start)
            t = time.perf_counter()
            queue(use)
            ends = [s.record_event(torch.cuda.Event(enable_timing=True)) for s in use]
            torch.cuda.synchronize()
            wall.append(time.perf_counter() - t)
            gpu.append(max(start.elapsed_time(e) for e in ends[:measured]) / 1000.0)
        best = min(gpu)
        return {
            "gpu_s": round(best, 5),
            "gpu_s_median": round(statistics.median(gpu), 5),
            "gbps": round(nbytes / best / GB, 2),
            "wall_s": round(min(wall), 5),  # queueing to the end (gate included)
            "gate_s": gate / 2e9,
        }

    # host memory ---------------------------------------------------------------------

    def host_alloc(self, n: int, flags: int) -> tuple[int, Callable[[], None]]:
        p = ctypes.c_void_p()
        self.rt.check(self.lib.cudaHostAlloc(ctypes.byref(p), n, flags), "cudaHostAlloc")
        ptr = int(p.value or 0)
        return ptr, lambda: self.rt.check(self.lib.cudaFreeHost(ptr), "cudaFreeHost")

    def host_buffer(
        self, n: int, threads: int, advice: int | None = None, whole: bool = False, cpus: Any = None
    ) -> tuple[int, Callable[[], None], int]:
        saved = (cudart._MADV_HUGEPAGE, cudart.REGISTER_BYTES)
        if advice is not None:
            cudart._MADV_HUGEPAGE = advice
        cut = cudart.REGISTER_BYTES
        if whole:
            cut = cudart.REGISTER_BYTES = max(n, 1)
        mask = os.sched_getaffinity(0)
        try:
            if cpus:
                os.sched_setaffinity(0, cpus)  # threads started now inherit it
            buf = cudart.HostBuffer(n, self.rt, 0)
            buf.pin(threads)
        finally:
            os.sched_setaffinity(0, mask)
            cudart._MADV_HUGEPAGE, cudart.REGISTER_BYTES = saved
        return buf.ptr, buf.free, cut


def topology() -> dict[str, Any]:
    info: dict[str, Any] = {"cpus": os.cpu_count()}
    try:
        nodes = sorted(p.name for p in Path("/sys/devices/system/node").glob("node[0-9]*"))
        info["numa_nodes"] = {
            n: Path(f"/sys/devices/system/node/{n}/cpulist").read_text().strip() for n in nodes
        }
    except Exception as e:
        info["numa_nodes"] = repr(e)
    for f in ("enabled", "defrag"):
        try:
            info[f"thp_{f}"] = Path(f"/sys/kernel/mm/transparent_hugepage/{f}").read_text().strip()
        except Exception as e:
            info[f"thp_{f}"] = repr(e)
    try:
        bus = torch.cuda.get_device_properties(0).pci_bus_id
    except Exception:
        bus = None
    try:
        import subprocess

        q = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=pci.bus_id,pcie.link.gen.current,pcie.link.gen.max,pcie.link.width.current",
                "--format=csv,noheader",
            ],
            capture_output=True,
            text=True,
            timeout=20,
        )
        info["pcie"] = q.stdout.strip()
        bus = bus or q.stdout.split(",")[0].strip()
    except Exception as e:
        info["pcie"] = repr(e)
    if bus:
        for dom in (bus.lower(), bus.lower()[4:]):
            base = Path("/sys/bus/pci/devices") / dom
            if base.exists():
                for f in ("numa_node", "local_cpulist"):
                    try:
                        info[f"gpu_{f}"] = (base / f).read_text().strip()
                    except Exception as e:
                        info[f"gpu_{f}"] = repr(e)
                break
    props = torch.cuda.get_device_properties(0)
    info["async_engines"] = getattr(props, "async_engine_count", None)
    for k in ("MemTotal", "MemAvailable", "AnonHugePages", "Hugepagesize"):
        try:
            for line in Path("/proc/meminfo").read_text().splitlines():
                if line.startswith(k + ":"):
                    info[k] = line.split(":", 1)[1].strip()
        except Exception:
            pass
    return info


def _cpulist(text: str) -> set[int]:
    out: set[int] = set()
    for part in text.split(","):
        if "-" in part:
            a, b = part.split("-")
            out.update(range(int(a), int(b) + 1))
        elif part.strip():
            out.add(int(part))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="h2d-bench")
    ap.add_argument("--gib", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument(
        "--hosts",
        default="torch,hostalloc,hostalloc_wc,hostbuffer,hostbuffer_1t,hostbuffer_nothp,hostbuffer_whole,hostbuffer_local",
    )
    ap.add_argument("--disk-dir", default="")
    ap.add_argument("--engine", type=int, default=0, help="1: the engine-like wakes")
    ap.add_argument("--engine-free-gib", type=float, default=40.0)
    ap.add_argument("--big-host-gib", type=float, default=0.0)
    ap.add_argument("--pieces64", type=int, default=1, help="1: the 64-chunk pieces' wake")
    ap.add_argument("--budget-s", type=float, default=120.0)
    a = ap.parse_args()
    t_start = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    b = Bench(out, a.reps)
    b.put("topology", topology())
    left = lambda: a.budget_s - (time.perf_counter() - t_start)  # noqa: E731

    # the data: realistic bf16, coded as a level-1 sleep codes it
    t = time.perf_counter()
    tensors = make_tensors("realistic", a.gib, 1)
    ranges = [(x.data_ptr(), x.numel() * 2) for x in tensors]
    raw = sum(n for _, n in ranges)
    orig = [x.clone() for x in tensors]
    gc = codec.GpuCodec("cuda", piece_chunks=32, slots=4)
    plan = gc.plan(ranges)
    S = plan.total
    ref = torch.empty(S, dtype=torch.uint8, pin_memory=True)
    rp = ref.data_ptr()

    def ref_copy(off: int, dev: int, n: int, to_host: bool, stream: int) -> None:
        if to_host:
            b.rt.memcpy_async(rp + off, dev, n, stream)
        else:
            b.rt.memcpy_async(dev, rp + off, n, stream)

    torch.cuda.synchronize()  # the tensors were drawn on the default stream
    q = codec.SleepQueue(gc, plan, ref_copy, b.s[0], b.s[1])
    for p in plan.pieces:
        q.queue(p)
    torch.cuda.synchronize()
    sizes = [p.size for p in plan.pieces]
    b.put(
        "data",
        {
            "raw_bytes": raw,
            "coded_bytes": S,
            "ratio": round(S / raw, 4),
            "pieces": len(plan.pieces),
            "piece_mib_mean": round(statistics.mean(sizes) / MiB, 2),
            "piece_mib_max": round(max(sizes) / MiB, 2),
            "setup_s": round(time.perf_counter() - t, 2),
        },
    )
    big = torch.empty(S + (1 << 20), dtype=torch.uint8, device="cuda")
    bigp = big.data_ptr()
    slots = [x.data_ptr() for x in gc.slots(4)]
    busy_a = torch.empty(1 << 28, dtype=torch.float32, device="cuda")
    busy_b = torch.empty_like(busy_a)

    # the torch-pinned bound (as benchmarks.wake measures it): one 2 GiB copy
    dev2 = big[: 2 << 30]
    hb = torch.empty(2 << 30, dtype=torch.uint8, pin_memory=True)

    def bound(s: list[Any]) -> None:
        with torch.cuda.stream(s[0]):
            dev2.copy_(hb, non_blocking=True)

    b.put("bound_torch_2gib_1copy", b.timed(bound, 2 << 30, 1))

    gpu_cpus = None
    topo = b.report["results"]["topology"]
    if isinstance(topo.get("gpu_local_cpulist"), str) and topo["gpu_local_cpulist"][:1].isdigit():
        gpu_cpus = _cpulist(topo["gpu_local_cpulist"]) & os.sched_getaffinity(0)

    def cutter(host: int, cut: int) -> Callable[[int, int, int, int], None]:
        def copy(dst: int, off: int, n: int, stream: int) -> None:
            pos = 0
            while pos < n:
                o = off + pos
                m = min(n - pos, (o // cut + 1) * cut - o)
                b.rt.memcpy_async(dst + pos, host + o, m, stream)
                pos += m

        return copy

    def patterns(name: str, host: int, cut: int) -> None:
        cp = cutter(host, cut)
        res: dict[str, Any] = {}

        def run(
            label: str,
            fn: Callable[[list[Any]], None],
            nbytes: int,
            streams: int,
            gate: int = 60_000_000,
        ) -> None:
            try:
                res[label] = b.timed(fn, nbytes, streams, gate=gate)
            except Exception:
                res[label] = {"error": traceback.format_exc()[-600:]}

        def fixed(step: int) -> Callable[[list[Any]], None]:
            def go(s: list[Any]) -> None:
                for k, off in enumerate(range(0, S, step)):
                    cp(bigp + off, off, min(step, S - off), s[k % len(s)].cuda_stream)

            return go

        def pieces(nslots: int, dest: str) -> Callable[[list[Any]], None]:
            def go(s: list[Any]) -> None:
                for j, p in enumerate(plan.pieces):
                    dst = slots[j % nslots] if dest == "slots" else bigp + p.host_off
                    cp(dst, p.host_off, p.size, s[j % len(s)].cuda_stream)

            return go

        run("raw64_2streams", fixed(64 * MiB), S, 2)  # the raw path's _queue
        run("raw64_1stream", fixed(64 * MiB), S, 1)
        for mib in (8, 32, 128, 256):
            run(f"fixed{mib}_1stream", fixed(mib * MiB), S, 1)
        run("pieces_slots_1stream", pieces(2, "slots"), S, 1)  # the coded wake's copies
        run("pieces_slots_2streams", pieces(4, "slots"), S, 2)
        run("pieces_contig_1stream", pieces(2, "contig"), S, 1)

        def evented(s: list[Any]) -> None:  # the queue's events and waits, no decode
            done: list[Any] = [None, None]
            for j, p in enumerate(plan.pieces):
                if done[j % 2] is not None:
                    s[0].wait_event(done[j % 2])
                cp(slots[j % 2], p.host_off, p.size, s[0].cuda_stream)
                s[1].wait_event(s[0].record_event())
                done[j % 2] = s[1].record_event()

        run("pieces_slots_1stream_events", evented, S, 2)

        def busy(s: list[Any]) -> None:  # the coded copies with an HBM-bound kernel beside
            pieces(2, "slots")(s[:1])
            with torch.cuda.stream(s[1]):
                for _ in range(100):  # longer than the copies; only theirs is timed
                    torch.add(busy_a, 1.0, out=busy_b)

        try:
            res["pieces_slots_1stream_busy_kernel"] = b.timed(busy, S, 2, measured=1)
        except Exception:
            res["pieces_slots_1stream_busy_kernel"] = {"error": traceback.format_exc()[-600:]}

        def wake(nstreams: int, g: codec.GpuCodec, pl: codec.Plan) -> Callable[[list[Any]], None]:
            def copy(off: int, dev: int, n: int, to_host: bool, stream: int) -> None:
                cp(dev, off, n, stream)

            def go(s: list[Any]) -> None:
                wq = codec.WakeQueue(g, pl, copy, s[:nstreams], s[2])
                for p in pl.pieces:
                    wq.queue(p)

            return go

        for label, nst in (("wake_1stream", 1), ("wake_2streams", 2)):
            for x in tensors:
                x.zero_()
            gc.n_slots = 2 * nst  # as the backend holds them (2 slots a copy stream)
            run(label, wake(nst, gc, plan), S, 3, gate=150_000_000)
            ok = all(torch.equal(x, y) for x, y in zip(tensors, orig, strict=True))
            res[label]["exact"] = ok
        # profiled, as the backend's HOTSWAP codec_profile does
        try:

            def pcopy(off: int, dev: int, n: int, to_host: bool, stream: int) -> None:
                cp(dev, off, n, stream)

            torch.cuda.synchronize()
            gc.n_slots = 2
            wq = codec.WakeQueue(gc, plan, pcopy, b.s[0], b.s[2], profile=True)
            for p in plan.pieces:
                wq.queue(p)
            torch.cuda.synchronize()
            res["wake_1stream_profile"] = wq.profile_summary()
        except Exception:
            res["wake_1stream_profile"] = {"error": traceback.format_exc()[-600:]}
        b.put(f"host:{name}", res)

    makers: dict[str, Callable[[], tuple[int, Callable[[], None], int]]] = {
        "torch": lambda: _torch_pinned(S),
        "hostalloc": lambda: (*b.host_alloc(S, _HOST_ALLOC_PORTABLE), S),
        "hostalloc_wc": lambda: (
            *b.host_alloc(S, _HOST_ALLOC_PORTABLE | _HOST_ALLOC_WRITE_COMBINED),
            S,
        ),
        "hostbuffer": lambda: b.host_buffer(S, 4),
        "hostbuffer_1t": lambda: b.host_buffer(S, 1),
        "hostbuffer_nothp": lambda: b.host_buffer(S, 4, advice=15),  # MADV_NOHUGEPAGE
        "hostbuffer_whole": lambda: b.host_buffer(S, 4, whole=True),
        "hostbuffer_local": lambda: b.host_buffer(S, 4, cpus=gpu_cpus),
    }
    held: list[Any] = []

    def _torch_pinned(n: int) -> tuple[int, Callable[[], None], int]:
        x = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        held.append(x)
        return x.data_ptr(), held.clear, n

    for name in [h for h in a.hosts.split(",") if h]:
        if name == "hostbuffer_local" and not gpu_cpus:
            b.put(f"host:{name}", {"skipped": "no GPU-local cpulist"})
            continue
        if left() < 25:
            b.put(f"host:{name}", {"skipped": f"budget ({left():.0f} s left)"})
            continue
        try:
            t = time.perf_counter()
            ptr, free, cut = makers[name]()
            make_s = time.perf_counter() - t
            t = time.perf_counter()
            ctypes.memmove(ptr, rp, S)
            b.put(
                f"make:{name}",
                {
                    "make_s": round(make_s, 3),
                    "fill_s": round(time.perf_counter() - t, 3),
                    "cut": cut,
                },
            )
            try:
                patterns(name, ptr, cut)
            finally:
                free()
        except Exception:
            b.put(f"host:{name}", {"error": traceback.format_exc()[-800:]})

    # larger pieces (64 chunks = 128 MiB raw) through the product's HostBuffer
    if a.pieces64 and left() > 20:
        try:
            gc64 = codec.GpuCodec("cuda", piece_chunks=64, slots=2)
            plan64 = gc64.plan(ranges)
            hb2 = cudart.HostBuffer(plan64.total, b.rt, 0)
            hb2.pin(4)
            h2p = hb2.ptr

            def c64(off: int, dev: int, n: int, to_host: bool, stream: int) -> None:
                pos = 0
                while pos < n:
                    o = off + pos
                    m = min(n - pos, (o // cudart.REGISTER_BYTES + 1) * cudart.REGISTER_BYTES - o)
                    if to_host:
                        b.rt.memcpy_async(h2p + o, dev + pos, m, stream)
                    else:
                        b.rt.memcpy_async(dev + pos, h2p + o, m, stream)
                    pos += m

            sq = codec.SleepQueue(gc64, plan64, c64, b.s[0], b.s[1])
            for p in plan64.pieces:
                sq.queue(p)
            torch.cuda.synchronize()
            for x in tensors:
                x.zero_()

            def go64(s: list[Any]) -> None:
                wq = codec.WakeQueue(gc64, plan64, c64, s[0], s[2])
                for p in plan64.pieces:
                    wq.queue(p)

            r64 = b.timed(go64, plan64.total, 3, gate=150_000_000)
            r64["exact"] = all(torch.equal(x, y) for x, y in zip(tensors, orig, strict=True))
            r64["coded_bytes"] = plan64.total
            b.put("wake_64chunk_pieces_hostbuffer", r64)
            hb2.free()
            gc64.release()
        except Exception:
            b.put("wake_64chunk_pieces_hostbuffer", {"error": traceback.format_exc()[-800:]})

    if a.engine and left() > 20:
        try:
            engine_like(b, tensors, orig, plan, gc, rp, S, left, a.engine_free_gib)
        except Exception:
            b.put("engine", {"error": traceback.format_exc()[-800:]})
    if a.big_host_gib and left() > 15:
        try:
            big_host(b, int(a.big_host_gib * (1 << 30)), bigp, S)
        except Exception:
            b.put("big_host", {"error": traceback.format_exc()[-800:]})
    if a.disk_dir and left() > 20:
        try:
            disk(b, Path(a.disk_dir), ref, S, bigp, left)
        except Exception:
            b.put("disk", {"error": traceback.format_exc()[-800:]})
    b.report["total_s"] = round(time.perf_counter() - t_start, 1)
    b.save()
    print("=== summary", flush=True)
    for k, v in b.report["results"].items():
        if k.startswith("host:") and isinstance(v, dict):
            row = {
                m: (r.get("gbps"), r.get("exact")) if isinstance(r, dict) and "gbps" in r else "-"
                for m, r in v.items()
                if m != "wake_1stream_profile"
            }
            prof = v.get("wake_1stream_profile") or {}
            print(
                k,
                json.dumps(row),
                "profile wire",
                prof.get("wire_gbps") if isinstance(prof, dict) else None,
                flush=True,
            )


def _quarters(wq: codec.WakeQueue) -> dict[str, Any]:
    """The profiled wake's wire rate by quarter of its pieces, and its slowest pieces."""
    prof = wq._prof or []
    sizes = wq._sizes
    wire = [ev[1].elapsed_time(ev[2]) / 1000.0 for ev in prof]
    n = len(wire)
    quarters = codec.rates_by_part(wire, [c for c, _ in sizes])
    out: dict[str, Any] = {
        f"q{i + 1}_gbps": round(r, 2) if r is not None else None for i, r in enumerate(quarters)
    }
    rates = sorted((sizes[j][0] / wire[j] / GB, j) for j in range(n) if wire[j] > 0)
    out["slowest"] = [(round(r, 1), j, sizes[j][0]) for r, j in rates[:5]]
    out["fastest"] = [(round(r, 1), j, sizes[j][0]) for r, j in rates[-3:]]
    return out


def engine_like(
    b: Bench,
    tensors: list[Any],
    orig: list[Any],
    plan: codec.Plan,
    gc: codec.GpuCodec,
    rp: int,
    S: int,
    left: Callable[[], float],
    free_gib: float,
) -> None:
    """The wake as the cumem backend runs it: every tensor a cuMem record mapped just
    before its pieces are queued (the driver's calls between them), the decodes into those
    fresh mappings, the staging slots made anew, the product's HostBuffer, optionally right
    after a large release (a sleep's) and after the GPU idled; each profiled per piece."""
    from worker_ext.cudriver import Driver
    from worker_ext.rawmem import raw_bytes

    drv = Driver(torch.cuda.current_device(), exportable=True)
    cuda = torch.device("cuda", torch.cuda.current_device())  # a raw view names its index
    gran = drv.granularity
    sizes = [(x.numel() * 2 + gran - 1) // gran * gran for x in tensors]
    total = sum(sizes)
    base = drv.reserve(total)
    offs = [sum(sizes[:i]) for i in range(len(sizes))]
    vplan = codec.Plan(
        ranges=[(base + o, x.numel() * 2) for o, x in zip(offs, tensors, strict=True)],
        pieces=plan.pieces,
        meta=plan.meta,
        inv=plan.inv,
        total=plan.total,
        raw_total=plan.raw_total,
    )
    by_rng: dict[int, list[codec.Piece]] = {}
    for p in plan.pieces:
        by_rng.setdefault(p.rng, []).append(p)
    host = cudart.HostBuffer(S, b.rt, 0)
    host.pin(4)
    ctypes.memmove(host.ptr, rp, S)
    hp = host.ptr
    raw_total = plan.raw_total
    raw_host = cudart.HostBuffer(raw_total, b.rt, 0)
    raw_host.pin(4)
    raw_offs = []
    pos = 0
    for x in orig:  # the raw bytes, for the `none` path (no copy spans two registrations)
        raw_offs.append(pos)
        n = x.numel() * 2
        q = 0
        while q < n:
            m = min(n - q, ((pos + q) // CHUNK + 1) * CHUNK - (pos + q))
            b.rt.memcpy_async(raw_host.ptr + pos + q, x.data_ptr() + q, m, 0)
            q += m
        pos += n
    torch.cuda.synchronize()

    def copy(off: int, dev: int, n: int, to_host: bool, stream: int) -> None:
        q = 0
        while q < n:
            o = off + q
            m = min(n - q, (o // cudart.REGISTER_BYTES + 1) * cudart.REGISTER_BYTES - o)
            b.rt.memcpy_async(dev + q, hp + o, m, stream)
            q += m

    handles: list[int] = []

    def unmap_all() -> None:
        torch.cuda.synchronize()
        for o, sz, h in zip(offs, sizes, handles, strict=False):  # those mapped so far
            drv.unmap(base + o, sz)
            drv.release(h)
        handles.clear()

    def release_big(gib: float) -> float:
        """Map and touch `gib` GiB, then release it (what a sleep hands back)."""
        if gib <= 0:
            return 0.0
        n = int(gib * (1 << 30)) // gran * gran
        va = drv.reserve(n)
        h = drv.create(n)
        drv.map(va, n, h)
        drv.set_access(va, n)
        raw_bytes(va, n, cuda).fill_(1)
        torch.cuda.synchronize()
        t = time.perf_counter()
        drv.unmap(va, n)
        drv.release(h)
        drv.lib.cuMemAddressFree(ctypes.c_uint64(va), ctypes.c_size_t(n))
        return time.perf_counter() - t

    def map_one(r: int) -> None:
        o, sz = offs[r], sizes[r]
        h = drv.create(sz)
        drv.map(base + o, sz, h)
        drv.set_access(base + o, sz)
        handles.append(h)

    def one(coded: bool, fresh_slots: bool, free: float, idle: float, pre: int) -> dict[str, Any]:
        """pre 1: every record mapped before the clock starts; 2: and each touched once."""
        rel = release_big(free)
        if pre:
            for r in range(len(sizes)):
                map_one(r)
            if pre == 2:
                for o, sz in zip(offs, sizes, strict=True):
                    raw_bytes(base + o, sz, cuda).zero_()
            torch.cuda.synchronize()
        if idle:
            time.sleep(idle)
        if fresh_slots:
            gc.release()
            torch.cuda.empty_cache()
        s0, s1, s2 = b.s
        cur = torch.cuda.current_stream()
        for st in b.s:
            st.wait_stream(cur)
        start = torch.cuda.Event(enable_timing=True)
        start.record(s0)
        t = time.perf_counter()
        wq = codec.WakeQueue(gc, vplan, copy, s0, s2, profile=True) if coded else None
        k = 0
        for r, o in enumerate(offs):
            if not pre:
                map_one(r)
            if wq is not None:
                for p in by_rng.get(r, []):
                    wq.queue(p)
            else:  # the raw path (cumem _queue): CHUNK copies cut at host-offset multiples
                n = tensors[r].numel() * 2
                hoff = raw_offs[r]
                q = 0
                while q < n:
                    m = min(n - q, ((hoff + q) // CHUNK + 1) * CHUNK - (hoff + q))
                    b.rt.memcpy_async(
                        base + o + q, raw_host.ptr + hoff + q, m, (s0, s1)[k % 2].cuda_stream
                    )
                    q += m
                    k += 1
        queued = time.perf_counter() - t
        ends = [st.record_event(torch.cuda.Event(enable_timing=True)) for st in b.s]
        torch.cuda.synchronize()
        wall = time.perf_counter() - t
        gpu = max(start.elapsed_time(e) for e in ends) / 1000.0
        nbytes = S if coded else raw_total
        res: dict[str, Any] = {
            "gpu_s": round(gpu, 5),
            "gbps": round(nbytes / gpu / GB, 2),
            "wall_s": round(wall, 5),
            "queue_s": round(queued, 5),
            "release_s": round(rel, 4),
            "map_s": {k2: round(v, 4) for k2, v in drv.take_spent().items()},
        }
        if wq is not None:
            summ = wq.profile_summary() or {}
            res.update(
                {
                    k2: summ.get(k2)
                    for k2 in ("wire_gbps", "slot_wait_s", "dma_idle_cpu_s", "decode_gbps_raw")
                }
            )
            res.update(_quarters(wq))
        res["exact"] = all(
            torch.equal(
                raw_bytes(base + o, x.numel() * 2, cuda),
                y.view(torch.uint8).view(-1),
            )
            for o, x, y in zip(offs, tensors, orig, strict=True)
        )
        unmap_all()
        return res

    out: dict[str, Any] = {"records": len(sizes), "pieces": len(plan.pieces)}
    gc.n_slots = 2
    variants = (
        ("coded_warm_slots", True, False, 0.0, 0.0, 0),
        ("coded_fresh_slots", True, True, 0.0, 0.0, 0),
        ("coded_premapped_touched", True, False, 0.0, 0.0, 2),
        ("coded_after_release", True, True, free_gib, 0.0, 0),
        ("raw_after_release", False, True, free_gib, 0.0, 0),
        ("raw_fresh", False, False, 0.0, 0.0, 0),
        ("coded_after_release_idle2", True, True, free_gib, 2.0, 0),
    )
    for name, coded, fresh, free, idle, pre in variants:
        if left() < 8 + 2 * idle:
            out[name] = {"skipped": "budget"}
            continue
        try:
            out[name] = [one(coded, fresh, free, idle, pre) for _ in range(1 if idle else 2)]
        except Exception:
            out[name] = {"error": traceback.format_exc()[-800:]}
            try:
                unmap_all()
            except Exception:
                handles.clear()
        b.put("engine", out)
    host.free()
    raw_host.free()


def big_host(b: Bench, n: int, bigp: int, S: int) -> None:
    """A HostBuffer as large as an 8B model's coded copy: its copy rate by 1 GiB segment."""
    host = cudart.HostBuffer(n, b.rt, 0)
    t = time.perf_counter()
    host.pin(4)
    pin_s = time.perf_counter() - t
    s0 = b.s[0]
    evs = [s0.record_event(torch.cuda.Event(enable_timing=True))]
    seg = 1 << 30
    for off in range(0, n, seg):
        m = min(seg, n - off)
        for q in range(0, m, 64 * MiB):
            mm = min(64 * MiB, m - q)
            b.rt.memcpy_async(
                bigp + (off + q) % (S - 64 * MiB), host.ptr + off + q, mm, s0.cuda_stream
            )
        evs.append(s0.record_event(torch.cuda.Event(enable_timing=True)))
    torch.cuda.synchronize()
    rates = [
        round(min(seg, n - i * seg) / (evs[i].elapsed_time(evs[i + 1]) / 1000.0) / GB, 1)
        for i in range(len(evs) - 1)
    ]
    b.put("big_host", {"bytes": n, "pin_s": round(pin_s, 2), "gbps_by_gib": rates})
    host.free()


def disk(b: Bench, d: Path, ref: Any, S: int, bigp: int, left: Callable[[], float]) -> None:
    """The tier's warm read: one file of the coded bytes in the page cache."""
    d.mkdir(parents=True, exist_ok=True)
    path = d / "tier.bin"
    t = time.perf_counter()
    view = memoryview(ref.numpy()).cast("B")
    with open(path, "wb") as f:
        for off in range(0, S, 256 * MiB):
            f.write(view[off : off + 256 * MiB])
    res: dict[str, Any] = {"bytes": S, "write_s": round(time.perf_counter() - t, 2)}
    b.put("disk_write", res)
    hb = cudart.HostBuffer(S, b.rt, 0)
    hb.pin(4)
    dst = (ctypes.c_ubyte * S).from_address(hb.ptr)
    dview = memoryview(dst).cast("B")

    def pread(threads: int, step: int) -> float:
        spans = [(o, min(step, S - o)) for o in range(0, S, step)]
        nxt = [0]
        lock = threading.Lock()
        fd = os.open(path, os.O_RDONLY)

        def work() -> None:
            while True:
                with lock:
                    j = nxt[0]
                    nxt[0] += 1
                if j >= len(spans):
                    return
                o, m = spans[j]
                os.preadv(fd, [dview[o : o + m]], o)

        t0 = time.perf_counter()
        ws = [threading.Thread(target=work) for _ in range(threads)]
        for w in ws:
            w.start()
        for w in ws:
            w.join()
        os.close(fd)
        return time.perf_counter() - t0

    pread(8, 64 * MiB)  # warm the page cache
    reads: dict[str, Any] = {}
    for threads, mib in ((8, 64), (16, 64), (16, 16), (8, 256), (16, 256), (4, 64)):
        if left() < 10:
            break
        s = min(pread(threads, mib * MiB) for _ in range(2))
        reads[f"{threads}x{mib}MiB"] = {"s": round(s, 4), "gbps": round(S / s / GB, 2)}
    b.put("disk_warm_pread", reads)
    hb.free()
    # DMA straight from the page cache: the file mapped, its pages registered read-only
    mres: dict[str, Any] = {}
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]  # fmt: skip
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    b.lib.cudaGetLastError.restype = ctypes.c_int
    for flags_name, flags in (("readonly", 1 | _REGISTER_READ_ONLY), ("portable", 1)):
        if left() < 8:
            break
        fd = os.open(path, os.O_RDONLY)
        try:
            t0 = time.perf_counter()
            ptr = libc.mmap(None, S, 1, 0x01 | 0x8000, fd, 0)  # PROT_READ, MAP_SHARED|POPULATE
            r: dict[str, Any] = {"mmap_s": round(time.perf_counter() - t0, 4)}
            t0 = time.perf_counter()
            err = b.lib.cudaHostRegister(
                ctypes.c_void_p(ptr), ctypes.c_size_t(S), ctypes.c_uint(flags)
            )
            r.update({"register_s": round(time.perf_counter() - t0, 4), "register_err": err})
            if err == 0:

                def from_cache(s: list[Any], p: int = ptr) -> None:
                    for k, o in enumerate(range(0, S, 64 * MiB)):
                        b.rt.memcpy_async(
                            bigp + o, p + o, min(64 * MiB, S - o), s[k % 2].cuda_stream
                        )

                r.update(b.timed(from_cache, S, 2))
                t0 = time.perf_counter()
                b.rt.host_unregister(ptr)
                r["unregister_s"] = round(time.perf_counter() - t0, 4)
            else:
                b.lib.cudaGetLastError()
            libc.munmap(ctypes.c_void_p(ptr), ctypes.c_size_t(S))
            mres[flags_name] = r
        except Exception:
            mres[flags_name] = {"error": traceback.format_exc()[-600:]}
        finally:
            os.close(fd)
    b.put("disk_mmap_register", mres)
    path.unlink(missing_ok=True)


if __name__ == "__main__":
    main()
