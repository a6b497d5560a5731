"""The worker extension's settings: what an operator sets, and what benchmarks tune.

`VARIABLES` is the one list of the `HOTSWAP_*` variables a worker reads: `WorkerSettings` is
read from it, docs/settings.md's worker section is generated from it (scripts/docgen.py runs
`python -m worker_ext.settings`), and a test holds the controller's allow-list (the
variables an engine inherits) to it. They are read when the extension's state is made in a
worker process (its first RPC) and never again: a running worker's environment does not
change. Tests and benches that change one in a live worker hand the extension a new object
(`_HotswapState.use_settings`).

`Tuning` holds the knobs the experiments behind each default turned (docs/benchmarks.md):
no variable sets them. A benchmark that drives the worker in its own process sets them
with `tune()` before the worker reads its settings.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

_OFF = ("0", "false", "no", "off")
_ON = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Tuning:
    """Knobs set in-process only (`tune()`); each default is the measured choice."""

    # pin the level-1 host buffer in the background when the backend is made (True) or at
    # the first level-1 sleep (False); None: early when the buffer is kept after a wake
    pin_early: bool | None = None
    pin_threads: int = 4  # threads that populate and register the pinned buffer
    # what a CUDA sleep protects: every at-risk byte by address range (ranges), or only the
    # tensors the ownership walk reaches (objects); the host backend always uses objects
    protect: str = "ranges"
    # bytes the codec moves per copy: its sleep's GPU scratch is two such pieces
    codec_piece_mib: int = 64
    codec_slots: int = 2  # staging slots (one piece each) a coded or tier wake holds
    # a coded sleep reuses the plan made ahead of time or the previous sleep's for the same
    # records, proven by a check over every chunk before any record is released
    codec_plan_reuse: bool = True
    disk_threads: int = 16  # parallel reads of a tier file (disktier.READ_BYTES each)
    # a fused sleep releases the KV records holding nothing its prepare protects before
    # the prepare (docs/contracts.md §1, the KV cache first); False: after it
    kv_early: bool = True
    # a fused sleep queues the copies of this share of the weights' bytes before its
    # prepare, the rest once the prepare's protected copies are queued behind them; more
    # delays the KV cache's early release and the prepare by its own queueing (measured
    # against 0.7 in docs/benchmarks.md, the sleep section)
    sleep_stage_share: float = 0.3
    # a sleep's KV records released first are lent to a rank of this user waking on the
    # same device, which maps them in place of new memory (cumem.kvlend: no driver scrub),
    # and a waking rank takes memory lent to it
    kv_lend: bool = True
    # a fused sleep releases those KV records on a thread of its own, through the driver's
    # calls (each drops the GIL), beside the copies' queueing and the prepare's host work,
    # and after the prepare the discarded pools on another, beside the weights' releases;
    # off: all on the sleep's thread (not yet measured on a GPU)
    kv_thread: bool = False
    # a fused sleep exports each KV and graph-pool record it releases and closes the
    # descriptor on a thread of its own, where the driver frees the memory, beside the
    # sleep's thread; the sleep answers once all are closed (not yet measured on a GPU)
    free_later: bool = False
    # a wake's create refused for memory is asked again for up to this long: an overlapped
    # swap maps the woken model's KV cache while the victim releases its own
    map_oom_wait_s: float = 5.0

    def __post_init__(self) -> None:
        bad = [
            name
            for name, ok in (
                ("pin_threads", self.pin_threads >= 1),
                ("protect", self.protect in ("ranges", "objects")),
                ("codec_piece_mib", 2 <= self.codec_piece_mib <= 1024),
                ("codec_slots", 2 <= self.codec_slots <= 64),
                ("disk_threads", self.disk_threads >= 1),
                ("map_oom_wait_s", 0 <= self.map_oom_wait_s <= 600),
                ("sleep_stage_share", 0 < self.sleep_stage_share <= 1),
            )
            if not ok
        ]
        if bad:
            raise ValueError(f"tuning out of range: {bad} in {self}")


_tuning = [Tuning()]


def tune(tuning: Tuning) -> None:
    """The tuning every later `WorkerSettings.from_env` in this process carries (benchmarks
    that run the worker in their own process; nothing else calls it)."""
    _tuning[0] = tuning


def tuning() -> Tuning:
    """The tuning `from_env` carries now."""
    return _tuning[0]


def _flag(default: bool) -> Callable[[str], bool]:
    """On/off: a default-on flag is off only for an off word, a default-off one on only
    for an on word."""

    def parse(raw: str) -> bool:
        word = raw.strip().lower()
        return word not in _OFF if default else word in _ON

    return parse


def _choice(*allowed: str) -> Callable[[str], str]:
    def parse(raw: str) -> str:
        word = raw.strip().lower()
        if word not in allowed:
            raise ValueError(f"{raw!r} is not one of {allowed}")
        return word

    return parse


def _verify_kernel(raw: str) -> str:
    word = raw.strip().lower()
    return "off" if word in _OFF else "on" if word in _ON else "auto"


def _gigabytes(raw: str) -> int:
    return max(0, int(float(raw) * 10**9))


@dataclass(frozen=True)
class Variable:
    """One `HOTSWAP_*` variable: the field it sets, its default as written in the
    environment (a value `parse` refuses falls back to it) and what it is for."""

    name: str
    field: str
    default: str
    parse: Callable[[str], Any]
    doc: str


VARIABLES: tuple[Variable, ...] = (
    Variable(
        "HOTSWAP_KEEP_HOST_BACKUP",
        "keep_host_backup",
        "1",
        _flag(True),
        "keep the pinned host buffer of the level-1 weights (exactly their bytes, or their"
        " coded size) after a wake for the next sleep, pinned in the background when the"
        " extension starts; `0`: give it back when the wake's copies end (the next sleep"
        " pins anew, and pays for it)",
    ),
    Variable(
        "HOTSWAP_HOST_CODEC",
        "host_codec",
        "exp",
        _choice("exp", "none"),
        "`exp`: the level-1 host copy losslessly coded on the GPU (`worker_ext/codec.py`:"
        " exponents by a per-chunk table, sign and mantissa raw), less host RAM and a"
        " shorter wake than raw bytes (docs/benchmarks.md); `none`: raw bytes. If its"
        " kernels fail their proof when the extension starts, raw bytes, said in"
        " `hotswap_info`",
    ),
    Variable(
        "HOTSWAP_VERIFY_KERNEL",
        "verify_kernel",
        "auto",
        _verify_kernel,
        "verify's fingerprint check as one Triton kernel on CUDA (`auto`; `on`: also on"
        " CPU); `off`: the eager torch check (also the fallback if Triton is missing or"
        " fails its self-check)",
    ),
    Variable(
        "HOTSWAP_WARM_PREPARE",
        "warm_prepare",
        "1",
        _flag(True),
        "the first `hotswap_info` of an awake rank runs one level-1 prepare and drops it,"
        " so that the first sleep does not pay the prepare's first-call costs (`0`: off);"
        " its time is `warm_prepare` in `hotswap_info`",
    ),
    Variable(
        "HOTSWAP_DEMOTABLE",
        "demotable",
        "0",
        _flag(False),
        "`1`: a level-1 sleep on CUDA also protects what a level-2 wake needs, so the"
        " sidecar's host budget can demote the sleeper to level 2 (`hotswap_demote`); it"
        " costs every level-1 sleep (docs/benchmarks.md), so the sidecar sets it for the"
        " managed engines it starts when `swap.host_budget` is set; `0`: a demotion is"
        " refused",
    ),
    Variable(
        "HOTSWAP_DISK_DIR",
        "disk_dir",
        "",
        str.strip,
        "the level-2 disk tier's directory (`worker_ext/disktier.py`): a level-2 sleep"
        " writes the weights' coded bytes there once, in the background, and a level-2 wake"
        " reads them back instead of `reload_weights`; a file that does not match is"
        " refused with its reason, deleted, and the weights are reloaded. Empty: no tier",
    ),
    Variable(
        "HOTSWAP_DISK_BUDGET_GB",
        "disk_budget_bytes",
        "64",
        _gigabytes,
        "gigabytes the tier's files may take in that directory (the oldest go first; a file"
        " larger than the budget is not written)",
    ),
    Variable(
        "HOTSWAP_GRAPH_POOL",
        "graph_pool",
        "release",
        _choice("release", "keep", "poison"),
        "`release`: on CUDA with sleep mode at world size 1, vLLM's CUDA graphs are captured"
        " into a CuMem pool that sleeps with the KV cache, released without a copy and"
        " mapped back empty (`worker_ext/graphpool.py`): a sleeper and a deep sleep's"
        " checkpoint no longer hold it; `keep`: vLLM's own graph pool, resident while"
        " asleep; `poison`: as `release`, and every wake fills it with 0xFF bytes before"
        " anything runs (a test's proof that no replay reads what it held before the sleep)",
    ),
)


@dataclass(frozen=True)
class WorkerSettings:
    """What a worker reads from `VARIABLES` (one field each), and the process's tuning."""

    keep_host_backup: bool = True
    host_codec: str = "exp"
    verify_kernel: str = "auto"
    warm_prepare: bool = True
    demotable: bool = False
    disk_dir: str = ""
    disk_budget_bytes: int = 64 * 10**9
    graph_pool: str = "release"
    tuning: Tuning = dataclasses.field(default_factory=Tuning)

    @property
    def pin_early(self) -> bool:
        """Whether the host buffer is pinned when the backend is made."""
        early = self.tuning.pin_early
        return self.keep_host_backup if early is None else early

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> WorkerSettings:
        """The settings in `env` (default: this process's environment) with this process's
        tuning; a value a variable refuses falls back to its default."""
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for var in VARIABLES:
            try:
                values[var.field] = var.parse(env.get(var.name, var.default))
            except ValueError:
                values[var.field] = var.parse(var.default)
        return cls(**values, tuning=tuning())


def names() -> list[str]:
    """Every variable a worker reads."""
    return [v.name for v in VARIABLES]


def markdown() -> str:
    """docs/settings.md's worker table."""
    rows = ["| variable | default | what it does |", "| --- | --- | --- |"]
    for v in VARIABLES:
        default = f"`{v.default}`" if v.default else "(none)"
        rows.append(f"| `{v.name}` | {default} | {v.doc} |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
