"""The worker extension's settings, read once from the environment into a frozen object.

The variables (README, "worker settings") are read when the extension's state is made in a
worker process (its first RPC) and never again: a running worker's environment does not
change. Tests and benches that change a variable in a live worker hand the extension a new
object (`_HotswapState.use_settings`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


def _word(env: Mapping[str, str], name: str, default: str) -> str:
    return env.get(name, default).strip().lower()


def _choice(env: Mapping[str, str], name: str, allowed: tuple[str, ...], default: str) -> str:
    value = _word(env, name, default)
    return value if value in allowed else default


@dataclass(frozen=True)
class WorkerSettings:
    keep_host_backup: bool = True  # HOTSWAP_KEEP_HOST_BACKUP: keep the pinned buffer after a wake
    pin_mode: str = "early"  # HOTSWAP_PIN_HOST_BACKUP: early (background) | lazy (first sleep)
    kv_map_mode: str = "wait"  # HOTSWAP_RESUME_KV: wait | overlap
    map_impl: str = "driver"  # HOTSWAP_MAP_IMPL: driver (cudriver.py) | vllm (create_and_map)
    map_handles: str = "vllm"  # HOTSWAP_MAP_HANDLES: vllm (exportable, as vLLM asks) | none
    pin_threads: int = 4  # HOTSWAP_PIN_THREADS: threads that populate and register the buffer
    resume_sync: bool = False  # HOTSWAP_RESUME_SYNC: a resume waits for its own copies
    verify_kernel: str = "auto"  # HOTSWAP_VERIFY_KERNEL: auto (CUDA) | on (also CPU) | off
    protect: str = "ranges"  # HOTSWAP_PROTECT: ranges (CUDA) | objects
    # HOTSWAP_HOST_CODEC: exp (worker_ext/codec.py: the level-1 host copy coded on the GPU,
    # measured fastest and lossless, docs/benchmarks.md) | none (raw bytes)
    host_codec: str = "exp"
    # HOTSWAP_CODEC_PIECE_MIB: bytes the codec moves per copy; its GPU scratch is two
    # pieces (double buffer), 2 x 64 MiB by default
    codec_piece_mib: int = 64
    # HOTSWAP_CODEC_SLOTS: staging slots of one piece each on the device while a coded
    # sleep or wake runs (2..64); with HOTSWAP_CODEC_MAP=first a wake fills them all before
    # it maps the weights, so their copies overlap the mapping
    codec_slots: int = 2
    # HOTSWAP_CODEC_COPY_STREAMS: 1 | 2 streams that take a coded wake's host-to-device
    # copies in turn (2: two copies in flight, as the raw copies run; the wake then holds
    # at least 4 slots); on an H200 one stream's copies of the coded pieces ran at 43 GB/s
    codec_copy_streams: int = 1
    # HOTSWAP_CODEC_MAP: interleaved (each record's pieces queued once it is mapped) |
    # first (every staging slot filled from the host first, then every record mapped, then
    # every piece decoded: no driver mapping call while the decoder runs)
    codec_map: str = "interleaved"
    # HOTSWAP_DISK_DIR: the level-2 disk tier's directory (worker_ext/disktier.py); empty:
    # no tier, a level-2 wake reloads from the checkpoint as before
    disk_dir: str = ""
    # HOTSWAP_DISK_BUDGET_GB: bytes the tier's files may take in that directory (oldest go)
    disk_budget_bytes: int = 64 * 10**9
    # HOTSWAP_DISK_THREADS: parallel reads of a tier file (disktier.READ_BYTES each); on an
    # H200 a warm file read at 45.2 GB/s with 16 x 16 MiB, 28.9 with 8 x 64 MiB
    disk_threads: int = 16
    # HOTSWAP_WARM_PREPARE: 1 (the first hotswap_info of an awake rank runs a sleep's prepare
    # once and drops it, so the first real sleep does not pay its first-call costs) | 0
    warm_prepare: bool = True
    # HOTSWAP_DEMOTABLE: 1 (CUDA, by range: a level-1 prepare also protects what a level-2
    # wake needs, so hotswap_demote can release the host copy while asleep; it costs every
    # level-1 sleep, so the sidecar sets it for its managed engines under a host budget) | 0
    demotable: bool = False
    # HOTSWAP_CODEC_PLAN_REUSE: 1 (a coded sleep reuses the plan made ahead of time or the
    # previous sleep's for the same records, proven by a check over every chunk before any
    # record is released, else planned anew) | 0 (planned in every sleep, before its copies)
    codec_plan_reuse: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerSettings:
        """The settings in `env` (default: this process's environment); a value that is not
        one of a setting's words falls back to its default, as each variable documents."""
        env = os.environ if env is None else env
        keep = _word(env, "HOTSWAP_KEEP_HOST_BACKUP", "1") not in _OFF
        pin_default = "early" if keep else "lazy"
        try:
            threads = max(1, int(env.get("HOTSWAP_PIN_THREADS", "4")))
        except ValueError:
            threads = 4
        kernel = _word(env, "HOTSWAP_VERIFY_KERNEL", "auto")
        try:
            piece_mib = min(1024, max(2, int(env.get("HOTSWAP_CODEC_PIECE_MIB", "64"))))
        except ValueError:
            piece_mib = 64
        try:
            slots = min(64, max(2, int(env.get("HOTSWAP_CODEC_SLOTS", "2"))))
        except ValueError:
            slots = 2
        try:
            copy_streams = min(2, max(1, int(env.get("HOTSWAP_CODEC_COPY_STREAMS", "1"))))
        except ValueError:
            copy_streams = 1
        try:
            budget = max(0, int(float(env.get("HOTSWAP_DISK_BUDGET_GB", "64")) * 10**9))
        except ValueError:
            budget = 64 * 10**9
        try:
            disk_threads = max(1, int(env.get("HOTSWAP_DISK_THREADS", "16")))
        except ValueError:
            disk_threads = 16
        return cls(
            keep_host_backup=keep,
            pin_mode=_choice(env, "HOTSWAP_PIN_HOST_BACKUP", ("early", "lazy"), pin_default),
            kv_map_mode=_choice(env, "HOTSWAP_RESUME_KV", ("wait", "overlap"), "wait"),
            map_impl=_choice(env, "HOTSWAP_MAP_IMPL", ("vllm", "driver"), "driver"),
            map_handles=_choice(env, "HOTSWAP_MAP_HANDLES", ("vllm", "none"), "vllm"),
            pin_threads=threads,
            resume_sync=_word(env, "HOTSWAP_RESUME_SYNC", "0") in _ON,
            verify_kernel="off" if kernel in _OFF else "on" if kernel in _ON else "auto",
            protect="objects" if _word(env, "HOTSWAP_PROTECT", "ranges") == "objects" else "ranges",
            host_codec=_choice(env, "HOTSWAP_HOST_CODEC", ("exp", "none"), "exp"),
            codec_piece_mib=piece_mib,
            codec_slots=max(slots, 4) if copy_streams == 2 else slots,
            codec_copy_streams=copy_streams,
            codec_map=_choice(env, "HOTSWAP_CODEC_MAP", ("interleaved", "first"), "interleaved"),
            disk_dir=env.get("HOTSWAP_DISK_DIR", "").strip(),
            disk_budget_bytes=budget,
            disk_threads=disk_threads,
            warm_prepare=_word(env, "HOTSWAP_WARM_PREPARE", "1") not in _OFF,
            demotable=_word(env, "HOTSWAP_DEMOTABLE", "0") in _ON,
            codec_plan_reuse=_word(env, "HOTSWAP_CODEC_PLAN_REUSE", "1") not in _OFF,
        )
