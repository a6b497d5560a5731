"""Level-1 sleep/wake benchmark on one GPU: raw vLLM against the hot-swap path, same process.

    python3 -m benchmarks.wake --shape llama3-8b [--via extension|backend] [--cycles 2]

Runs on the lent device (benchmarks/run-on-device.sh).
One in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0: the worker is this process, so its
RSS is ours to read and the caller-side times are the worker's times), dummy bf16 weights,
enforce_eager (`--graphs 1`: vLLM's default compile and CUDA graphs). Order: pinned-copy
bandwidth (torch, this process) -> engine -> raw vLLM llm.sleep(1)/llm.wake_up() cycles ->
torch's cached pinned blocks emptied -> our cycles. Both are timed the same way,
caller-side around the calls. Our wake is timed from the first resume call to the end of
restore+verify (extension) or to the end of the copies (backend: no verification there).
Tokens and logprobs are compared after every cycle.

`--via extension` drives worker_ext.HotSwapExtension over collective_rpc (prepare, suspend,
resume weights, resume kv_cache, restore_and_verify); `--via backend` drives
worker_ext.cumem.CuMemBackend directly through in-process callables.
Prints a table and writes one JSON line to $OUT/bench.jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from typing import Any

from benchmarks.common import GB, SHAPES, UTIL, GiB, gen, logger, rss, timed, write_config
from controller import protocol
from worker_ext import settings

log = logger("bench", clock=False)


def bandwidth(nbytes: int = 2 * GiB, reps: int = 5) -> dict[str, float]:
    """Best-of-reps pinned H2D and D2H bandwidth (the strictest bound), plain torch."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    host.fill_(1)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")

    def best(dst: Any, src: Any) -> float:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return nbytes / min(times)

    out = {"h2d_Bps": best(dev, host), "d2h_Bps": best(host, dev)}
    del host, dev
    torch.cuda.empty_cache()
    torch._C._host_emptyCache()  # give the pinned test buffer back: RSS is measured later
    return out


class Direct:
    """Drive CuMemBackend through in-process callables (engine in this process)."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm
        self.backend: Any = None

    def _b(self, wrapper: Any) -> Any:
        if self.backend is None:
            from worker_ext.cumem import CuMemBackend

            self.backend = CuMemBackend(wrapper.worker)
        return self.backend

    def call(self, fn: Any) -> Any:
        return self.llm.collective_rpc(lambda w: fn(self._b(w)))[0]

    def use_env(self) -> None:
        """The backend reads its settings once: hand it the environment just changed."""
        from worker_ext.settings import WorkerSettings

        s = WorkerSettings.from_env()
        self.call(lambda b: setattr(b, "settings", s))

    def warm(self) -> dict[str, Any]:
        return self.call(lambda b: b.warm_host(wait=True))  # type: ignore[no-any-return]

    def pools(self) -> dict[str, int]:
        return self.call(lambda b: b.pools())  # type: ignore[no-any-return]

    def sleep(self) -> tuple[dict[str, Any], float]:
        self.llm.reset_prefix_cache()  # what the controller's pause(clear_cache=true) does
        return timed(self.call, lambda b: b.suspend(1, ["weights", "kv_cache"]))

    def wake(self) -> tuple[dict[str, Any], float, float]:
        t = time.perf_counter()
        r1 = self.call(lambda b: b.resume(["weights"]))
        r2 = self.call(lambda b: b.resume(["kv_cache"]))
        self.call(lambda b: b.synchronize())
        return {"weights": r1, "kv_cache": r2}, time.perf_counter() - t, 0.0


def tune_codec(
    w: Any, decoder: str | None, slots: int | None, profile: bool, align: int | None = None
) -> dict[str, Any]:
    """On the worker: the backend's codec decode kernel, slots and host alignment of the
    pieces (the next sleep's plan) for the next cycles, and whether its next coded wake is
    profiled (timing events around every piece)."""
    from worker_ext import codec

    b = find_backend(w.worker)
    gc = b._coded.get_codec()
    proof: dict[str, Any] | None = None
    if gc is not None:
        if decoder and decoder != gc.decoder:  # proven on this device before it is used
            _, proof = codec.warm(gc.device, gc.piece_chunks, decoder=decoder)
            if proof["ok"]:
                gc.decoder = decoder
        if slots:
            gc.n_slots = max(2, slots)
        if align:
            gc.host_align = align
    b.codec_profile = profile
    return {
        "decoder": getattr(gc, "decoder", None),
        "slots": getattr(gc, "n_slots", None),
        "host_align": getattr(gc, "host_align", None),
        "profile": profile,
        "decoder_proof": proof,
    }


def find_backend(worker: Any) -> Any:
    from worker_ext.cumem import CuMemBackend

    for value in vars(worker).values():
        for candidate in (value, getattr(value, "backend", None)):  # the extension's state
            if isinstance(candidate, CuMemBackend):
                return candidate
    raise RuntimeError("no CuMemBackend on the worker")


class ViaExtension:
    """Drive the worker extension's RPC methods, in the controller's order."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def rpc(self, method: str, *args: Any) -> dict[str, Any]:
        r = self.llm.collective_rpc(method, args=args)[0]
        if not r.get("ok"):
            raise RuntimeError(f"{method} failed: {r.get('error')}")
        return r  # type: ignore[no-any-return]

    def warm(self) -> dict[str, Any]:
        info = self.rpc("hotswap_info")
        # The extension made its backend on that first RPC; pin its host buffer now and wait
        # (in-process callable: find the backend object on the worker, whatever its name).
        described = self.llm.collective_rpc(lambda w: find_backend(w.worker).warm_host(wait=True))
        return {**info, "backend": described[0]}

    def pools(self) -> dict[str, int]:
        return self.rpc("hotswap_info")["pools"]  # type: ignore[no-any-return]

    def use_env(self) -> None:
        """The extension reads its settings once: hand it the environment just changed."""
        from worker_ext.settings import WorkerSettings

        s = WorkerSettings.from_env()
        self.llm.collective_rpc(lambda w: w.worker._hotswap_state().use_settings(s))

    def sleep(
        self, prepare_level: int = 1, level: int = 1, fused: bool = False
    ) -> tuple[dict[str, Any], float]:
        """controller.protocol's sleep steps at `level`; each report and its seconds.
        `prepare_level` 2: the prepare protects what a level-2 sleep would (its cost, on
        the same level-1 wake). `fused`: the quiesce, then one hotswap_sleep (its report
        is both "prepare" and "suspend"; the seconds returned are its RPC's)."""
        self.llm.reset_prefix_cache()
        params = protocol.Params(level=level, quiesce_timeout_s=30.0)
        prep = protocol.Params(level=max(level, prepare_level), quiesce_timeout_s=30.0)
        out: dict[str, Any] = {}
        if fused:
            for step in protocol.sleep_steps(level, fused=True):
                out[step.phase], out[f"{step.phase}_s"] = timed(
                    self.rpc, step.method, *step.call_args(params)
                )
            fused_phase = protocol.PREPARE_SUSPEND.phase
            out["prepare"] = out["suspend"] = out[fused_phase]
            out["prepare_s"] = 0.0  # inside the fused RPC's seconds
            return out, out.pop(f"{fused_phase}_s")
        for step in protocol.sleep_steps(level):
            args = step.call_args(prep if step is protocol.PREPARE else params)
            out[step.phase], out[f"{step.phase}_s"] = timed(self.rpc, step.method, *args)
        return out, out.pop(f"{protocol.SUSPEND.phase}_s")

    def wake(self, level: int = 1) -> tuple[dict[str, Any], float, float]:
        """controller.protocol's wake steps from `level`; reports by pool, "reload" (level
        2) and "verify", the wake's seconds and the verify's."""
        keys = {"resume_weights": "weights", "resume_kv_cache": "kv_cache"}
        params = protocol.Params(level=level)
        out: dict[str, Any] = {}
        t = time.perf_counter()
        for step in protocol.wake_steps(level):
            out[keys.get(step.phase, step.phase)], seconds = timed(
                self.rpc, step.method, *step.call_args(params)
            )
        out["verify"] = out.pop(protocol.VERIFY.phase)
        return out, time.perf_counter() - t, seconds


CHECKS: list[dict[str, Any]] = []  # one per verify: the fingerprint check alone, in the worker


def time_checks() -> None:
    """Wrap worker_ext.fingerprint.Plan.changed (the worker is this process) so every
    verify's fingerprint check is timed on its own, with whether the Triton kernel ran."""
    from worker_ext import fingerprint

    inner = fingerprint.Plan.changed

    def changed(self: Any, base: Any) -> list[int]:
        t = time.perf_counter()
        out = inner(self, base)  # ends with its host read: the GPU work is done here
        CHECKS.append(
            {
                "check_s": time.perf_counter() - t,
                "kernel": base.check is not None,
                "kernel_error": self.kernel_error,
            }
        )
        return out

    fingerprint.Plan.changed = changed  # type: ignore[method-assign]


def fingerprint_bench(llm: Any, reps: int = 5) -> dict[str, Any]:
    """Time worker_ext.fingerprint on what prepare fingerprints (every non-KV record), in the
    worker (in-process callable): the whole batch against the row-sum kernels alone."""

    def work(wrapper: Any) -> dict[str, Any]:
        import torch

        from worker_ext import fingerprint, ownership

        worker = wrapper.worker
        recs = ownership.walk(worker.model_runner.get_model(), worker.model_runner)
        tensors = [r.tensor.detach() for r in recs if not r.is_kv]
        torch.cuda.synchronize()
        t = time.perf_counter()
        plan = fingerprint.Plan(tensors, kernel="off")
        build = time.perf_counter() - t
        base = plan.baseline()
        torch.cuda.synchronize()
        t = time.perf_counter()
        kplan = fingerprint.Plan(tensors, kernel="auto")
        kbase = kplan.baseline()  # the table, the sample cross-check, the baseline launch
        kbuild = time.perf_counter() - t
        runs, rows, checks, kchecks = [], [], [], []
        for _ in range(reps):
            torch.cuda.synchronize()
            t = time.perf_counter()
            plan.run()
            runs.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for it in plan._items:
                for rv in it.row_views:
                    torch.sum(rv, dim=1)
            torch.cuda.synchronize()
            rows.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            t = time.perf_counter()
            changed = plan.changed(base)  # the eager check: spans, one host copy
            checks.append(time.perf_counter() - t)
            if changed:
                raise RuntimeError(f"fingerprints moved with nothing written: {changed}")
            torch.cuda.synchronize()
            t = time.perf_counter()
            changed = kplan.changed(kbase)  # the kernel check: one launch, one bool
            kchecks.append(time.perf_counter() - t)
            if changed:
                raise RuntimeError(f"kernel fingerprints moved with nothing written: {changed}")
        # the kernel check must see one flipped bit in the middle of the largest tensor
        big = max(tensors, key=lambda x: x.untyped_storage().nbytes())
        raw = fingerprint.storage_bytes(big)
        mid = raw.numel() // 2
        raw[mid : mid + 1].bitwise_xor_(1 << 6)
        seen = kplan.changed(kbase) if kbase.check is not None else None
        raw[mid : mid + 1].bitwise_xor_(1 << 6)
        return {
            "kernel_check_s": min(kchecks),
            "kernel_baseline_s": kbuild,
            "kernel_error": kplan.kernel_error,
            "kernel_pieces": kbase.check.n_pieces if kbase.check is not None else None,
            "kernel_saw_flip": None if seen is None else bool(seen),
            "kernel_clean_after": kplan.changed(kbase) == [] if kbase.check is not None else None,
            "tensors": len(tensors),
            "storages": plan.n_storages,
            "spans": plan.n_spans,
            "check_s": min(checks),
            "bytes": sum(it.nbytes for it in plan._items),
            "reps": reps,
            "build_s": build,
            "run_s": min(runs),
            "rows_only_s": min(rows),
        }

    return llm.collective_rpc(work)[0]  # type: ignore[no-any-return]


def engine_kwargs(
    model: str,
    shape: str,
    *,
    graphs: bool = False,
    max_model_len: int = 2048,
    load_format: str = "dummy",
) -> dict[str, Any]:
    """The in-process LLM's arguments the benches share: sleep mode, bf16, token ids only,
    the shape's memory utilization, the extension; `load_format` "auto": the checkpoint."""
    return {
        "model": model,
        "load_format": load_format,
        "skip_tokenizer_init": True,
        "enable_sleep_mode": True,
        "enforce_eager": not graphs,
        "max_model_len": max_model_len,
        "gpu_memory_utilization": UTIL[shape],
        "dtype": "bfloat16",
        "seed": 0,
        "max_num_seqs": 8,
        "disable_log_stats": True,
        "worker_extension_cls": "worker_ext.HotSwapExtension",
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    ap.add_argument("--via", choices=("extension", "backend"), default="extension")
    ap.add_argument("--cycles", type=int, default=2)
    ap.add_argument(
        "--graphs", type=int, default=0, help="1: vLLM's default compile and CUDA graphs"
    )
    ap.add_argument("--raw-cycles", type=int, default=1, help="per --asleep-s value")
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument(
        "--verify-kernel",
        default="auto,off",
        help="HOTSWAP_VERIFY_KERNEL values, each run for --cycles cycles",
    )
    ap.add_argument(
        "--protect",
        default="ranges",
        help="the tuning's protect variants (ranges, objects), each run for --cycles cycles",
    )
    ap.add_argument(
        "--prepare-levels",
        default="1",
        help="levels prepare protects for (2: what a level-2 sleep protects, on the level-1"
        " cycle, so its cost is measured on the same wake; extension only)",
    )
    ap.add_argument(
        "--asleep-s",
        default="2,0",
        help="seconds between the end of a sleep and the wake (raw vLLM and ours alike):"
        " the driver scrubs released device memory in the background for a while",
    )
    ap.add_argument(
        "--codecs",
        default="exp,none",
        help="HOTSWAP_HOST_CODEC variants (exp, none), each run for --cycles cycles, in turn",
    )
    ap.add_argument(
        "--codec-variants",
        default=":",
        help="variants of the exp codec, in turn, each DECODER[:SLOTS[:ALIGN]]: DECODER the"
        " decode kernel (planes, groups; empty: the codec's), SLOTS its staging slots, ALIGN"
        " the pieces' offset alignment in the host copy (bytes; default the codec's)",
    )
    ap.add_argument(
        "--codec-profile",
        type=int,
        default=0,
        help="1: after each coded variant's cycles, one more cycle with timing events around"
        " every piece (the wake's GPU time by kind: wire, decode, slot waits, CPU gaps)",
    )
    ap.add_argument(
        "--weights",
        choices=("realistic", "dummy"),
        default="realistic",
        help="realistic: every parameter redrawn like a trained model's after the dummy load"
        " (benchmarks/realweights.py); dummy: vLLM's uniform dummy values",
    )
    ap.add_argument(
        "--fused-sleeps",
        default="1",
        help="0: the prepare and the suspend as two RPCs; 1: one hotswap_sleep (the prepare"
        " under the weights' copies); comma-separated, each run for --cycles cycles",
    )
    ap.add_argument(
        "--plan-reuse",
        default="1",
        help="the tuning's codec_plan_reuse values for the exp codec (1, 0), comma-separated",
    )
    args = ap.parse_args()
    codecs = [c.strip() for c in args.codecs.split(",") if c.strip()]
    os.environ["HOTSWAP_HOST_CODEC"] = codecs[0]  # what the backend is made with
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    settings.tune(settings.Tuning(pin_early=False))  # warmed explicitly below, timed
    import torch
    import vllm
    from vllm import LLM

    res: dict[str, Any] = {
        "shape": args.shape,
        "via": args.via,
        "graphs": bool(args.graphs),
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cmd": " ".join(sys.argv),
    }
    bw = bandwidth()
    res.update(bw)
    log(f"pinned H2D {bw['h2d_Bps'] / GB:.1f} GB/s, D2H {bw['d2h_Bps'] / GB:.1f} GB/s")
    d = write_config(args.shape, tempfile.mkdtemp(prefix=f"{args.shape}-"))
    kw = engine_kwargs(d, args.shape, graphs=bool(args.graphs), max_model_len=args.max_model_len)
    if args.via == "backend":
        del kw["worker_extension_cls"]
    llm, res["llm_start_s"] = timed(LLM, **kw)
    res["weights_kind"] = args.weights
    if args.weights == "realistic":
        from benchmarks import realweights

        def fill(w: Any) -> int:
            model = w.worker.model_runner.get_model()
            return realweights.fill_model_(model.named_parameters(), seed=1)

        filled, res["fill_s"] = timed(llm.collective_rpc, fill)
        res["filled_bytes"] = int(filled[0])
        log(f"realistic weights: {filled[0] / GB:.2f} GB redrawn in {res['fill_s']:.1f} s")
    base = gen(llm)
    res["deterministic"] = gen(llm) == base
    equal: list[bool] = []

    asleeps = [float(a) for a in args.asleep_s.split(",") if a.strip()]
    # raw vLLM
    raw: list[dict[str, Any]] = []
    rss0 = rss()
    for asleep in asleeps:
        for _ in range(args.raw_cycles):
            _, ts = timed(llm.sleep, 1)
            r_asleep = rss()
            time.sleep(asleep)
            _, tw = timed(llm.wake_up)
            equal.append(gen(llm) == base)
            delta = r_asleep - rss0
            raw.append({"sleep_s": ts, "wake_s": tw, "asleep_s": asleep, "rss_asleep_delta": delta})
            log("raw", raw[-1], "equal", equal[-1])
    res["raw"] = raw
    t = time.perf_counter()
    torch._C._host_emptyCache()  # vLLM's per-record pinned backups stay cached after wake
    res["raw_host_empty_cache_s"] = time.perf_counter() - t

    drv: Any = Direct(llm) if args.via == "backend" else ViaExtension(llm)
    pools = drv.pools()
    res["pools"] = pools
    weights = int(pools["weights"])
    rss1 = rss()
    warm, res["warm_host_s"] = timed(drv.warm)
    res["warm"] = warm
    ours: list[dict[str, Any]] = []
    time_checks()
    kernels = [g.strip() for g in args.verify_kernel.split(",") if g.strip()]
    protects = [p.strip() for p in args.protect.split(",") if p.strip()]
    plevels = [int(p) for p in args.prepare_levels.split(",") if p.strip()]
    cvars = [c.strip() for c in args.codec_variants.split(",") if c.strip()]
    coded_variants = [f"exp/{m}" for m in cvars]
    fsleeps = [f.strip() not in ("0", "false") for f in args.fused_sleeps.split(",") if f]
    reuses = [r.strip() for r in args.plan_reuse.split(",") if r.strip()]
    variants = [
        (c, k, a, pr, pl, fs, ru)
        for c in [v for hc in codecs for v in (coded_variants if hc == "exp" else [hc])]
        for fs in fsleeps
        for ru in (reuses if c.startswith("exp") else reuses[:1])
        for k in kernels
        for pr in protects
        for pl in plevels
        for a in asleeps
    ]
    first_sleep = True
    for variant, vk, asleep, protect, plevel, fsleep, reuse in variants:
        hc, _, cvar = variant.partition("/")
        decoder, _, tune = cvar.partition(":")
        slots, _, align = tune.partition(":")
        switched = os.environ.get("HOTSWAP_HOST_CODEC") != hc
        os.environ["HOTSWAP_HOST_CODEC"] = hc
        os.environ["HOTSWAP_VERIFY_KERNEL"] = vk  # in-process worker
        reused = reuse.lower() not in ("0", "false", "no", "off")
        settings.tune(settings.Tuning(pin_early=False, protect=protect, codec_plan_reuse=reused))
        drv.use_env()  # the worker reads its settings once: hand it these
        if switched:  # a raw copy needs a bigger buffer: pin it now, not inside a sleep
            drv.warm()
        n_cycles = args.cycles + (1 if hc == "exp" and args.codec_profile else 0)
        for cycle in range(n_cycles):
            profiled = hc == "exp" and cycle >= args.cycles
            if hc == "exp":
                tuned = llm.collective_rpc(
                    tune_codec,
                    args=(
                        decoder or None,
                        int(slots) if slots else None,
                        profiled,
                        int(align) if align else None,
                    ),
                )[0]
            if args.via == "extension":
                s, ts = drv.sleep(plevel, fused=fsleep)
            else:
                s, ts = drv.sleep()
            r_asleep = rss()
            sus = s.get("suspend") or {}
            cs = (sus.get("timings") or {}) if isinstance(sus, dict) else {}
            prep_t = ((s.get("prepare") or {}).get("timings") or {}) if not fsleep else cs
            total = ts + s.get("quiesce_s", 0.0) + s.get("prepare_s", 0.0)
            log(
                "sleep",
                json.dumps(
                    {
                        "codec": variant,
                        "fused": fsleep,
                        "reuse": reuse,
                        "first": first_sleep,
                        "quiesce_s": s.get("quiesce_s"),
                        "prepare_rpc_s": s.get("prepare_s"),
                        "suspend_rpc_s": ts,
                        "total_s": total,
                        "prepare": {k: prep_t.get(k) for k in (
                            "records_s", "audit_s", "protect_plan_s", "snapshot_s", "prepare_s")},
                        "suspend": {k: v for k, v in cs.items() if k not in (
                            "records_s", "audit_s", "protect_plan_s", "snapshot_s")},
                        "overlapped": sus.get("overlapped"),
                    }
                ),
            )  # fmt: skip
            first_sleep = False
            time.sleep(asleep)
            n_checks = len(CHECKS)
            w, tw, tv = drv.wake()
            equal.append(gen(llm) == base)
            check = CHECKS[-1] if len(CHECKS) > n_checks else {}
            coded = llm.collective_rpc(lambda w: find_backend(w.worker).describe()["codec"])[0]
            ours.append(
                {
                    "codec": variant + (" (profiled)" if profiled else ""),
                    "fused_sleep": fsleep,
                    "plan_reuse": reuse,
                    "first_sleep": first_sleep,
                    "codec_tuned": tuned if hc == "exp" else None,
                    "codec_suspend": coded.get("last_suspend") if hc == "exp" else None,
                    "codec_wake": coded.get("last_wake") if profiled else None,
                    "protect": protect,
                    "prepare_level": plevel,
                    "protected_bytes": (s.get("prepare") or {}).get("protected_bytes"),
                    "protected_ranges": (s.get("prepare") or {}).get("protected_ranges"),
                    "unnamed_bytes": (s.get("prepare") or {}).get("unnamed_bytes"),
                    "prepare_s": s.get("prepare_s"),
                    "asleep_s": asleep,
                    "verify_kernel": vk,
                    "kernel_used": check.get("kernel"),
                    "kernel_error": check.get("kernel_error"),
                    "sleep_s": ts,
                    "sleep_total_s": ts + s.get("quiesce_s", 0.0) + s.get("prepare_s", 0.0),
                    "wake_s": tw,
                    "verify_s": tv,
                    "check_s": check.get("check_s", 0.0),
                    "verify_ok": bool(w.get("verify", {}).get("ok", True))
                    if isinstance(w.get("verify"), dict)
                    else None,
                    "rss_asleep_delta": r_asleep - rss1,
                    "sleep": s,
                    "wake": w,
                }
            )
            log(
                "ours",
                f"protect={protect} prepare_level={plevel}",
                f"protected_bytes={ours[-1]['protected_bytes']}",
                f"protected_ranges={ours[-1]['protected_ranges']}",
                f"unnamed_bytes={ours[-1]['unnamed_bytes']}",
                {k: v for k, v in ours[-1].items() if k.endswith("_s")},
                "equal",
                equal[-1],
            )
            if hc == "exp":
                w_ = ours[-1]["wake"]
                log(
                    "codec",
                    ours[-1]["codec"],
                    tuned,
                    "wake weights timings",
                    (w_.get("weights") or {}).get("timings"),
                    "copies_gpu_s",
                    ((w_.get("kv_cache") or {}).get("timings") or {}).get("copies_gpu_s"),
                    "profile",
                    ours[-1]["codec_wake"],
                )
    res["codec_describe"] = llm.collective_rpc(
        lambda w: find_backend(w.worker).describe().get("codec")
    )[0]
    log("codec", res["codec_describe"])
    if args.via == "extension":
        res["fingerprint"] = fingerprint_bench(llm)
        log("fingerprint", res["fingerprint"])
    res["ours"] = ours
    res["tokens_equal_every_cycle"] = all(equal) and res["deterministic"]
    h2d_bound = weights / bw["h2d_Bps"]
    d2h_bound = weights / bw["d2h_Bps"]
    res["h2d_bound_s"], res["d2h_bound_s"] = h2d_bound, d2h_bound

    rows = [
        ("weights pool", f"{weights / GB:.2f} GB", ""),
        ("pinned H2D / D2H", f"{bw['h2d_Bps'] / GB:.1f} / {bw['d2h_Bps'] / GB:.1f} GB/s", ""),
        ("H2D bound (weights / H2D)", f"{h2d_bound:.3f} s", "1.00x"),
        ("D2H bound (weights / D2H)", f"{d2h_bound:.3f} s", "1.00x"),
    ]
    for i, r in enumerate(raw):
        rows.append(
            (
                f"raw vLLM sleep #{i + 1} (then asleep {r['asleep_s']:g} s)",
                f"{r['sleep_s']:.3f} s",
                f"{r['sleep_s'] / d2h_bound:.2f}x D2H",
            )
        )
        rows.append(
            (
                f"raw vLLM wake #{i + 1} (after {r['asleep_s']:g} s asleep)",
                f"{r['wake_s']:.3f} s",
                f"{r['wake_s'] / h2d_bound:.2f}x H2D",
            )
        )
    rows.append(
        ("raw vLLM host RSS asleep / weights", f"{raw[0]['rss_asleep_delta'] / weights:.3f}", "")
        if raw
        else ("", "", "")
    )
    made = "ours: backend made and host buffer pinned (ahead of sleep)"
    rows.append((made, f"{res['warm_host_s']:.3f} s", ""))
    kw_ = (res["warm"].get("backend") or {}).get("verify_kernel_warm") or {}
    if kw_:
        rows.append(
            (
                "ours: verify kernel compiled and proven (when the backend is made)",
                f"{kw_['s']:.3f} s" + ("" if kw_["ok"] else f" FAILED: {kw_['error']}"),
                "",
            )
        )
    for i, r in enumerate(ours):
        check = "kernel" if r["kernel_used"] else "eager"
        fz = f"fused_sleep {int(r['fused_sleep'])}, reuse {r['plan_reuse']}"
        tag = f"codec {r['codec']}, {fz}, {check}, asleep {r['asleep_s']:g} s, #{i + 1}"
        tag = tag if r["verify_s"] else f"codec {r['codec']}, asleep {r['asleep_s']:g} s, #{i + 1}"
        rows.append(
            (
                f"ours sleep {tag}",
                f"{r['sleep_s']:.3f} s",
                f"{r['sleep_s'] / d2h_bound:.2f}x D2H",
            )
        )
        if "sleep_total_s" in r and r["sleep_total_s"] > r["sleep_s"]:
            rows.append(
                (
                    f"ours sleep incl. quiesce + prepare {tag}",
                    f"{r['sleep_total_s']:.3f} s",
                    f"{r['sleep_total_s'] / d2h_bound:.2f}x D2H",
                )
            )
        rows.append(
            (f"ours wake {tag}", f"{r['wake_s']:.3f} s", f"{r['wake_s'] / h2d_bound:.2f}x H2D")
        )
        if r["verify_s"]:
            rows.append(
                (
                    f"ours verification (fingerprint check) share {tag}",
                    f"{r['check_s']:.4f} s",
                    f"{100 * r['check_s'] / r['wake_s']:.1f}% of wake",
                )
            )
            rows.append(
                (
                    f"ours whole restore_and_verify RPC share {tag}",
                    f"{r['verify_s']:.4f} s",
                    f"{100 * r['verify_s'] / r['wake_s']:.1f}% of wake",
                )
            )
        rows.append(
            (
                f"ours host RSS asleep / weights {tag}",
                f"{r['rss_asleep_delta'] / weights:.3f}",
                "",
            )
        )
    rows.append(
        ("tokens+logprobs equal after every cycle", str(res["tokens_equal_every_cycle"]), "")
    )
    if args.via == "extension":
        rows.append(("verify ok after every cycle", str(all(r["verify_ok"] for r in ours)), ""))
    print(f"\n| {args.shape} ({args.via}) | value | ratio |\n|---|---|---|")
    for a, b, c in rows:
        if a:
            print(f"| {a} | {b} | {c} |")
    print(flush=True)
    if args.via == "extension" and ours:
        print(
            "| cycle | asleep | resume weights | resume kv_cache | restore_and_verify"
            " | of which fingerprint check | wake | prepare | check |"
        )
        print("|---|---|---|---|---|---|---|---|---|")
        for i, r in enumerate(ours):
            w = r["wake"]
            how = (
                "kernel"
                if r["kernel_used"]
                else f"eager ({r['kernel_error'] or 'HOTSWAP_VERIFY_KERNEL=' + r['verify_kernel']})"
            )
            print(
                f"| #{i + 1} | {r['asleep_s']:g} s"
                f" | {w['weights']['elapsed_s']:.4f} s"
                f" | {w['kv_cache']['elapsed_s']:.4f} s | {w['verify']['elapsed_s']:.4f} s"
                f" | {r['check_s']:.4f} s | {r['wake_s']:.4f} s"
                f" | {r['sleep']['prepare']['elapsed_s']:.4f} s"
                f" ({r['sleep']['prepare']['fingerprinted']} tensors) | {how} |"
            )
        print(
            "\nwake by step, inside the worker (s): weights = map each record and queue its"
            " copies; copies on GPU = CUDA events, first copy to last; wait = host wait for"
            " them; kv = map the KV pool (its thread's CPU time; the"
            " time in cuMemCreate / cuMemMap / cuMemSetAccess); after = vLLM side effects;"
            " rebind / restore / verify = restore_and_verify's steps (restore ends with a"
            " device sync)\n"
        )
        print(
            "| cycle | weights | copies on GPU | wait | kv (cpu) | kv create / map / access"
            " | after | rebind | restore | verify |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for i, r in enumerate(ours):
            w = r["wake"]
            tw_ = w["weights"].get("timings") or {}
            tk_ = w["kv_cache"].get("timings") or {}
            tv_ = w["verify"].get("timings") or {}

            def f(d: dict[str, Any], k: str) -> str:
                v = d.get(k)
                return f"{v:.4f}" if isinstance(v, (int, float)) else "-"

            steps = " / ".join(f(tk_, f"kv_cache_{k}_s") for k in ("create", "map", "access"))
            print(
                f"| #{i + 1} ({'kernel' if r['kernel_used'] else 'eager'},"
                f" asleep {r['asleep_s']:g} s) | {f(tw_, 'weights_s')}"
                f" | {f(tk_, 'copies_gpu_s')} | {f(tk_, 'wait_copies_s')}"
                f" | {f(tk_, 'kv_cache_s')} ({f(tk_, 'kv_cache_cpu_s')}) | {steps}"
                f" | {f(tk_, 'after_resume_s')} | {f(tv_, 'rebind_s')} | {f(tv_, 'restore_s')}"
                f" | {f(tv_, 'verify_s')} |"
            )
        fb = res.get("fingerprint") or {}
        if fb:
            print(
                f"\nfingerprint of {fb['tensors']} tensors ({fb['bytes'] / GB:.2f} GB,"
                f" {fb['storages']} storages in {fb['spans']} byte-adjacent spans), best of"
                f" {fb['reps']}: plan build {fb['build_s']:.4f} s; verify's check (one batch"
                f" over the spans, one host copy) {fb['check_s']:.4f} s; per-storage run"
                f" {fb['run_s']:.4f} s; per-storage row sums alone {fb['rows_only_s']:.4f} s;"
                f" kernel check (one launch over {fb['kernel_pieces']} pieces, one bool)"
                f" {fb['kernel_check_s']:.4f} s; kernel plan + baseline"
                f" {fb['kernel_baseline_s']:.4f} s; kernel saw one flipped bit:"
                f" {fb['kernel_saw_flip']}, clean again:"
                f" {fb['kernel_clean_after']}; kernel error {fb['kernel_error']}"
            )
        print(flush=True)
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "bench.jsonl"), "a") as f:
        f.write(json.dumps(res, default=str) + "\n")
    # Whole-wake breakdown through the sidecar (controller -> HTTP -> collective_rpc) goes
    # here once the controller exists: same table, plus per-phase times from its transition.
    ok = res["tokens_equal_every_cycle"] and all(r["verify_ok"] is not False for r in ours)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
