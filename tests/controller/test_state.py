"""Table-driven tests over every (state, event) and (state, request) pair."""

from __future__ import annotations

import itertools

import pytest

from controller.state import (
    Action,
    Event,
    Gate,
    ModelSnapshot,
    Request,
    State,
    TransitionNotAllowed,
    decide,
    next_state,
    overall_ready,
)

S, E = State, Event

# The full expected table, written out independently of the module's own mapping: every
# pair not listed must be refused.
EXPECTED: dict[tuple[State, Event], State] = {
    (S.UNKNOWN, E.PROBED_RUNNING): S.RUNNING,
    (S.UNKNOWN, E.PROBED_SUSPENDED): S.SUSPENDED,
    (S.UNKNOWN, E.FAIL): S.FAILED,
    (S.UNKNOWN, E.START): S.STARTING,
    (S.STARTING, E.STARTED): S.RUNNING,
    (S.STARTING, E.FAIL): S.FAILED,
    (S.STARTING, E.STOP): S.STOPPED,
    (S.RUNNING, E.SLEEP): S.SUSPENDING,
    (S.RUNNING, E.FAIL): S.FAILED,
    (S.RUNNING, E.STOP): S.STOPPED,
    (S.SUSPENDING, E.SLEEP_DONE): S.SUSPENDED,
    (S.SUSPENDING, E.SLEEP_GAVE_UP): S.RUNNING,
    (S.SUSPENDING, E.FAIL): S.FAILED,
    (S.SUSPENDED, E.WAKE): S.RESUMING,
    (S.SUSPENDED, E.FAIL): S.FAILED,
    (S.SUSPENDED, E.STOP): S.STOPPED,
    (S.RESUMING, E.WAKE_DONE): S.RUNNING,
    (S.RESUMING, E.FAIL): S.FAILED,
    (S.FAILED, E.FAIL): S.FAILED,
    (S.FAILED, E.START): S.STARTING,
    (S.FAILED, E.STOP): S.STOPPED,
    (S.FAILED, E.PROBED_RUNNING): S.RUNNING,
    (S.FAILED, E.PROBED_SUSPENDED): S.SUSPENDED,
    (S.STOPPED, E.START): S.STARTING,
    (S.RUNNING, E.PROBED_SUSPENDED): S.SUSPENDED,
    (S.SUSPENDED, E.PROBED_RUNNING): S.RUNNING,
    (S.UNKNOWN, E.PROBED_UNFINISHED): S.RESUMING,
    (S.STARTING, E.PROBED_UNFINISHED): S.RESUMING,
    (S.RUNNING, E.PROBED_UNFINISHED): S.RESUMING,
    (S.SUSPENDED, E.PROBED_UNFINISHED): S.RESUMING,
    (S.FAILED, E.PROBED_UNFINISHED): S.RESUMING,
}

ALL_PAIRS = list(itertools.product(State, Event))


@pytest.mark.parametrize(("state", "event"), ALL_PAIRS, ids=lambda v: str(v))
def test_every_state_event_pair(state: State, event: Event) -> None:
    expected = EXPECTED.get((state, event))
    if expected is None:
        with pytest.raises(TransitionNotAllowed) as info:
            next_state(state, event)
        assert info.value.state is state
        assert info.value.event is event
        assert state.value in str(info.value)
    else:
        assert next_state(state, event) is expected


EXPECTED_ACTIONS: dict[tuple[State, Request], Action] = {
    (S.RUNNING, Request.SLEEP): Action.BEGIN,
    (S.SUSPENDING, Request.SLEEP): Action.JOIN,
    (S.SUSPENDED, Request.SLEEP): Action.NOOP,
    (S.RESUMING, Request.SLEEP): Action.CONFLICT,
    (S.SUSPENDED, Request.WAKE): Action.BEGIN,
    (S.RESUMING, Request.WAKE): Action.JOIN,
    (S.RUNNING, Request.WAKE): Action.NOOP,
    (S.SUSPENDING, Request.WAKE): Action.CONFLICT,
}


@pytest.mark.parametrize(
    ("state", "request_"), list(itertools.product(State, Request)), ids=lambda v: str(v)
)
def test_every_state_request_pair(state: State, request_: Request) -> None:
    assert decide(state, request_) is EXPECTED_ACTIONS.get((state, request_), Action.CONFLICT)


def test_begin_actions_match_transition_edges() -> None:
    """A request the table begins must be an edge the transition table allows."""
    for (state, request_), action in EXPECTED_ACTIONS.items():
        if action is Action.BEGIN:
            event = Event.SLEEP if request_ is Request.SLEEP else Event.WAKE
            next_state(state, event)


def _snap(state: State, *, verified: bool = True, gate: Gate = Gate.GATED) -> ModelSnapshot:
    return ModelSnapshot(name="m", state=state, since=0.0, gate=gate, verified=verified)


@pytest.mark.parametrize("state", list(State))
def test_readiness_by_gate(state: State) -> None:
    assert _snap(state).ready is (state is State.RUNNING)
    assert _snap(state).counts_ready is (state is State.RUNNING)
    assert _snap(state, verified=False).counts_ready is False
    swappable = _snap(state, gate=Gate.SWAPPABLE)
    assert swappable.counts_ready is (
        state in (State.RUNNING, State.SUSPENDING, State.SUSPENDED, State.RESUMING)
    )
    # The per-model health stays strict whatever the gate.
    assert swappable.ready is (state is State.RUNNING)


def test_overall_ready_needs_every_model() -> None:
    a = _snap(State.RUNNING)
    b = _snap(State.SUSPENDED, gate=Gate.SWAPPABLE)
    c = _snap(State.RESUMING)
    assert overall_ready([a, b])
    assert not overall_ready([a, b, c])
    assert overall_ready({"a": a})
    assert overall_ready([])


def _named(name: str, state: State, gate: Gate = Gate.SWAPPABLE) -> ModelSnapshot:
    return ModelSnapshot(name=name, state=state, since=0.0, gate=gate, verified=True)


S = State


@pytest.mark.parametrize(
    ("swappable", "gated", "ready"),
    [
        # One FAILED swappable model leaves the pod ready: the gateway answers its requests
        # 503 with Retry-After while it restarts; the others keep being served.
        ((S.FAILED, S.SUSPENDED), (), True),
        ((S.FAILED, S.RUNNING), (), True),
        ((S.STARTING, S.SUSPENDED), (), True),
        ((S.FAILED, S.STARTING), (), False),  # nothing servable: out of the Service
        ((S.UNKNOWN, S.UNKNOWN), (), False),  # still booting
        ((S.FAILED,), (), False),
        ((S.SUSPENDED, S.SUSPENDED), (), True),
        # Gated models stay strict.
        ((S.SUSPENDED,), (S.RUNNING,), True),
        ((S.SUSPENDED,), (S.FAILED,), False),
        ((), (S.SUSPENDED,), False),
    ],
)
def test_pod_readiness_with_swappable_models(
    swappable: tuple[State, ...], gated: tuple[State, ...], ready: bool
) -> None:
    snaps = [_named(f"s{i}", s) for i, s in enumerate(swappable)]
    snaps += [_named(f"g{i}", s, Gate.GATED) for i, s in enumerate(gated)]
    assert overall_ready(snaps) is ready
