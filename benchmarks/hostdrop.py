"""An awake engine's kept host backup dropped, and a coded wake's device scratch against
what the worker reports (issue 17: the host budget's first resort, and the scratch the
device policy adds to a wake's need).

    python3 -m benchmarks.hostdrop --shape llama32-1b            # the lent device
    python3 -m benchmarks.hostdrop --shape tiny --platform cpu   # the flow on vLLM-CPU

One in-process engine (VLLM_ENABLE_V1_MULTIPROCESSING=0: the worker is this process, so its
RSS and torch's allocator are read here), dummy bf16 weights, eager. The extension's RPCs in
controller.protocol's order:
1. a level-1 sleep (the suspend's `wake_scratch_bytes` and `resident_bytes`), then its wake
   with torch's peak statistics reset first: the device bytes torch allocated beyond what
   it held before the wake (the codec's staging is torch's) beside the reported scratch;
   tokens compared;
2. awake: `hotswap_info`'s `host_backup_bytes` (the pinned copy kept for the next sleep),
   then `hotswap_drop_backup`: the bytes it says it freed, this process's RSS before and
   after, `host_backup_bytes` after; tokens compared (serving is untouched);
3. the next level-1 sleep pins anew (its time against the first's), its wake verifies;
   tokens compared;
4. asleep, `hotswap_drop_backup` is refused and moves nothing (`phase`, `transitions`);
   the wake after it verifies.
Writes $OUT/hostdrop.json and prints one summary line per step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from benchmarks.common import SHAPES, dummy_engine_kwargs, gen, logger, rss, timed
from benchmarks.footprint import Ours
from controller import protocol

log = logger("bench")


def _torch_now(torch: Any, cuda: bool) -> dict[str, int]:
    if not cuda:
        return {}
    return {
        "allocated": int(torch.cuda.memory_allocated()),
        "reserved": int(torch.cuda.memory_reserved()),
        "free": int(torch.cuda.mem_get_info()[0]),
    }


def _wake_measured(torch: Any, cuda: bool, ours: Ours, level: int) -> dict[str, Any]:
    """A wake with torch's peak statistics reset first: what it allocated beyond before."""
    before = _torch_now(torch, cuda)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    w = ours.wake(level)
    out: dict[str, Any] = {
        "wake_s": w["wake_s"],
        "before": before,
        "after": _torch_now(torch, cuda),
    }
    if cuda:
        out["peak_allocated_over_before"] = (
            int(torch.cuda.max_memory_allocated()) - before["allocated"]
        )
        out["peak_reserved_over_before"] = (
            int(torch.cuda.max_memory_reserved()) - before["reserved"]
        )
    verify = w[protocol.VERIFY.phase]
    out["verify"] = {k: verify.get(k) for k in ("verified", "mismatched", "ok")}
    return out


def _truth(info: dict[str, Any]) -> tuple[Any, ...]:
    return info["phase"], info["transitions"], info["verified_transition"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="llama32-1b")
    ap.add_argument("--platform", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--util", type=float, default=0.2)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import torch

    cuda = args.platform == "cuda"
    t0 = time.perf_counter()
    res: dict[str, Any] = {
        "shape": args.shape,
        "platform": args.platform,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "cmd": " ".join(sys.argv),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if cuda else None,
    }
    import vllm
    from vllm import LLM

    res["vllm"] = vllm.__version__
    kw = dummy_engine_kwargs(args.shape, 1024, enforce_eager=True)
    if cuda:
        kw |= {"enable_sleep_mode": True, "gpu_memory_utilization": args.util}
    else:
        kw |= {"kv_cache_memory_bytes": 64 << 20}
    llm, res["llm_start_s"] = timed(LLM, **kw)
    log(f"engine up in {res['llm_start_s']:.1f} s")
    base = gen(llm)
    ours = Ours(llm)
    equal: list[bool] = []
    info = ours.rpc("hotswap_info")
    res["pools"] = info["pools"]
    res["codec"] = (info.get("backend_detail") or {}).get("codec", {}).get("setting")

    # 1. a level-1 sleep and its wake: the reported scratch against torch's peak
    s1 = ours.sleep(1)
    sus = s1["suspend"]
    asleep = ours.rpc("hotswap_info")
    res["sleep1"] = {
        "sleep_s": s1["sleep_s"],
        "wake_scratch_bytes": sus.get("wake_scratch_bytes"),
        "info_wake_scratch_bytes": asleep.get("wake_scratch_bytes"),
        "resident_bytes": sus.get("resident_bytes"),
        "codec_last_suspend": (asleep.get("backend_detail") or {})
        .get("codec", {})
        .get("last_suspend"),
    }
    res["wake1"] = _wake_measured(torch, cuda, ours, 1)
    equal.append(gen(llm) == base)
    log(
        "sleep 1:",
        f"{s1['sleep_s']:.3f} s, wake_scratch_bytes {sus.get('wake_scratch_bytes')},",
        f"wake {res['wake1']['wake_s']:.3f} s, torch peak over before",
        res["wake1"].get("peak_allocated_over_before"),
        "(reserved",
        res["wake1"].get("peak_reserved_over_before"),
        ")",
    )

    # 2. awake: the kept backup, dropped
    awake = ours.rpc("hotswap_info")
    rss_before = rss()
    dropped, drop_s = timed(ours.rpc, "hotswap_drop_backup")
    rss_after = rss()
    after = ours.rpc("hotswap_info")
    res["drop"] = {
        "host_backup_bytes_before": awake.get("host_backup_bytes"),
        "freed_host_bytes": dropped.get("freed_host_bytes"),
        "host_backup_bytes_after": after.get("host_backup_bytes"),
        "rss_before": rss_before,
        "rss_after": rss_after,
        "rss_released": rss_before - rss_after,
        "drop_s": drop_s,
        "truth_unchanged": _truth(awake) == _truth(after),
    }
    equal.append(gen(llm) == base)
    log(
        "drop:",
        f"kept {awake.get('host_backup_bytes')} B, freed {dropped.get('freed_host_bytes')},",
        f"after {after.get('host_backup_bytes')} B, RSS -{rss_before - rss_after} B",
        f"in {drop_s:.3f} s",
    )

    # 3. the next sleep pins anew; its wake verifies
    s2 = ours.sleep(1)
    res["sleep2"] = {
        "sleep_s": s2["sleep_s"],
        "host_wait_s": (s2["suspend"].get("timings") or {}).get("host_wait_s"),
        "wake_scratch_bytes": s2["suspend"].get("wake_scratch_bytes"),
    }
    res["wake2"] = _wake_measured(torch, cuda, ours, 1)
    res["host_backup_bytes_after_wake2"] = ours.rpc("hotswap_info").get("host_backup_bytes")
    equal.append(gen(llm) == base)
    log(
        "sleep 2 (pins anew):",
        f"{s2['sleep_s']:.3f} s against {s1['sleep_s']:.3f} s;",
        f"wake {res['wake2']['wake_s']:.3f} s, kept again",
        res["host_backup_bytes_after_wake2"],
    )

    # 4. asleep: refused, nothing moved; the wake verifies
    ours.sleep(1)
    before4 = ours.rpc("hotswap_info")
    refused = llm.collective_rpc("hotswap_drop_backup")[0]
    after4 = ours.rpc("hotswap_info")
    res["asleep_drop"] = {
        "ok": refused.get("ok"),
        "error": refused.get("error"),
        "truth_unchanged": _truth(before4) == _truth(after4),
        "host_backup_bytes": after4.get("host_backup_bytes"),
    }
    res["wake4"] = _wake_measured(torch, cuda, ours, 1)
    equal.append(gen(llm) == base)
    log("asleep drop:", res["asleep_drop"])
    res["tokens_equal"] = equal
    res["total_s"] = time.perf_counter() - t0
    out = os.environ.get("OUT", ".")
    with open(os.path.join(out, "hostdrop.json"), "w") as f:
        json.dump(res, f, default=str, indent=1)
    log("tokens equal after every step:", equal, f"total {res['total_s']:.1f} s")
    return 0 if all(equal) and res["asleep_drop"]["ok"] is False else 1


if __name__ == "__main__":
    raise SystemExit(main())
