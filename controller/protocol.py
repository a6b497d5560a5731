"""The sleep and wake RPC sequences as data (their typed rank reports: controller.reports).

Written once, read by everyone who drives a worker extension: the controller's runner
(`controller.models.runner`), the worker-extension tests (in-process `LLM.collective_rpc`), the
GPU tests and the benchmarks. Dependency-free on purpose (stdlib only), so a GPU host that
has only `worker_ext` and vLLM can import it without the controller's packages.

A `Step` names its phase (the name the transition record, the metrics and the logs use),
the extension method, how its arguments are built from the `Params` of one transition,
which timeout bounds its HTTP call, how each rank's report is read, and what a rank
failure of this step means (`fault`). `sleep_steps(level)` and `wake_steps(level)` are the
only places the order is written:

    sleep:  hotswap_quiesce(timeout_s) -> hotswap_prepare(level) -> hotswap_suspend(level)
    fused:  hotswap_quiesce(timeout_s) -> hotswap_sleep(level)   (prepare + suspend, one RPC)
    wake:   hotswap_resume(["weights"]) -> [level 2: hotswap_reload()]
            -> hotswap_resume(["kv_cache"]) -> hotswap_restore_and_verify()
    fused:  [level 2 or split: hotswap_resume(["weights"]) -> [level 2: hotswap_reload()]]
            -> hotswap_wake()   (the rest resumed, restored and verified in one RPC)

A sleep split by pool (`sleep_steps(level, split=True)`, what an overlapped swap runs)
releases the KV cache first, alone, and the weights after it:

    hotswap_quiesce -> hotswap_prepare -> hotswap_suspend(level, ["kv_cache"])
        -> hotswap_suspend(level, ["weights"])

so that the model woken in its place can map its weights while these go to the host.

The controller wraps them in its engine-level steps (drain before the sleep's, /resume and
a warm-up after the wake's); an in-process caller clears the prefix cache instead of the
drain (`/pause?clear_cache=true` does that) and runs the RPC steps as they are.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from controller.reports import (
    InfoReport,
    PrepareReport,
    QuiesceReport,
    RankReport,
    ResumeReport,
    SleepReport,
    SuspendReport,
    VerifyReport,
    WakeReport,
    parse_all,
)

# What a rank failure of a step means, beyond "the engine needs a restart".
Fault = Literal["rank", "barrier", "verify"]


class Timeouts(Protocol):
    """The HTTP timeouts a step's call is bounded by (config.settings.TimeoutSettings)."""

    @property
    def rpc_s(self) -> float: ...

    @property
    def reload_s(self) -> float: ...

    @property
    def quiesce_s(self) -> float: ...

    @property
    def control_s(self) -> float: ...


@dataclass(frozen=True)
class Params:
    """What one transition's steps are built from."""

    level: int = 1
    quiesce_timeout_s: float = 30.0  # the barrier's timeout inside the ranks
    tags: tuple[str, ...] | None = None  # suspend/resume only these pools (None: the level's)
    # Keep the KV cache (and so vLLM's prefix cache) across a level-1 sleep: the prepare
    # asks the ranks, the suspend keeps it (docs/contracts.md §1.3).
    keep_kv: bool = False


# ----------------------------------------------------------------------------- steps


def _rpc_timeout(t: Timeouts) -> float:
    return t.rpc_s


def _reload_timeout(t: Timeouts) -> float:
    return t.reload_s


def _quiesce_timeout(t: Timeouts) -> float:
    # The barrier timeout is an argument to the ranks; the HTTP timeout must outlast it.
    return max(t.rpc_s, t.quiesce_s + t.control_s)


@dataclass(frozen=True)
class Step:
    """One RPC of a sequence: phase, method, arguments, HTTP timeout, report type, fault."""

    phase: str
    method: str
    args: Callable[[Params], tuple[Any, ...]]
    timeout: Callable[[Timeouts], float] = _rpc_timeout
    report: type[RankReport] = RankReport
    fault: Fault = "rank"

    def call_args(self, params: Params) -> tuple[Any, ...]:
        return self.args(params)

    @property
    def suspends(self) -> bool:
        """Its ranks release pools (a suspend, or the fused sleep): their reports say what
        they freed and what they left on the device."""
        return issubclass(self.report, SuspendReport)

    def parse(self, ranks: Iterable[Mapping[str, Any]]) -> tuple[RankReport, ...]:
        return parse_all(self.report, ranks)


QUIESCE = Step(
    "quiesce",
    "hotswap_quiesce",
    lambda p: (p.quiesce_timeout_s,),
    timeout=_quiesce_timeout,
    report=QuiesceReport,
    fault="barrier",
)


def _prepare_args(p: Params) -> tuple[Any, ...]:
    return (p.level, "keep") if p.keep_kv else (p.level,)


def _suspend_args(p: Params) -> tuple[Any, ...]:
    tags = None if p.tags is None else list(p.tags)
    if p.keep_kv:
        return (p.level, tags, "keep")
    return (p.level,) if tags is None else (p.level, tags)


def _suspend_kv_args(p: Params) -> tuple[Any, ...]:
    return (p.level, ["kv_cache"], "keep") if p.keep_kv else (p.level, ["kv_cache"])


PREPARE = Step("prepare", "hotswap_prepare", _prepare_args, report=PrepareReport)
SUSPEND = Step("suspend", "hotswap_suspend", _suspend_args, report=SuspendReport)
# The sleep's prepare and suspend in one RPC (`sleep_steps(..., fused=True)`): every pool
# suspended, the KV cache discarded; on CUDA the prepare runs under the weights' copies.
PREPARE_SUSPEND = Step(
    "prepare_and_suspend", "hotswap_sleep", lambda p: (p.level,), report=SleepReport
)
SUSPEND_KV = Step("suspend_kv_cache", "hotswap_suspend", _suspend_kv_args, report=SuspendReport)
SUSPEND_WEIGHTS = Step(
    "suspend_weights", "hotswap_suspend", lambda p: (p.level, ["weights"]), report=SuspendReport
)
RESUME_WEIGHTS = Step(
    "resume_weights", "hotswap_resume", lambda p: (["weights"],), report=ResumeReport
)
RELOAD = Step("reload", "hotswap_reload", lambda p: (), timeout=_reload_timeout)
RESUME_KV = Step(
    "resume_kv_cache", "hotswap_resume", lambda p: (["kv_cache"],), report=ResumeReport
)
VERIFY = Step(
    "restore_and_verify",
    "hotswap_restore_and_verify",
    lambda p: (),
    report=VerifyReport,
    fault="verify",
)
# The wake's last resume and its verify in one RPC (`wake_steps(..., fused=True)`): every
# pool still asleep mapped back, then restored and verified; a mismatch fails it as VERIFY.
RESUME_VERIFY = Step(
    "resume_and_verify", "hotswap_wake", lambda p: (), report=WakeReport, fault="verify"
)
INFO = Step("info", "hotswap_info", lambda p: (), report=InfoReport)
AUDIT = Step("hotswap_audit", "hotswap_audit", lambda p: (p.level, True))
# Asleep at level 1 -> level 2 (the host copy released); one call outside a sequence.
DEMOTE = Step("demote", "hotswap_demote", lambda p: ())
# Awake: the host copies kept for the next sleep released (the host budget's first resort).
DROP_BACKUP = Step("drop_backup", "hotswap_drop_backup", lambda p: ())

# Which pool a wake step brings back (a partial sleep suspends only some of them).
_POOL_OF = {RESUME_WEIGHTS.phase: "weights", RELOAD.phase: "weights", RESUME_KV.phase: "kv_cache"}


def sleep_steps(level: int, *, split: bool = False, fused: bool = False) -> tuple[Step, ...]:
    """The RPCs of a sleep at `level`, in order (after the engine is paused, cache cleared).
    `split`: the KV cache released alone first, then the weights (an overlapped swap).
    `fused`: the prepare and the suspend are one `hotswap_sleep` (PREPARE_SUSPEND); not with
    `split`, nor for a sleep that keeps the KV cache (its prepare's answers decide first)."""
    _check_level(level)
    if split and fused:
        raise ValueError("a sleep split by pool has its own suspends: it cannot be fused")
    if split:
        return (QUIESCE, PREPARE, SUSPEND_KV, SUSPEND_WEIGHTS)
    if fused:
        return (QUIESCE, PREPARE_SUSPEND)
    return (QUIESCE, PREPARE, SUSPEND)


def wake_steps(
    level: int,
    suspended: Iterable[str] | None = None,
    *,
    fused: bool = False,
    split: bool = False,
) -> tuple[Step, ...]:
    """The RPCs of a wake from `level`, in order (before the engine is resumed).

    `suspended`: the pools actually asleep (a partial sleep); None: both, as a full sleep
    leaves them. Verification always runs. `fused`: the last resume and the verify are one
    `hotswap_wake` (RESUME_VERIFY), so a level-1 wake is one RPC; at level 2 the weights'
    resume and the reload stay before it; `split` keeps the weights' resume apart at level 1
    too (an overlapped swap waits for room between it and the KV cache's)."""
    _check_level(level)
    steps: tuple[Step, ...] = (
        (RESUME_WEIGHTS, RELOAD, RESUME_KV) if level == 2 else (RESUME_WEIGHTS, RESUME_KV)
    )
    if suspended is not None:
        asleep = set(suspended)
        steps = tuple(s for s in steps if _POOL_OF[s.phase] in asleep)
    if not fused:
        return (*steps, VERIFY)
    # hotswap_wake maps back whatever is still asleep: the KV cache's resume always goes
    # into it, the weights' too at level 1 unless split (level 2 reloads them in between).
    keep = {RELOAD.phase} | ({RESUME_WEIGHTS.phase} if level == 2 or split else set())
    return (*(s for s in steps if s.phase in keep), RESUME_VERIFY)


def _check_level(level: int) -> None:
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, not {level}")


def with_method(steps: Sequence[Step], phase: str, method: str) -> tuple[Step, ...]:
    """The same sequence with one phase's method swapped (e.g. a test's own reload)."""
    return tuple(dataclasses.replace(s, method=method) if s.phase == phase else s for s in steps)
