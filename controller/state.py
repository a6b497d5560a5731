"""The per-model state machine and the plain snapshot types readiness and metrics read.

Pure: no I/O, no asyncio, no clocks. The manager feeds events in and stores what comes
out; everything here is a frozen value that can be compared in table-driven tests.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any


class State(enum.StrEnum):
    UNKNOWN = "UNKNOWN"  # not probed yet: the sidecar has just started
    STARTING = "STARTING"  # a managed engine is booting
    RUNNING = "RUNNING"
    SUSPENDING = "SUSPENDING"
    SUSPENDED = "SUSPENDED"
    RESUMING = "RESUMING"
    FAILED = "FAILED"
    STOPPED = "STOPPED"  # a managed engine that is not running and not wanted


class Event(enum.StrEnum):
    PROBED_RUNNING = "probed_running"
    PROBED_SUSPENDED = "probed_suspended"
    SLEEP = "sleep"  # a sleep was asked for
    SLEEP_DONE = "sleep_done"
    SLEEP_GAVE_UP = "sleep_gave_up"  # drain=wait timed out: the engine is resumed, still RUNNING
    WAKE = "wake"
    WAKE_DONE = "wake_done"
    FAIL = "fail"
    START = "start"  # a managed engine is (re)started
    STARTED = "started"
    STOP = "stop"
    # Reconciliation found a sleep stopped before it suspended anything, or a wake stopped
    # before its verify: finish it (controller.models.reconcile).
    PROBED_UNFINISHED = "probed_unfinished"


class Request(enum.StrEnum):
    SLEEP = "sleep"
    WAKE = "wake"


class Action(enum.StrEnum):
    """What the manager does with a sleep or wake request in a given state."""

    BEGIN = "begin"  # start the transition
    NOOP = "noop"  # already there: answer with the current state
    JOIN = "join"  # the same transition is in flight: wait for it
    CONFLICT = "conflict"  # the opposite transition is in flight, or the state forbids it (409)


class TransitionNotAllowed(Exception):
    def __init__(self, state: State, event: Event | Request) -> None:
        super().__init__(f"{event.value} is not allowed in state {state.value}")
        self.state = state
        self.event = event


S, E = State, Event

TRANSITIONS: Mapping[tuple[State, Event], State] = {
    # Start-up probe of an engine someone else started.
    (S.UNKNOWN, E.PROBED_RUNNING): S.RUNNING,
    (S.UNKNOWN, E.PROBED_SUSPENDED): S.SUSPENDED,
    (S.UNKNOWN, E.FAIL): S.FAILED,
    # Sleep.
    (S.RUNNING, E.SLEEP): S.SUSPENDING,
    (S.SUSPENDING, E.SLEEP_DONE): S.SUSPENDED,
    (S.SUSPENDING, E.SLEEP_GAVE_UP): S.RUNNING,
    (S.SUSPENDING, E.FAIL): S.FAILED,
    # Wake.
    (S.SUSPENDED, E.WAKE): S.RESUMING,
    (S.RESUMING, E.WAKE_DONE): S.RUNNING,
    (S.RESUMING, E.FAIL): S.FAILED,
    # Failures seen outside a transition (engine died, probe failed).
    (S.RUNNING, E.FAIL): S.FAILED,
    (S.SUSPENDED, E.FAIL): S.FAILED,
    (S.FAILED, E.FAIL): S.FAILED,
    # Managed engines: (re)start, and stop.
    (S.UNKNOWN, E.START): S.STARTING,
    (S.FAILED, E.START): S.STARTING,
    (S.STOPPED, E.START): S.STARTING,
    (S.STARTING, E.STARTED): S.RUNNING,
    (S.STARTING, E.FAIL): S.FAILED,
    (S.STARTING, E.STOP): S.STOPPED,
    (S.RUNNING, E.STOP): S.STOPPED,
    (S.SUSPENDED, E.STOP): S.STOPPED,
    (S.FAILED, E.STOP): S.STOPPED,
    # A failed attached engine that answers again is probed afresh.
    (S.FAILED, E.PROBED_RUNNING): S.RUNNING,
    (S.FAILED, E.PROBED_SUSPENDED): S.SUSPENDED,
    # Reconciliation: the ranks' own truth overrides the cache (an engine restarted behind
    # the sidecar's back, a sequence a dead sidecar left half done).
    (S.RUNNING, E.PROBED_SUSPENDED): S.SUSPENDED,
    (S.SUSPENDED, E.PROBED_RUNNING): S.RUNNING,
    (S.UNKNOWN, E.PROBED_UNFINISHED): S.RESUMING,
    (S.STARTING, E.PROBED_UNFINISHED): S.RESUMING,
    (S.RUNNING, E.PROBED_UNFINISHED): S.RESUMING,
    (S.SUSPENDED, E.PROBED_UNFINISHED): S.RESUMING,
    (S.FAILED, E.PROBED_UNFINISHED): S.RESUMING,
}

REQUESTS: Mapping[tuple[State, Request], Action] = {
    (S.RUNNING, Request.SLEEP): Action.BEGIN,
    (S.SUSPENDING, Request.SLEEP): Action.JOIN,
    (S.SUSPENDED, Request.SLEEP): Action.NOOP,
    (S.RESUMING, Request.SLEEP): Action.CONFLICT,
    (S.SUSPENDED, Request.WAKE): Action.BEGIN,
    (S.RESUMING, Request.WAKE): Action.JOIN,
    (S.RUNNING, Request.WAKE): Action.NOOP,
    (S.SUSPENDING, Request.WAKE): Action.CONFLICT,
}


def next_state(state: State, event: Event) -> State:
    """The state after `event`; raises TransitionNotAllowed if the table has no such edge."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise TransitionNotAllowed(state, event) from None


def decide(state: State, request: Request) -> Action:
    """What to do with a sleep or wake request; any pair not in the table is a conflict."""
    return REQUESTS.get((state, request), Action.CONFLICT)


def refusal_reason(snap: ModelSnapshot, request: Request) -> str:
    """Why a request `decide` answered CONFLICT (or a JOIN of a transition not ours) is refused."""
    if snap.state is State.FAILED:
        return f"the model is FAILED ({snap.last_error}); restart its engine"
    if snap.state in (State.UNKNOWN, State.STARTING):
        return f"the model is {snap.state.value}: not probed or not started yet"
    if snap.state is State.STOPPED:
        return "the model's engine is stopped"
    other = "wake" if request is Request.SLEEP else "sleep"
    return f"a {other} is in flight (state {snap.state.value})"


class Gate(enum.StrEnum):
    """How a model counts toward the sidecar's readiness (/health)."""

    GATED = "gated"  # ready only when RUNNING and verified
    # Servable asleep or awake (hot swap behind the gateway); the pod stays ready while one is.
    SWAPPABLE = "swappable"


@dataclass(frozen=True)
class PhaseRecord:
    name: str
    duration_s: float
    ok: bool = True
    ranks: tuple[Mapping[str, Any], ...] = ()  # one plain dict per rank, as the extension sent it
    detail: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TransitionRecord:
    kind: str  # "sleep" | "wake" | "start"
    from_state: State
    to_state: State
    result: str  # "ok" | "failed" | "gave_up"
    started_at: float  # unix seconds
    ended_at: float
    level: int | None = None
    phases: tuple[PhaseRecord, ...] = ()
    error: str | None = None
    failed_phase: str | None = None

    @property
    def duration_s(self) -> float:
        return self.ended_at - self.started_at


@dataclass(frozen=True)
class ModelSnapshot:
    """Everything /health, /models and the metrics collector read about one model."""

    name: str
    state: State
    since: float  # unix seconds of the last state change
    gate: Gate = Gate.GATED
    verified: bool = False  # set by a wake (or start probe) that passed verification
    level: int | None = None  # sleep level while SUSPENDED
    last_transition: TransitionRecord | None = None
    last_error: str | None = None
    phase: str | None = None  # the phase of the transition in flight, if any
    keep_prefix_cache: bool = False  # the model's setting: sleeps keep the KV cache (level 1)
    # SUSPENDED: what the engine left on its devices at its last suspend (over its ranks, as
    # they report it; the policy's ModelView.asleep_bytes). None: awake, or not reported.
    resident_bytes: int | None = None
    # SUSPENDED: its engine's processes are checkpointed by the driver (a deep sleep); and
    # why the last deep sleep asked for did not go deep (None: it did, or none was asked).
    deep: bool = False
    deep_error: str | None = None
    # RUNNING after a wake nothing verified (vLLM's own wake of a plain engine), served
    # because the model's `accept_unverified_wake` says so (docs/contracts.md §2.3).
    unverified_wake: bool = False

    @property
    def ready(self) -> bool:
        """Strict readiness: serving, and verified since the last memory transition (or,
        where the operator accepted it, woken unverified: `unverified_wake`)."""
        return self.state is State.RUNNING and (self.verified or self.unverified_wake)

    @property
    def counts_ready(self) -> bool:
        """Readiness as this model's gate counts it toward the sidecar's /health."""
        if self.gate is Gate.SWAPPABLE:
            return self.state not in (State.FAILED, State.UNKNOWN, State.STARTING, State.STOPPED)
        return self.ready


def overall_ready(snapshots: Mapping[str, ModelSnapshot] | list[ModelSnapshot]) -> bool:
    """The sidecar's readiness: every gated model ready, and, when there are swappable
    models, at least one of them servable. A FAILED swappable model alone does not take the
    pod out of its Service: the gateway answers its requests 503 with Retry-After while the
    supervisor restarts it, and the other models keep being served."""
    items = list(snapshots.values() if isinstance(snapshots, Mapping) else snapshots)
    gated = all(s.counts_ready for s in items if s.gate is not Gate.SWAPPABLE)
    swappable = [s for s in items if s.gate is Gate.SWAPPABLE]
    return gated and (not swappable or any(s.counts_ready for s in swappable))
