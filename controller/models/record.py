"""One record per model: everything the sidecar knows about it, with changes awaitable.

A `ModelRecord` is made of parts, each kept by the module that owns it (as kopf's
ResourceMemory is made of its daemons' and indices' memories) and written only through its
own methods, which notify:

- its snapshot and the transition in flight: here, written by the runner (the one place a
  state changes, controller.models.runner) and the model's manager (which starts transitions);
- `facts`: what is known of the engine process (controller.models.enginefacts);
- `holdings`: the bytes its engine holds where (controller.models.holdings);
- `lane`, `swapping`, `process`: the fleet room's parts (controller.models.fleetparts);
- `ckpt`: whether its engine can sleep deep, and its CUDA processes (controller.models.ckptfacts).

Whoever waits for a change awaits `wait_for(predicate)` on the record or on the `Fleet`,
so nothing polls (controller.models.changes).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

from controller.models.changes import Changes
from controller.models.ckptfacts import CheckpointFacts
from controller.models.enginefacts import EngineFacts
from controller.models.fleetparts import Lane, Process, Swapping
from controller.models.holdings import Holdings
from controller.state import ModelSnapshot, Request, State

if TYPE_CHECKING:
    from controller.config.modelsettings import ModelSettings


class ModelRecord:
    """Everything known about one model, in parts; every write notifies."""

    def __init__(
        self,
        settings: ModelSettings,
        *,
        clock: Callable[[], float] = time.time,
        changes: Changes | None = None,
    ) -> None:
        self.name = settings.name
        self.settings = settings
        self.clock = clock
        self.changes = changes if changes is not None else Changes()
        self._snapshot = ModelSnapshot(
            name=settings.name,
            state=State.UNKNOWN,
            since=clock(),
            gate=settings.gate,
            keep_prefix_cache=settings.keep_prefix_cache,
        )
        # The transition in flight (sleep or wake) and which.
        self._transition: asyncio.Task[Any] | None = None
        self._transition_kind: Request | None = None
        self.facts = EngineFacts(self.changes, settings.served_model_name)
        self.holdings = Holdings(self.changes, settings.footprint_bytes)
        self.lane = Lane(self.changes, clock)
        self.swapping = Swapping(self.changes)
        self.process = Process(self.changes)
        self.ckpt = CheckpointFacts(self.changes)

    # ---- the snapshot and the transition (written by the runner and the model's manager)

    @property
    def snapshot(self) -> ModelSnapshot:
        return self._snapshot

    @property
    def state(self) -> State:
        return self._snapshot.state

    def set_snapshot(self, snap: ModelSnapshot) -> None:
        self._snapshot = snap
        self.changed()

    def update(self, **changes: Any) -> ModelSnapshot:
        """The snapshot with `changes` (its fields) applied; returns it. A change of
        `verified` that does not say `unverified_wake` clears it: only the wake that accepts
        an unverified engine sets it (docs/contracts.md §2.3)."""
        if "verified" in changes:
            changes.setdefault("unverified_wake", False)
        self.set_snapshot(dataclasses.replace(self._snapshot, **changes))
        return self._snapshot

    @property
    def transition(self) -> asyncio.Task[Any] | None:
        return self._transition

    @property
    def transition_kind(self) -> Request | None:
        return self._transition_kind

    def begin(self, task: asyncio.Task[Any], kind: Request) -> None:
        """A transition started (its task, sleep or wake)."""
        self._transition, self._transition_kind = task, kind
        self.changed()

    def in_flight_task(self) -> asyncio.Task[Any] | None:
        t = self._transition
        return t if t is not None and not t.done() else None

    @property
    def leftover_bytes(self) -> int:
        """What its engine holds on its devices besides its pools, as the policy counts it:
        the snapshot's resident_bytes while asleep (a sleeper reconciliation found at start
        included), else what its last suspend reported (0 until one did). A deep sleeper
        holds what was measured after its checkpoint (0 included)."""
        if self._snapshot.deep and self._snapshot.resident_bytes is not None:
            return self._snapshot.resident_bytes
        return self._snapshot.resident_bytes or self.holdings.asleep_bytes

    def changed(self) -> None:
        self.changes.notify()

    async def wait_for(
        self, predicate: Callable[[ModelRecord], bool], timeout_s: float | None = None
    ) -> bool:
        return await self.changes.wait_for(lambda: predicate(self), timeout_s)


class Fleet(Mapping[str, ModelRecord]):
    """Every model's record, by name, and one change signal for all of them."""

    def __init__(
        self, models: list[ModelSettings], *, clock: Callable[[], float] = time.time
    ) -> None:
        self.changes = Changes()
        self._records = {
            m.name: ModelRecord(m, clock=clock, changes=Changes(parent=self.changes))
            for m in models
        }

    def __getitem__(self, name: str) -> ModelRecord:
        return self._records[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._records)

    def __len__(self) -> int:
        return len(self._records)

    def snapshots(self) -> dict[str, ModelSnapshot]:
        return {name: r.snapshot for name, r in self._records.items()}

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float | None = None) -> bool:
        return await self.changes.wait_for(predicate, timeout_s)
