"""The JSON shapes of the control API: snapshots, transitions, phases and outcomes as plain
dicts (what GET /models, /health and the sleep and wake answers carry)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from controller.config.settings import Settings
from controller.models.modelmanager import Outcome
from controller.models.record import ModelRecord
from controller.state import ModelSnapshot, PhaseRecord, TransitionRecord


def plain(value: Any) -> Any:
    """A JSON-safe copy of a rank report: NaN/inf would make the response itself fail."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, Mapping):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        return [plain(v) for v in value]
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def phase_dict(p: PhaseRecord) -> dict[str, Any]:
    return {
        "name": p.name,
        "duration_s": p.duration_s,
        "ok": p.ok,
        "ranks": plain(p.ranks),
        "detail": plain(p.detail),
    }


def transition_dict(t: TransitionRecord | None) -> dict[str, Any] | None:
    if t is None:
        return None
    return {
        "kind": t.kind,
        "from_state": t.from_state.value,
        "to_state": t.to_state.value,
        "result": t.result,
        "level": t.level,
        "started_at": t.started_at,
        "ended_at": t.ended_at,
        "duration_s": t.duration_s,
        "error": t.error,
        "failed_phase": t.failed_phase,
        "phases": [phase_dict(p) for p in t.phases],
    }


def snapshot_dict(s: ModelSnapshot) -> dict[str, Any]:
    return {
        "name": s.name,
        "state": s.state.value,
        "since": s.since,
        "gate": s.gate.value,
        "verified": s.verified,
        "unverified_wake": s.unverified_wake,
        "ready": s.ready,
        "level": s.level,
        "last_transition": transition_dict(s.last_transition),
        "last_error": s.last_error,
        "phase": s.phase,
        "keep_prefix_cache": s.keep_prefix_cache,
        "resident_bytes": s.resident_bytes,
        "deep": s.deep,
        "deep_error": s.deep_error,
        "extra": {"phase": s.phase} if s.phase is not None else {},  # the old place of `phase`
    }


def outcome_dict(name: str, outcome: Outcome) -> dict[str, Any]:
    snap = outcome.snapshot
    return {
        "model": name,
        "action": outcome.action.value,
        "state": snap.state.value,
        "verified": snap.verified,
        "level": snap.level,
        "transition": transition_dict(outcome.transition),
    }


def health_entry(s: ModelSnapshot, ready: bool) -> dict[str, Any]:
    return {
        "state": s.state.value,
        "verified": s.verified,
        "unverified_wake": s.unverified_wake,
        "gate": s.gate.value,
        "ready": ready,
    }


def fleet_dict(rec: ModelRecord, settings: Settings) -> dict[str, Any]:
    """Where a model runs and what the fleet policy counts for it (GET /models' `fleet`)."""
    m = rec.settings
    idle_s, idle_level = settings.idle_sleep(m)
    return {
        "devices": list(m.placement),
        "visible_devices": m.env.get("CUDA_VISIBLE_DEVICES"),
        "pinned": m.pinned,
        "footprint_bytes": rec.holdings.footprint,
        "asleep_bytes": rec.leftover_bytes,
        "host_bytes": rec.holdings.host_bytes,
        "host_weights_bytes": rec.holdings.host_weights,
        "demotable": rec.holdings.demotable,
        "wake_scratch_bytes": rec.holdings.wake_scratch,
        "idle_sleep_s": idle_s,
        "idle_sleep_level": idle_level,
        "idle_slept_at": rec.swapping.idle_slept_at,
        "deep_sleep": m.deep_sleep,
        "deepable": rec.ckpt.deepable,
        "deep_refused": rec.ckpt.refused,
        "sleep_driver": m.sleep_driver,
        "accept_unverified_wake": m.accept_unverified_wake,
        "vllm_asleep": rec.facts.vllm_asleep,
    }


def model_dict(rec: ModelRecord, settings: Settings) -> dict[str, Any]:
    """One model of GET /models: its snapshot and its `fleet` entry."""
    return {**snapshot_dict(rec.snapshot), "fleet": fleet_dict(rec, settings)}


def fleet_summary(
    fleet: Mapping[str, ModelRecord], settings: Settings, host_budget_bytes: int | None
) -> dict[str, Any]:
    """GET /models' `fleet`: the pod's devices, the host budget and what the models hold."""
    swap = settings.swap
    return {
        "devices": swap.devices,
        "host_budget": swap.host_budget,
        "host_budget_bytes": host_budget_bytes,
        "host_bytes": sum(r.holdings.host_bytes for r in fleet.values()),
        "idle_sleep_s": swap.idle_sleep_s,
        "idle_sleep_level": swap.idle_sleep_level,
    }


def iso(ts: float | None) -> str | None:
    """Unix seconds as ISO 8601 UTC to the second (None, and 0 meaning never: None)."""
    if not ts:
        return None
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def compact_transition(t: TransitionRecord | None) -> dict[str, Any] | None:
    """A transition without its phases and rank reports: what it was and how it ended."""
    if t is None:
        return None
    return {
        "kind": t.kind,
        "result": t.result,
        "duration_s": round(t.duration_s, 3),
        "ended": iso(t.ended_at),
        "error": t.error,
        "failed_phase": t.failed_phase,
    }


def compact_dict(rec: ModelRecord) -> dict[str, Any]:
    """One model of GET /models (compact): its state, since when, and its last use."""
    s, now = rec.snapshot, rec.clock()
    return {
        "name": s.name,
        "state": s.state.value,
        "ready": s.ready,
        "verified": s.verified,
        "unverified_wake": s.unverified_wake,
        "level": s.level,
        "phase": s.phase,
        "since": iso(s.since),
        "for_s": round(max(0.0, now - s.since), 1),
        "last_used": iso(rec.lane.last_used),
        "devices": list(rec.settings.placement),
        "last_transition": compact_transition(s.last_transition),
        "last_error": s.last_error,
    }
