"""One record per model: everything the sidecar knows about it, with changes awaitable.

A `ModelRecord` holds the model's snapshot (what /health, /models and the metrics read),
its admission lane (the gateway's requests in flight and held), its awake footprint, its
last use, its engine process and restart count (managed mode) and the transition in flight.
The parts (manager, coordinator, gateway, supervisor) read and write the record instead of
keeping name-keyed dicts of their own.

Whoever changes a record calls `changed()`; whoever waits for a change awaits
`wait_for(predicate)` on the record or on the `Fleet`, so nothing polls. `Changes` is an
asyncio.Condition whose notify needs no lock: every change completes the current waiters'
future at once (state changes happen in plain methods, which cannot take an async lock).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from controller.state import ModelSnapshot, Request, State

if TYPE_CHECKING:
    from controller.config.modelsettings import ModelSettings

log = logging.getLogger("hotswap.record")


class Changes:
    """Awaitable changes: `notify()` wakes every waiter; `wait_for` re-checks its predicate."""

    def __init__(self, parent: Changes | None = None) -> None:
        self._parent = parent
        self._waiters: list[asyncio.Future[None]] = []

    def notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for fut in waiters:
            if not fut.done():
                fut.set_result(None)
        if self._parent is not None:
            self._parent.notify()

    def next(self) -> asyncio.Future[None]:
        """A future resolved by the next change (for asyncio.wait with other awaitables)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(fut)
        return fut

    async def wait_for(self, predicate: Callable[[], bool], timeout_s: float | None = None) -> bool:
        """Wait until `predicate()` holds; False when `timeout_s` ran out first."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout_s is None else loop.time() + timeout_s
        while not predicate():
            left = None if deadline is None else deadline - loop.time()
            if left is not None and left <= 0:
                return False
            fut = self.next()
            try:
                # asyncio.wait, not wait_for: on 3.11 wait_for can swallow a cancellation that
                # races with the change, and the waiter would never end.
                await asyncio.wait({fut}, timeout=left)
            finally:
                fut.cancel()
        return True


class EngineProcess(Protocol):
    """What the supervisor needs of an engine process (launcher.EngineProcess has it)."""

    @property
    def returncode(self) -> int | None: ...

    def start(self) -> None: ...

    def is_alive(self) -> bool: ...

    async def exited(self) -> int | None:
        """Return once the process has exited (its return code); awaited, never polled."""
        ...

    def wait_ready(self, timeout_s: float = ..., interval_s: float = ...) -> float: ...

    def stop(self, grace_s: float = ...) -> int | None: ...

    def kill(self) -> int | None: ...

    def group_left(self) -> list[int]:
        """The live processes of its process group (its keeper's orphans included)."""
        ...


@dataclass
class Lane:
    """One model's gateway traffic: requests in flight, held, and whether admission is closed."""

    record: ModelRecord
    in_flight: int = 0
    closed: bool = False
    held: int = 0  # requests waiting in the gateway's queue for this model
    # Held requests' tickets; a finished wake admits them all at once, before any eviction.
    waiters: list[asyncio.Future[None]] = field(default_factory=list)

    def enter(self) -> None:
        self.in_flight += 1
        self.record.changed()

    def leave(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        # A request's end is a use too: idle time counts from the last one to finish.
        self.record.last_used = max(self.record.last_used, self.record.clock())
        self.record.changed()

    def close(self, closed: bool = True) -> None:
        self.closed = closed
        self.record.changed()

    def ticket(self) -> asyncio.Future[None]:
        """A held request's ticket: resolved when `hand_over` admits it (already counted)."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        return fut

    def forget(self, fut: asyncio.Future[None]) -> bool:
        """Withdraw a ticket; True if it had been admitted meanwhile (the caller must leave)."""
        if fut in self.waiters:
            self.waiters.remove(fut)
        if fut.done() and not fut.cancelled():
            return True
        fut.cancel()
        return False

    def hand_over(self) -> int:
        """Admit every held request of a model that is RUNNING with admission open."""
        if self.closed:
            return 0
        admitted = 0
        for fut in self.waiters:
            if not fut.done():
                fut.set_result(None)
                admitted += 1
        self.waiters.clear()
        if admitted:
            self.in_flight += admitted
            self.record.changed()
        return admitted


class ModelRecord:
    """Everything known about one model; `changed()` after every write."""

    def __init__(self, settings: ModelSettings, *, clock: Callable[[], float] = time.time) -> None:
        self.name = settings.name
        self.settings = settings
        self.clock = clock
        self.changes = Changes()
        self._snapshot = ModelSnapshot(
            name=settings.name,
            state=State.UNKNOWN,
            since=clock(),
            gate=settings.gate,
            keep_prefix_cache=settings.keep_prefix_cache,
        )
        self.lane = Lane(self)
        # Awake footprint in bytes: configured (never overwritten) or measured.
        self.footprint: int | None = settings.footprint_bytes
        self.footprint_configured = settings.footprint_bytes is not None
        # Bytes by pool (weights, kv_cache) over every rank, as last measured (hotswap_info
        # at start, the bytes a sleep freed): what an overlapped swap plans with.
        self.pools: dict[str, int] = {}
        # Weights bytes the last sleep copied off the device (freed and offloaded, over
        # ranks): 0 where a sleep copies nothing (the host backend, level 2); None: no
        # sleep seen yet. An overlapped swap only pays off when this is not 0.
        self.copied_bytes: int | None = None
        # What its engine held on its devices after its last suspend (the snapshot's
        # resident_bytes, kept while awake; 0 until one is reported), and in host RAM now (a level-1
        # sleeper's weights, an awake model's kept backup); what a level-1 sleep holds there.
        self.asleep_bytes = 0
        self.host_bytes = 0
        self.host_weights: int | None = None
        self.demotable = True  # its backend can drop a level-1 host copy while asleep
        # Device bytes its next wake takes for a while beyond its footprint (the codec's
        # staging, as its last suspend reported; 0 awake): the policy adds it to the need.
        self.wake_scratch = 0
        # The largest such figure it ever reported: its coder's staging, which its own
        # sleep holds while it encodes (an overlapped swap's peak counts it).
        self.codec_scratch = 0
        # The host budget enforced after its last wake kept a backup (controller.fleet.hostswap).
        self.host_task: asyncio.Task[Any] | None = None
        self.idle_slept_at: float | None = None  # when an idle sleep was last decided
        self.last_used = 0.0  # unix seconds of the last gateway request (0: never)
        self.served_model = settings.served_model_name  # read from /v1/models when None
        # The transition in flight (sleep or wake) and the phase it is in.
        self.transition: asyncio.Task[Any] | None = None
        self.transition_kind: Request | None = None
        self.phase: str | None = None
        # What reconciliation remembers of the engine (controller.models.reconcile.Memory): an RPC
        # to this process may have left its reply queues out of step; the non-RPC sign of
        # the process and the ranks' boot ids last seen; the pools asleep (a partial wake).
        self.desynced = False
        self.process_sign: str | None = None
        self.boot_ids: tuple[str | None, ...] | None = None
        self.asleep: tuple[str, ...] | None = None
        # Managed engines: the process, when it last started, how often it failed in a row.
        self.engine: EngineProcess | None = None
        self.started_at: float | None = None
        self.restarts = 0
        # The coordinator's evicting wake in flight (concurrent callers share it).
        self.swap: asyncio.Task[Any] | None = None
        # The gateway: the wake it started for held requests, and when it may try again.
        self.gateway_wake: asyncio.Task[Any] | None = None
        self.retry_at = 0.0

    @property
    def snapshot(self) -> ModelSnapshot:
        return self._snapshot

    @snapshot.setter
    def snapshot(self, snap: ModelSnapshot) -> None:
        self._snapshot = snap
        self.changed()

    @property
    def leftover_bytes(self) -> int:
        """What its engine holds on its devices besides its pools, as the policy counts it:
        the snapshot's resident_bytes while asleep (a sleeper reconciliation found at start
        included), else what its last suspend reported (0 until one did)."""
        return self.snapshot.resident_bytes or self.asleep_bytes

    @property
    def state(self) -> State:
        return self._snapshot.state

    def learn_pools(self, pools: Mapping[str, int], source: str) -> None:
        """Record the pools' measured bytes (nothing measured: kept as they were)."""
        known = {**self.pools, **{k: int(v) for k, v in pools.items() if v > 0}}
        if known != self.pools:
            log.info("%s: pools %s (%s)", self.name, known, source, extra={"model": self.name})
            self.pools = known

    def learn_wake_scratch(self, nbytes: int) -> None:
        """What its next wake decodes through, as a suspend (or a rank read back) said; the
        largest such figure is kept as its coder's staging."""
        self.wake_scratch = nbytes
        self.codec_scratch = max(self.codec_scratch, nbytes)

    def in_flight_task(self) -> asyncio.Task[Any] | None:
        t = self.transition
        return t if t is not None and not t.done() else None

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
        self._records: dict[str, ModelRecord] = {}
        for m in models:
            rec = ModelRecord(m, clock=clock)
            rec.changes = Changes(parent=self.changes)
            self._records[m.name] = rec

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
