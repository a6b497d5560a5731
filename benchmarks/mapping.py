"""Where a level-1 wake's time goes below vLLM: cuMem create / map / access against the DMA.

    python3 -m benchmarks.mapping [--weights-gb 16.08] [--kv-gb 49.48] [--reps 3]

Not a pytest module. Runs on the lent device without an engine (torch + the CUDA driver
through ctypes), with allocations shaped like vLLM 0.26's pools for the Llama-3-8B shape
(132 weight records, 34 KV records; sizes below). Every variant is timed end to end, host
side, from its first driver call to the moment its copies are done on the device:

- create / map / access / unmap / release of each pool alone (GPU idle), so the cost of
  each driver step is known (and whether it scales with bytes: a zero-fill);
- the weights' DMA alone into mapped memory (the wake's floor), over streams and chunks;
- the ways a wake can order the work: record-by-record map-then-copy, all mapped first,
  KV physical memory created during the DMA (mapped after), KV fully mapped during the
  DMA, KV first.

Prints one table and writes one JSON line to $OUT/mapping.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

import torch

from worker_ext.cudriver import Driver

GB = 1e9
MiB = 1 << 20


class Pool:
    """Records at fixed reserved addresses; physical memory comes and goes."""

    def __init__(self, drv: Driver, sizes: list[int]) -> None:
        g = drv.granularity
        self.drv = drv
        self.sizes = [(s + g - 1) // g * g for s in sizes]
        self.ptrs = [drv.reserve(s) for s in self.sizes]
        self.handles: list[int | None] = [None] * len(self.sizes)
        self.mapped = [False] * len(self.sizes)

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def create(self, i: int) -> None:
        self.handles[i] = self.drv.create(self.sizes[i])

    def map(self, i: int) -> None:
        h = self.handles[i]
        assert h is not None
        self.drv.map(self.ptrs[i], self.sizes[i], h)
        self.drv.set_access(self.ptrs[i], self.sizes[i])
        self.mapped[i] = True

    def up(self, i: int) -> None:
        self.create(i)
        self.map(i)

    def down(self) -> None:
        for i, (p, s) in enumerate(zip(self.ptrs, self.sizes, strict=True)):
            if self.mapped[i]:
                self.drv.unmap(p, s)
                self.mapped[i] = False
            h = self.handles[i]
            if h is not None:
                self.drv.release(h)
                self.handles[i] = None


def llama8b_weight_sizes(target: float) -> list[int]:
    """132 records like vLLM's 8B weights pool: embed, 32 x (qkv, o, gate_up, down), head,
    and two small ones; scaled to `target` bytes."""
    h, inter, kv = 4096, 14336, 1024
    emb = 128256 * h * 2
    layer = [h * (h + 2 * kv) * 2, h * h * 2, h * 2 * inter * 2, inter * h * 2]
    sizes = [emb] + layer * 32 + [emb, 2 * MiB, 2 * MiB]
    scale = target / sum(sizes)
    return [max(2 * MiB, int(s * scale)) for s in sizes]


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        from worker_ext.cudart import CudaRT, HostBuffer

        torch.cuda.init()
        torch.zeros(1, device="cuda")
        self.drv = Driver(0, rdma=args.rdma, exportable=False)
        self.w = Pool(self.drv, llama8b_weight_sizes(args.weights_gb * GB))
        self.kv = Pool(self.drv, [int(args.kv_gb * GB / 34)] * 34)
        self.cudart = CudaRT()
        self.host = HostBuffer(self.w.nbytes, self.cudart, 0)
        self.pin_s = self.host.pin(4)
        self.streams = [torch.cuda.Stream() for _ in range(4)]
        self.results: dict[str, list[float]] = {}
        self.settle = 0.0
        self.notes: dict[str, Any] = {
            "weights_bytes": self.w.nbytes,
            "kv_bytes": self.kv.nbytes,
            "weights_records": len(self.w.sizes),
            "kv_records": len(self.kv.sizes),
            "granularity": self.drv.granularity,
            "pin_s": self.pin_s,
            "rdma": args.rdma,
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "gpu": torch.cuda.get_device_name(0),
        }

    # -- the copy ------------------------------------------------------------------------

    def queue(self, i: int, chunk: int, nstreams: int, k: int) -> int:
        size, ptr = self.w.sizes[i], self.w.ptrs[i]
        off0 = sum(self.w.sizes[:i])
        pos = 0
        while pos < size:  # cut at host-offset multiples: no copy spans two registrations
            off = off0 + pos
            n = min(size - pos, (off // chunk + 1) * chunk - off)
            s = self.streams[k % nstreams]
            self.cudart.memcpy_async(ptr + pos, self.host.ptr + off0 + pos, n, s.cuda_stream)
            pos += n
            k += 1
        return k

    def sync(self) -> None:
        for s in self.streams:
            s.synchronize()

    def copy_all(self, step: Callable[[int], None] | None = None) -> None:
        """Queue every weight record's copies (64 MiB, 2 streams); `step(i)` first, per
        record (e.g. map it), when given."""
        k = 0
        for i in range(len(self.w.sizes)):
            if step is not None:
                step(i)
            k = self.queue(i, 64 * MiB, 2, k)

    @staticmethod
    def each(pool: Pool, step: Callable[[int], None]) -> None:
        for i in range(len(pool.sizes)):
            step(i)

    def time(
        self, name: str, setup: Callable[[], None], body: Callable[[], dict[str, float]], reps: int
    ) -> None:
        got: list[float] = []
        parts: dict[str, list[float]] = {}
        for _ in range(reps):
            self.w.down()
            self.kv.down()
            torch.cuda.synchronize()
            time.sleep(self.settle)  # let the driver finish with memory just released
            setup()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            sub = body()
            torch.cuda.synchronize()
            got.append(time.perf_counter() - t0)
            for k, v in sub.items():
                parts.setdefault(k, []).append(v - t0 if k.startswith("@") else v)
        self.results[name] = got
        best = min(got)
        extra = ", ".join(f"{k} {min(v):.4f}" for k, v in parts.items())
        print(
            f"[bench] {name}: best {best:.4f} s of {[round(x, 4) for x in got]}"
            + (f" ({extra})" if extra else ""),
            flush=True,
        )

    # -- variants ------------------------------------------------------------------------

    def run(self, reps: int, quick: bool = False) -> None:
        w, kv = self.w, self.kv
        n_w = range(len(w.sizes))

        def nothing() -> None:
            pass

        def all_up(pool: Pool) -> Callable[[], None]:
            def setup() -> None:
                for i in range(len(pool.sizes)):
                    pool.up(i)

            return setup

        def steps(pool: Pool) -> Callable[[], dict[str, float]]:
            def body() -> dict[str, float]:
                t = time.perf_counter()
                for i in range(len(pool.sizes)):
                    pool.create(i)
                t_c = time.perf_counter()
                for i in range(len(pool.sizes)):
                    pool.drv.map(pool.ptrs[i], pool.sizes[i], pool.handles[i] or 0)
                t_m = time.perf_counter()
                for i in range(len(pool.sizes)):
                    pool.drv.set_access(pool.ptrs[i], pool.sizes[i])
                    pool.mapped[i] = True
                t_a = time.perf_counter()
                return {"create": t_c - t, "map": t_m - t_c, "access": t_a - t_m}

            return body

        self.time("weights create/map/access (idle)", nothing, steps(w), reps)
        self.time("kv create/map/access (idle)", nothing, steps(kv), reps)

        def teardown(pool: Pool) -> Callable[[], dict[str, float]]:
            def body() -> dict[str, float]:
                t = time.perf_counter()
                for i in range(len(pool.sizes)):
                    pool.drv.unmap(pool.ptrs[i], pool.sizes[i])
                    pool.mapped[i] = False
                t_u = time.perf_counter()
                for i in range(len(pool.sizes)):
                    pool.drv.release(pool.handles[i] or 0)
                    pool.handles[i] = None
                return {"unmap": t_u - t, "release": time.perf_counter() - t_u}

            return body

        self.time("kv unmap/release", all_up(kv), teardown(kv), reps)
        if quick:
            return
        # one big KV record: is the cost per byte or per call?
        one = Pool(self.drv, [kv.nbytes // 8])
        self.time(
            "kv-sized/8 single record create",
            one.down,
            lambda: {"create": _timed(lambda: one.create(0))},
            reps,
        )
        one.down()

        # the floor: the weights' DMA alone, memory mapped beforehand
        for nstreams, chunk in ((1, 64 * MiB), (2, 64 * MiB), (4, 64 * MiB), (2, 256 * MiB)):

            def dma(ns: int = nstreams, ch: int = chunk) -> dict[str, float]:
                k = 0
                for i in n_w:
                    k = self.queue(i, ch, ns, k)
                return {}

            self.time(f"dma only, {nstreams} streams x {chunk // MiB} MiB", all_up(w), dma, reps)

        bw = self.bandwidth()
        self.notes["h2d_gbps"] = bw
        self.notes["bound_s"] = self.w.nbytes / (bw * GB)
        print(
            f"[bench] pinned H2D {bw:.1f} GB/s (2 GiB, best of 5); bound "
            f"{self.notes['bound_s']:.4f} s for {self.w.nbytes / GB:.2f} GB",
            flush=True,
        )
        for settle in (0.0, 1.0):
            self.settle = settle
            self.orders(reps, f" (settle {settle:g} s)")
        self.settle = 0.0

    def orders(self, reps: int, suffix: str) -> None:
        w, kv = self.w, self.kv

        def nothing() -> None:
            pass

        def kv_released_then_w_up() -> None:
            self.each(kv, kv.up)
            kv.down()
            self.each(w, w.up)

        def dma() -> dict[str, float]:
            self.copy_all()
            return {}

        self.time("dma only, kv released just before" + suffix, kv_released_then_w_up, dma, reps)

        def wait_mode() -> dict[str, float]:  # what worker_ext/cumem does now (`wait`)
            self.copy_all(w.up)
            t_q = time.perf_counter()
            self.sync()
            t_d = time.perf_counter()
            self.each(kv, kv.up)
            return {"@queued": t_q, "@dma done": t_d}

        self.time("current: w map+copy per record, wait, kv map" + suffix, nothing, wait_mode, reps)

        def premap() -> dict[str, float]:
            self.each(w, w.up)
            t_m = time.perf_counter()
            self.copy_all()
            self.sync()
            t_d = time.perf_counter()
            self.each(kv, kv.up)
            return {"@w mapped": t_m, "@dma done": t_d}

        self.time("w all mapped, copy, wait, kv map" + suffix, nothing, premap, reps)

        def kv_create_during() -> dict[str, float]:
            self.copy_all(w.up)
            t_q = time.perf_counter()
            self.each(kv, kv.create)
            t_c = time.perf_counter()
            self.sync()
            t_d = time.perf_counter()
            self.each(kv, kv.map)
            return {"@queued": t_q, "@kv created": t_c, "@dma done": t_d}

        self.time(
            "w per record, kv CREATE during dma, kv map after" + suffix,
            nothing,
            kv_create_during,
            reps,
        )

        def kv_full_during() -> dict[str, float]:
            self.copy_all(w.up)
            t_q = time.perf_counter()
            self.each(kv, kv.up)
            t_c = time.perf_counter()
            self.sync()
            return {"@queued": t_q, "@kv mapped": t_c}

        self.time("w per record, kv create+map during dma" + suffix, nothing, kv_full_during, reps)

        def kv_first() -> dict[str, float]:
            self.each(kv, kv.up)
            t_kv = time.perf_counter()
            self.copy_all(w.up)
            return {"@kv mapped": t_kv}

        self.time("kv map first, then w per record" + suffix, nothing, kv_first, reps)

        def all_create_first() -> dict[str, float]:
            self.each(w, w.create)
            self.each(kv, kv.create)
            t_c = time.perf_counter()
            self.copy_all(w.map)
            t_q = time.perf_counter()
            self.each(kv, kv.map)
            return {"@all created": t_c, "@queued": t_q}

        self.time(
            "create all (w+kv), then w map+copy, kv map during dma" + suffix,
            nothing,
            all_create_first,
            reps,
        )

    def bandwidth(self) -> float:
        n = 2 << 30
        dev = torch.empty(n, dtype=torch.uint8, device="cuda")
        host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        best = 1e9
        for _ in range(5):
            torch.cuda.synchronize()
            t = time.perf_counter()
            dev.copy_(host, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t)
        return n / best / GB


def _timed(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--weights-gb", type=float, default=16.08)
    ap.add_argument("--kv-gb", type=float, default=49.48)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rdma", action="store_true", help="gpuDirectRDMACapable, as vLLM asks")
    ap.add_argument("--quick", action="store_true", help="driver steps only, no copies")
    args = ap.parse_args()
    b = Bench(args)
    print(f"[bench] {json.dumps(b.notes)}", flush=True)
    b.run(args.reps, quick=args.quick)
    bound = b.notes.get("bound_s", 1.0)
    print("| variant | best s | x bound |\n|---|---|---|")
    for name, got in b.results.items():
        print(f"| {name} | {min(got):.4f} | {min(got) / bound:.2f}x |")
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "mapping.jsonl"), "a") as f:
            f.write(json.dumps({"notes": b.notes, "results": b.results}) + "\n")


if __name__ == "__main__":
    main()
