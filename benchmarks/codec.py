"""The host codec's micro-bench on the device: ratio, encode/decode GB/s, pipelined sleep
and wake against the pinned D2H/H2D bound measured in the same process; nvCOMP beside it.

Needs torch with CUDA and Triton only (no vLLM): `python3 -m benchmarks.codec --out DIR`.
Data sets (`--gib` each, as tensors of an 8B model's layer shapes): `realistic`
(benchmarks/realweights.py), `dummy` (uniform in [-1e-3, 1e-3], vLLM's dummy loader),
`fp8` (normal values cast to float8_e4m3fn), `noise` (random bytes).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks import realweights
from worker_ext import codec

GB = 1e9
LAYER = [  # (name, rows, cols) of one llama3-8b layer
    ("q_proj", 4096, 4096),
    ("k_proj", 1024, 4096),
    ("v_proj", 1024, 4096),
    ("o_proj", 4096, 4096),
    ("gate_proj", 14336, 4096),
    ("up_proj", 14336, 4096),
    ("down_proj", 4096, 14336),
    ("input_layernorm", 1, 4096),
    ("post_attention_layernorm", 1, 4096),
]


class CudaRT:
    def __init__(self) -> None:
        path = None
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcudart" in line:
                    path = line.split()[-1]
                    break
        if path is None:
            raise RuntimeError("libcudart not loaded")
        lib = ctypes.CDLL(path)
        lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p] * 2 + [ctypes.c_size_t, ctypes.c_int]
        lib.cudaMemcpyAsync.argtypes.append(ctypes.c_void_p)
        self.lib = lib

    def copy(self, dst: int, src: int, n: int, stream: int) -> None:
        err = self.lib.cudaMemcpyAsync(dst, src, n, 4, stream)
        if err:
            raise RuntimeError(f"cudaMemcpyAsync: {err}")


def timed_gpu(fn: Any, stream: Any = None) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def bounds(nbytes: int) -> dict[str, float]:
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h2d = min(timed_gpu(lambda: dev.copy_(host, non_blocking=True)) for _ in range(5))
    d2h = min(timed_gpu(lambda: host.copy_(dev, non_blocking=True)) for _ in range(5))
    return {"bytes": nbytes, "h2d_gbps": nbytes / h2d / GB, "d2h_gbps": nbytes / d2h / GB}


def make_tensors(kind: str, gib: float, seed: int) -> list[Any]:
    out: list[Any] = []
    total, i = 0, 0
    while total < gib * (1 << 30):
        for name, r, c in LAYER:
            t = torch.empty((r, c), dtype=torch.bfloat16, device="cuda")
            if kind == "realistic":
                realweights.fill_(t, name, seed * 7919 + i)
            elif kind == "dummy":
                t.uniform_(-1e-3, 1e-3)
            elif kind == "fp8":
                t.view(torch.uint8).view(-1).copy_(
                    (torch.randn(r * c * 2, device="cuda") * 0.5)
                    .to(torch.float8_e4m3fn)
                    .view(torch.uint8)
                )
            else:
                t.view(torch.uint8).random_(0, 256)
            out.append(t)
            total += t.numel() * 2
            i += 1
    return out


def raw_pipeline(rt: CudaRT, ranges: list[tuple[int, int]], host: Any, to_host: bool) -> float:
    """The `none` codec's copies: 64 MiB pieces round-robin on two streams."""
    streams = [torch.cuda.Stream() for _ in range(2)]
    step = 64 << 20

    def go() -> None:
        off, k = 0, 0
        for ptr, n in ranges:
            for pos in range(0, n, step):
                m = min(step, n - pos)
                s = streams[k % 2].cuda_stream
                if to_host:
                    rt.copy(host.data_ptr() + off, ptr + pos, m, s)
                else:
                    rt.copy(ptr + pos, host.data_ptr() + off, m, s)
                off += m
                k += 1

    return min(timed_gpu(go) for _ in range(3))


def bench_codec(
    rt: CudaRT, tensors: list[Any], piece_chunks: int, slots: int, decoder: str = "planes"
) -> dict[str, Any]:
    ranges = [(t.data_ptr(), t.numel() * 2) for t in tensors]
    raw_total = sum(n for _, n in ranges)
    gc = codec.GpuCodec("cuda", piece_chunks=piece_chunks, slots=slots, decoder=decoder)
    plan_by_impl = {}
    for impl in ("ranges", "table"):  # one launch per range, or one over a chunk table
        gc.plan_impl = impl
        plan = gc.plan(ranges)  # warm (compiles)
        plan_by_impl[f"plan_s_{impl}"] = min(timed_gpu(lambda: gc.plan(ranges)) for _ in range(2))
        plan_by_impl[f"plan_impl_{impl}_used"] = gc.plan_impl
    plan_s = plan_by_impl["plan_s_table"]
    plan = gc.plan(ranges)
    host = torch.empty(plan.total, dtype=torch.uint8, pin_memory=True)
    orig = [t.clone() for t in tensors]
    enc, dma, dec = torch.cuda.Stream(), torch.cuda.Stream(), torch.cuda.Stream()
    hp = host.data_ptr()

    def hcopy(off: int, dev: int, n: int, to_host: bool, stream: int) -> None:
        if to_host:
            rt.copy(hp + off, dev, n, stream)
        else:
            rt.copy(dev, hp + off, n, stream)

    res: dict[str, Any] = {
        "piece_chunks": piece_chunks,
        "slots": slots,
        "decoder": decoder,
        "raw_bytes": raw_total,
        "encoded_bytes": plan.total,
        "ratio": plan.ratio(),
        "chunks_by_k": {str(k): v for k, v in sorted(plan.by_k.items())},
        "plan_s": plan_s,
        **plan_by_impl,
        "scratch_bytes": gc.scratch_bytes(plan),
    }
    # device-only encode: every piece into alternating slots
    sl = gc.slots()

    def enc_only() -> None:
        for j, p in enumerate(plan.pieces):
            gc.encode_into(plan, p, sl[j % len(sl)])

    enc_only()
    t = min(timed_gpu(enc_only) for _ in range(3))
    res["encode_gbps"] = raw_total / t / GB
    # sleep: encode + D2H pipelined into the pinned host copy

    def sleep() -> None:
        q = codec.SleepQueue(gc, plan, hcopy, enc, dma)
        for p in plan.pieces:
            q.queue(p)

    t = min(timed_gpu(sleep) for _ in range(3))
    res["sleep_s"] = t
    # device-only decode from a device copy of the host bytes
    staged = host.to("cuda")

    def dec_only() -> None:
        for p in plan.pieces:
            gc.decode_into(plan, p, staged[p.host_off : p.host_off + p.size])

    for t_ in tensors:
        t_.zero_()
    dec_only()
    res["decode_exact"] = all(torch.equal(a, b) for a, b in zip(tensors, orig, strict=True))
    t = min(timed_gpu(dec_only) for _ in range(3))
    res["decode_gbps"] = raw_total / t / GB
    # wake: H2D + decode pipelined into the final place

    def wake() -> None:
        q = codec.WakeQueue(gc, plan, hcopy, dma, dec)
        for p in plan.pieces:
            q.queue(p)

    times = []
    for _ in range(3):
        for t_ in tensors:
            t_.zero_()
        times.append(timed_gpu(wake))
    res["wake_s"] = min(times)
    res["wake_s_all"] = times
    res["wake_exact"] = all(torch.equal(a, b) for a, b in zip(tensors, orig, strict=True))
    q = codec.WakeQueue(gc, plan, hcopy, dma, dec, profile=True)  # where a wake's time goes
    torch.cuda.synchronize()
    for p in plan.pieces:
        q.queue(p)
    torch.cuda.synchronize()
    res["wake_profile"] = q.profile_summary()
    del orig, host
    gc.release()
    return res


def bench_nvcomp(tensors: list[Any]) -> dict[str, Any]:
    from nvidia import nvcomp  # type: ignore[import-not-found]

    flat = torch.cat([t.view(-1) for t in tensors]).view(torch.uint8).view(-1, 2)
    hi = flat[:, 1].contiguous()
    whole = flat.view(-1)
    out: dict[str, Any] = {"version": getattr(nvcomp, "__version__", "?")}
    for label, data, algo in (
        ("ans_high_bytes", hi, "ANS"),
        ("ans_whole", whole, "ANS"),
        ("bitcomp_whole", whole, "Bitcomp"),
    ):
        try:
            c = nvcomp.Codec(algorithm=algo)
            arr = nvcomp.as_array(data)
            enc = c.encode(arr)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):
                enc = c.encode(arr)
            torch.cuda.synchronize()
            et = (time.perf_counter() - t0) / 3
            dec = c.decode(enc)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):
                dec = c.decode(enc)
            torch.cuda.synchronize()
            dt = (time.perf_counter() - t0) / 3
            try:
                back = torch.as_tensor(dec, device="cuda")
            except Exception:
                back = torch.from_dlpack(dec)
            back = back.view(torch.uint8).view(-1)
            attrs = {}
            for name in ("buffer_size", "size", "capacity", "item_size", "shape", "dtype"):
                try:
                    attrs[name] = str(getattr(enc, name))
                except Exception as e:
                    attrs[name] = repr(e)
            try:
                size = int(torch.from_dlpack(enc).numel() * torch.from_dlpack(enc).element_size())
            except Exception:
                size = int(enc.buffer_size)
            out[label] = {
                "in_bytes": int(data.numel()),
                "ratio_of_input": size / data.numel(),
                "ratio_total": (size + (whole.numel() - data.numel())) / whole.numel(),
                "encode_gbps": data.numel() / et / GB,
                "decode_gbps": data.numel() / dt / GB,
                "exact": bool(torch.equal(back[: data.numel()], data)),
                "attrs": attrs,
            }
        except Exception as e:
            out[label] = {"error": f"{type(e).__name__}: {e}"}
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="codec-bench")
    ap.add_argument("--gib", type=float, default=3.0)
    ap.add_argument("--kinds", default="realistic,dummy,fp8,noise")
    ap.add_argument(
        "--sweep",
        default="32x2,16x2,64x2,32x3",
        help="PIECE_CHUNKSxSLOTS[g]: g runs the groups decoder (else planes)",
    )
    ap.add_argument("--nvcomp", action="store_true")
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rt = CudaRT()
    report: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except Exception as e:
        report["triton"] = repr(e)
    report["bounds"] = bounds(2 << 30)
    report["kinds"] = {}
    for kind in a.kinds.split(","):
        r: dict[str, Any] = {}
        try:
            tensors = make_tensors(kind, a.gib, 1)
            ranges = [(t.data_ptr(), t.numel() * 2) for t in tensors]
            w = tensors[4].view(torch.int16).view(-1).to(torch.int32) & 0xFFFF
            h = torch.bincount((w >> 7) & 0xFF, minlength=256).double()
            pr = h[h > 0] / h.sum()
            r["exp_entropy_bits"] = float(-(pr * pr.log2()).sum())
            r["distinct_words_sample"] = int(torch.unique(w[: 1 << 20]).numel())
            del w
            raw = sum(n for _, n in ranges)
            r["h2d_bound_s"] = raw / (report["bounds"]["h2d_gbps"] * GB)
            r["d2h_bound_s"] = raw / (report["bounds"]["d2h_gbps"] * GB)
            sweep = a.sweep.split(",") if kind == "realistic" else a.sweep.split(",")[:1]
            r["codec"] = []
            for item in sweep:
                dec_name = "groups" if item.endswith("g") else "planes"
                pc, sl = (int(x) for x in item.rstrip("g").split("x"))
                try:
                    c = bench_codec(rt, tensors, pc, sl, dec_name)
                    c["wake_vs_h2d_bound"] = c["wake_s"] / r["h2d_bound_s"]
                    c["sleep_vs_d2h_bound"] = c["sleep_s"] / r["d2h_bound_s"]
                    r["codec"].append(c)
                except Exception:
                    r["codec"].append({"sweep": item, "error": traceback.format_exc()})
                print(kind, json.dumps(r["codec"][-1])[:600], flush=True)
            # the `none` copies last: their H2D overwrites the tensors with the host's bytes
            host = torch.empty(raw, dtype=torch.uint8, pin_memory=True)
            r["none_d2h_s"] = raw_pipeline(rt, ranges, host, True)
            r["none_h2d_s"] = raw_pipeline(rt, ranges, host, False)
            if a.nvcomp and kind == "realistic":
                try:
                    r["nvcomp"] = bench_nvcomp(tensors)
                except Exception:
                    r["nvcomp"] = {"error": traceback.format_exc()}
                print("nvcomp", json.dumps(r["nvcomp"])[:800], flush=True)
            del tensors
            torch.cuda.empty_cache()
        except Exception:
            r["error"] = traceback.format_exc()
        report["kinds"][kind] = r
        (out / "codec.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report["bounds"]))
    for kind, r in report["kinds"].items():
        for c in r.get("codec", []):
            if "ratio" in c:
                print(
                    f"{kind:9s} {c['piece_chunks']}x{c['slots']} {c['decoder']}"
                    f" ratio {c['ratio']:.4f} "
                    f"enc {c['encode_gbps']:.0f} GB/s dec {c['decode_gbps']:.0f} GB/s "
                    f"sleep {c['sleep_s']:.4f}s ({c['sleep_vs_d2h_bound']:.3f}x) "
                    f"wake {c['wake_s']:.4f}s ({c['wake_vs_h2d_bound']:.3f}x) "
                    f"exact {c['decode_exact']}/{c['wake_exact']} none h2d {r['none_h2d_s']:.4f}"
                )


if __name__ == "__main__":
    main()
