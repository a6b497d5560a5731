"""The policy's view of one model, for the pure policy's table tests (test_policy.py,
test_policy_fleet.py): a compact constructor in MiB, with the fleet fields. A test's object
for a model is its name: a plan's views hand it back (`handed`)."""

from __future__ import annotations

from collections.abc import Iterable

from controller.fleet.policy import ModelView
from controller.state import State

S = State
MIB = 1 << 20
NOW = 1000.0


def v(
    name: str,
    state: State = S.SUSPENDED,
    mib: int | None = 100,
    used: float = 0.0,
    since: float | None = 0.0,
    pinned: bool = False,
    on: str = "0",
    asleep_mib: int = 0,
    host_mib: int = 0,
    weights_mib: int | None = None,
    level: int | None = None,
    demotable: bool = True,
    in_flight: int = 0,
    queued: int = 0,
    busy: bool = False,
    scratch_mib: int = 0,
    gone: bool = False,
    uses: float = 0.0,
) -> ModelView[str]:
    devices = tuple(on.split(","))
    return ModelView(
        model=name,
        name=name,
        state=state,
        footprint_bytes=None if mib is None else mib * MIB,
        last_used=used,
        recent_uses=uses,
        awake_since=since,
        pinned=pinned,
        device=devices[0],
        devices=devices,
        asleep_bytes=asleep_mib * MIB,
        wake_scratch_bytes=scratch_mib * MIB,
        process_gone=gone,
        host_bytes=host_mib * MIB,
        host_weights_bytes=None if weights_mib is None else weights_mib * MIB,
        level=level if level is not None else (1 if state is S.SUSPENDED else None),
        demotable=demotable,
        in_flight=in_flight,
        queued=queued,
        busy=busy,
    )


def handed(views: Iterable[ModelView[str]]) -> tuple[str, ...]:
    """The objects a plan's views hand back (a test's are the models' names)."""
    return tuple(view.model for view in views)
