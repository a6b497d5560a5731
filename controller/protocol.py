"""The sleep and wake RPC sequences as data, and the typed rank reports they return.

Written once, read by everyone who drives a worker extension: the controller's runner
(`controller.runner`), the worker-extension tests (in-process `LLM.collective_rpc`), the
GPU tests and the benchmarks. Dependency-free on purpose (stdlib only), so a GPU host that
has only `worker_ext` and vLLM can import it without the controller's packages.

A `Step` names its phase (the name the transition record, the metrics and the logs use),
the extension method, how its arguments are built from the `Params` of one transition,
which timeout bounds its HTTP call, how each rank's report is read, and what a rank
failure of this step means (`fault`). `sleep_steps(level)` and `wake_steps(level)` are the
only places the order is written:

    sleep:  hotswap_quiesce(timeout_s) -> hotswap_prepare(level) -> hotswap_suspend(level)
    wake:   hotswap_resume(["weights"]) -> [level 2: hotswap_reload()]
            -> hotswap_resume(["kv_cache"]) -> hotswap_restore_and_verify()

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
import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, Self, TypeVar

# What a rank failure of a step means, beyond "the engine needs a restart".
Fault = Literal["rank", "barrier", "verify"]


class Timeouts(Protocol):
    """The HTTP timeouts a step's call is bounded by (controller.settings.TimeoutSettings)."""

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


# ----------------------------------------------------------------------------- rank reports


def _int_map(value: object) -> dict[str, int]:
    if not isinstance(value, Mapping):
        return {}
    return {str(k): int(v) for k, v in value.items() if isinstance(v, int | float)}


def _names(value: object) -> tuple[str, ...]:
    if not isinstance(value, list | tuple):
        return ()
    return tuple(str(v) for v in value)


@dataclass(frozen=True)
class RankReport:
    """One rank's answer to one RPC; `raw` is the plain dict as the extension sent it."""

    ok: bool
    rank: int | None
    error: str | None
    elapsed_s: float | None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def parse(cls, raw: Mapping[str, Any]) -> Self:
        rank, elapsed = raw.get("rank"), raw.get("elapsed_s")
        error = raw.get("error")
        return cls(
            ok=raw.get("ok") is True,
            rank=rank if isinstance(rank, int) else None,
            error=str(error) if error is not None else None,
            elapsed_s=float(elapsed) if isinstance(elapsed, int | float) else None,
            raw=raw,
            **cls._fields(raw),
        )

    @classmethod
    def _fields(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        return {}


@dataclass(frozen=True)
class QuiesceReport(RankReport):
    late_ranks: tuple[int, ...] = ()
    barrier_s: float | None = None

    @classmethod
    def _fields(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        late = raw.get("late_ranks") or []
        barrier = raw.get("barrier_s")
        return {
            "late_ranks": tuple(int(n) for n in late if isinstance(n, int | float | str)),
            "barrier_s": float(barrier) if isinstance(barrier, int | float) else None,
        }


@dataclass(frozen=True)
class PrepareReport(RankReport):
    kv: str = "discard"  # what the rank can do with the KV cache: "keep" or "discard"
    kv_reason: str | None = None  # why not, when "keep" was asked

    @classmethod
    def _fields(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        reason = raw.get("kv_reason")
        return {
            "kv": "keep" if raw.get("kv") == "keep" else "discard",
            "kv_reason": str(reason) if reason is not None else None,
        }


@dataclass(frozen=True)
class SuspendReport(RankReport):
    freed_bytes: Mapping[str, int] = field(default_factory=dict)
    resident_bytes: int | None = None  # what the rank still holds on its device, asleep

    @classmethod
    def _fields(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        resident = raw.get("resident_bytes")
        if isinstance(resident, bool) or not isinstance(resident, int | float):
            resident = None
        return {
            "freed_bytes": _int_map(raw.get("freed_bytes")),
            "resident_bytes": int(resident) if resident is not None else None,
        }


@dataclass(frozen=True)
class ResumeReport(RankReport):
    restored_bytes: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def _fields(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        return {"restored_bytes": _int_map(raw.get("restored_bytes"))}


@dataclass(frozen=True)
class VerifyReport(RankReport):
    mismatched: tuple[str, ...] = ()

    @classmethod
    def _fields(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        return {"mismatched": _names(raw.get("mismatched"))}


@dataclass(frozen=True)
class InfoReport(RankReport):
    suspended: Mapping[str, str] = field(default_factory=dict)
    level: int | None = None

    @classmethod
    def _fields(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        suspended = raw.get("suspended")
        level = raw.get("level")
        return {
            "suspended": (
                {str(k): str(v) for k, v in suspended.items()}
                if isinstance(suspended, Mapping)
                else {}
            ),
            "level": level if isinstance(level, int) and not isinstance(level, bool) else None,
        }


class Phase(enum.StrEnum):
    """A rank's own phase, as `hotswap_info` reports it (docs/contracts.md §1.1)."""

    AWAKE_VERIFIED = "awake_verified"
    SUSPENDED = "suspended"
    RESUMED_UNVERIFIED = "resumed_unverified"
    FAILED = "failed"
    UNREPORTED = "unreported"  # no or an unknown `phase` key: not an extension we can trust


@dataclass(frozen=True)
class RankView:
    """One rank's `hotswap_info` answer, reduced to what reconciliation reads (the rank's
    phase and the signs of its process; `InfoReport` is the same answer's pools)."""

    rank: int
    ok: bool = True
    phase: Phase = Phase.AWAKE_VERIFIED
    level: int | None = None
    tags: tuple[str, ...] = ()
    reason: str | None = None
    transitions: int = 0
    verified_transition: int = 0
    snapshot_held: bool = False
    boot_id: str | None = None
    poisoned: bool = False
    world_size: int | None = None
    error: str | None = None

    @classmethod
    def from_info(cls, report: Mapping[str, Any], index: int = 0) -> RankView:
        """Read one rank's plain dict; anything missing or of the wrong type reads as unknown."""

        def opt_int(key: str) -> int | None:
            v = report.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        raw_phase = report.get("phase")
        try:
            phase = Phase(raw_phase) if isinstance(raw_phase, str) else Phase.UNREPORTED
        except ValueError:
            phase = Phase.UNREPORTED
        tags = report.get("phase_tags")
        rank = opt_int("rank")
        boot = report.get("boot_id")
        reason = report.get("phase_reason")
        error = report.get("error")
        return cls(
            rank=index if rank is None or rank < 0 else rank,
            ok=report.get("ok") is True,
            phase=phase,
            level=opt_int("phase_level"),
            tags=tuple(sorted(str(t) for t in tags)) if isinstance(tags, list | tuple) else (),
            reason=str(reason) if reason is not None else None,
            transitions=opt_int("transitions") or 0,
            verified_transition=opt_int("verified_transition") or 0,
            snapshot_held=report.get("snapshot_held") is True,
            boot_id=str(boot) if isinstance(boot, str) and boot else None,
            poisoned=report.get("poisoned") is True,
            world_size=opt_int("world_size"),
            error=str(error) if error is not None else None,
        )


def ranks_from_info(reports: Sequence[Mapping[str, Any]]) -> tuple[RankView, ...]:
    return tuple(RankView.from_info(r, i) for i, r in enumerate(reports))


R = TypeVar("R", bound=RankReport)


def parse_all(kind: type[R], ranks: Iterable[Mapping[str, Any]]) -> tuple[R, ...]:
    return tuple(kind.parse(r) for r in ranks)


def sum_by_pool(per_rank: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Per-pool bytes summed over ranks, e.g. every rank's `freed_bytes`."""
    out: dict[str, int] = {}
    for pools in per_rank:
        for pool, n in pools.items():
            out[pool] = out.get(pool, 0) + n
    return out


def resident_bytes(reports: Iterable[RankReport]) -> int | None:
    """What a suspended engine still holds on its devices, over its ranks (the suspend's
    reports); None when a rank did not say (an older extension)."""
    sus = [r for r in reports if isinstance(r, SuspendReport)]
    if not sus or any(r.resident_bytes is None for r in sus):
        return None
    return sum(r.resident_bytes or 0 for r in sus)


def kv_decision(reports: Iterable[RankReport]) -> tuple[bool, str | None]:
    """Whether every rank's prepare can keep the KV cache, and if not, why (every rank's
    reason, in rank order)."""
    preps = [r for r in reports if isinstance(r, PrepareReport)]
    if not preps:
        return False, "no rank answered the prepare"
    refused = [r for r in preps if r.kv != "keep"]
    if not refused:
        return True, None
    why = "; ".join(f"rank {r.rank}: {r.kv_reason or 'not asked to keep'}" for r in refused)
    return False, why


def late_ranks(reports: Iterable[RankReport]) -> list[int]:
    return sorted({n for r in reports if isinstance(r, QuiesceReport) for n in r.late_ranks})


def mismatched(reports: Iterable[RankReport]) -> list[str]:
    return sorted({n for r in reports if isinstance(r, VerifyReport) for n in r.mismatched})


def suspended_level(reports: Iterable[InfoReport]) -> int | None:
    """The level an engine is suspended at, read back from `hotswap_info`; None: awake."""
    asleep = [r for r in reports if r.suspended]
    if not asleep:
        return None
    level = next((r.level for r in asleep if r.level is not None), None)
    if level is not None:
        return level
    kinds = {v for r in asleep for v in r.suspended.values()}
    return 2 if kinds == {"discarded"} else 1


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
INFO = Step("info", "hotswap_info", lambda p: (), report=InfoReport)
AUDIT = Step("hotswap_audit", "hotswap_audit", lambda p: (p.level, True))

# Which pool a wake step brings back (a partial sleep suspends only some of them).
_POOL_OF = {RESUME_WEIGHTS.phase: "weights", RELOAD.phase: "weights", RESUME_KV.phase: "kv_cache"}


def sleep_steps(level: int, *, split: bool = False) -> tuple[Step, ...]:
    """The RPCs of a sleep at `level`, in order (after the engine is paused, cache cleared).
    `split`: the KV cache released alone first, then the weights (an overlapped swap)."""
    _check_level(level)
    if split:
        return (QUIESCE, PREPARE, SUSPEND_KV, SUSPEND_WEIGHTS)
    return (QUIESCE, PREPARE, SUSPEND)


def wake_steps(level: int, suspended: Iterable[str] | None = None) -> tuple[Step, ...]:
    """The RPCs of a wake from `level`, in order (before the engine is resumed).

    `suspended`: the pools actually asleep (a partial sleep); None: both, as a full sleep
    leaves them. Verification always runs."""
    _check_level(level)
    steps: tuple[Step, ...] = (
        (RESUME_WEIGHTS, RELOAD, RESUME_KV) if level == 2 else (RESUME_WEIGHTS, RESUME_KV)
    )
    if suspended is not None:
        asleep = set(suspended)
        steps = tuple(s for s in steps if _POOL_OF[s.phase] in asleep)
    return (*steps, VERIFY)


def _check_level(level: int) -> None:
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, not {level}")


def with_method(steps: Sequence[Step], phase: str, method: str) -> tuple[Step, ...]:
    """The same sequence with one phase's method swapped (e.g. a test's own reload)."""
    return tuple(dataclasses.replace(s, method=method) if s.phase == phase else s for s in steps)
