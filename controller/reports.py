"""The typed rank reports: one rank's answer to one extension RPC, read once.

Each report keeps the plain dict the extension sent (`raw`) and the fields the controller
acts on, with anything missing or of the wrong type read as unknown; the `Step`s of
`controller.protocol` name which report type their method returns. `RankView` is a rank's
`hotswap_info` as reconciliation reads it (`controller.models.reconcile`). Stdlib only, like
`controller.protocol`: a GPU host imports both without the controller's packages.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self, TypeVar


def _int_map(value: object) -> dict[str, int]:
    if not isinstance(value, Mapping):
        return {}
    return {str(k): int(v) for k, v in value.items() if isinstance(v, int | float)}


def _opt_int(value: object) -> int | None:
    """An int or float report value as an int; None for anything else (bools included)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return int(value)


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
    wake_scratch_bytes: int = 0  # device bytes its wake takes for a while beyond the pools

    @classmethod
    def _fields(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        resident = _opt_int(raw.get("resident_bytes"))
        return {
            "freed_bytes": _int_map(raw.get("freed_bytes")),
            "resident_bytes": resident,
            "wake_scratch_bytes": max(0, _opt_int(raw.get("wake_scratch_bytes")) or 0),
        }


@dataclass(frozen=True)
class SleepReport(PrepareReport, SuspendReport):
    """`hotswap_sleep`'s answer: a prepare's and a suspend's report in one (its bytes freed
    are counted, what it left on the device read, as a suspend's are)."""

    @classmethod
    def _fields(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        return {**PrepareReport._fields(raw), **SuspendReport._fields(raw)}


@dataclass(frozen=True)
class ResumeReport(RankReport):
    restored_bytes: Mapping[str, int] = field(default_factory=dict)
    host_backup_bytes: int | None = None  # host RAM the rank keeps for its next sleep

    @classmethod
    def _fields(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "restored_bytes": _int_map(raw.get("restored_bytes")),
            "host_backup_bytes": _opt_int(raw.get("host_backup_bytes")),
        }


@dataclass(frozen=True)
class VerifyReport(RankReport):
    mismatched: tuple[str, ...] = ()

    @classmethod
    def _fields(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        return {"mismatched": _names(raw.get("mismatched"))}


@dataclass(frozen=True)
class WakeReport(ResumeReport, VerifyReport):
    """`hotswap_wake`'s answer: a resume's and a verify's report in one (the bytes it
    brought back are counted, its mismatches fail the wake as a verify's do)."""

    @classmethod
    def _fields(cls, raw: Mapping[str, Any]) -> dict[str, Any]:
        return {**ResumeReport._fields(raw), **VerifyReport._fields(raw)}


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
    resident_bytes: int | None = None  # what the rank holds on its device now (`resident`)
    wake_scratch_bytes: int = 0  # what its wake takes beyond the pools (0: asleep without)
    host_backup_bytes: int = 0  # host RAM it keeps pinned for its pools' copies now
    allocator_asleep: tuple[str, ...] = ()  # pools vLLM's own allocator holds asleep
    vllm_sleep: bool = False  # vLLM's own sleep in force through the hotswap backend
    model: str | None = None  # the model's class (hotswap_info `model`)
    served_model_name: str | None = None  # the name vLLM serves it under (None: not said)

    @classmethod
    def from_info(cls, report: Mapping[str, Any], index: int = 0) -> RankView:
        """Read one rank's plain dict; anything missing or of the wrong type reads as unknown."""

        def opt_int(key: str) -> int | None:
            v = report.get(key)
            return v if isinstance(v, int) and not isinstance(v, bool) else None

        def opt_str(key: str) -> str | None:
            v = report.get(key)
            return v if isinstance(v, str) and v else None

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
        resident = report.get("resident")
        held = resident.get("bytes") if isinstance(resident, Mapping) else None
        asleep = report.get("allocator_asleep")
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
            resident_bytes=held if isinstance(held, int) and not isinstance(held, bool) else None,
            wake_scratch_bytes=max(0, opt_int("wake_scratch_bytes") or 0),
            host_backup_bytes=max(0, opt_int("host_backup_bytes") or 0),
            allocator_asleep=tuple(sorted(str(t) for t in asleep))
            if isinstance(asleep, list | tuple)
            else (),
            vllm_sleep=report.get("vllm_sleep") is True,
            model=opt_str("model"),
            served_model_name=opt_str("served_model_name"),
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


def wake_scratch_bytes(reports: Iterable[RankReport]) -> int:
    """Device bytes the wake from this suspend takes beyond the pools, over its ranks (the
    codec's staging; 0 where no rank said)."""
    return sum(r.wake_scratch_bytes for r in reports if isinstance(r, SuspendReport))


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
