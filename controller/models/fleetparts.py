"""The parts of a model's record that the fleet room writes: the gateway admission's lane
(controller.fleet.admission), the coordinator's tasks (controller.fleet.swap, hostswap,
idle) and the supervisor's engine process (controller.fleet.supervisor).

They are defined here, below the record that holds them, because the fleet room sits above
the models room; each is written only through its own methods, which notify.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Callable
from typing import Any, Protocol

from controller.models.changes import Changes, Part

# The time constant of a model's recent requests (Lane.recent_uses), in seconds.
USE_DECAY_S = 30.0


class Lane(Part):
    """One model's gateway traffic: requests in flight and held, whether admission is
    closed, its last use, and the wake the gateway started for held requests."""

    def __init__(self, changes: Changes, clock: Callable[[], float]) -> None:
        super().__init__(changes)
        self._clock = clock
        self.in_flight = 0
        self.closed = False
        self.held = 0  # requests waiting in the gateway's queue for this model
        # Held requests' tickets; a finished wake admits them all at once, before any eviction.
        self.waiters: list[asyncio.Future[None]] = []
        self.last_used = 0.0  # unix seconds of the last gateway request (0: never)
        # Its requests counted, each 1 decaying by USE_DECAY_S, as of `_uses_at`.
        self._uses = 0.0
        self._uses_at = 0.0
        # The wake the gateway started for held requests, and when it may try again.
        self.gateway_wake: asyncio.Task[Any] | None = None
        self.retry_at = 0.0

    def touch(self) -> None:
        """A request arrived: the model is the most recently used now."""
        now = self._clock()
        self._uses = self.recent_uses(now) + 1.0
        self._uses_at = now
        self.last_used = now
        self._changed()

    def recent_uses(self, now: float) -> float:
        """Its gateway requests so far, each counted 1 and decaying with a time constant of
        USE_DECAY_S: how often it is asked lately (the swap policy keeps the most asked)."""
        if not self._uses:
            return 0.0
        return self._uses * math.exp(-max(0.0, now - self._uses_at) / USE_DECAY_S)

    def enter(self) -> None:
        self.in_flight += 1
        self._changed()

    def leave(self) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        # A request's end is a use too: idle time counts from the last one to finish.
        self.last_used = max(self.last_used, self._clock())
        self._changed()

    def close(self, closed: bool = True) -> None:
        self.closed = closed
        self._changed()

    def hold(self, delta: int) -> int:
        """One more (+1) or one fewer (-1) request held; the number held now."""
        self.held += delta
        self._changed()
        return self.held

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
            self._changed()
        return admitted

    def gateway_woke(self, task: asyncio.Task[Any] | None) -> None:
        """The wake the gateway started for held requests (None: it ended and was judged)."""
        self.gateway_wake = task
        self._changed()

    def retry_after(self, at: float) -> None:
        """A refused wake said when to ask again (on the admission's monotonic clock)."""
        self.retry_at = at
        self._changed()


class Swapping(Part):
    """The coordinator's tasks for one model: the evicting wake in flight (concurrent callers
    share it), the host budget enforced after its last wake kept a backup, its checkpoint
    after an eviction, and when an idle sleep was last decided."""

    def __init__(self, changes: Changes) -> None:
        super().__init__(changes)
        self.swap: asyncio.Task[Any] | None = None
        self.host_task: asyncio.Task[Any] | None = None
        self.deepen_task: asyncio.Task[Any] | None = None
        self.idle_slept_at: float | None = None

    def in_flight(self) -> asyncio.Task[Any] | None:
        t = self.swap
        return t if t is not None and not t.done() else None

    def swapping(self, task: asyncio.Task[Any]) -> None:
        self.swap = task
        self._changed()

    def enforcing_host(self, task: asyncio.Task[Any]) -> None:
        self.host_task = task
        self._changed()

    def deepening(self, task: asyncio.Task[Any]) -> None:
        """The checkpoint of an evicted model, after the swap that evicted it."""
        self.deepen_task = task
        self._changed()

    def deepening_now(self) -> asyncio.Task[Any] | None:
        t = self.deepen_task
        return t if t is not None and not t.done() else None

    def idle_slept(self, at: float) -> None:
        self.idle_slept_at = at
        self._changed()


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


class Process(Part):
    """A managed engine (the supervisor's): its process, the task awaiting its exit, the
    restart in flight, when it last started and how often it failed in a row."""

    def __init__(self, changes: Changes) -> None:
        super().__init__(changes)
        self.engine: EngineProcess | None = None
        self.exit_watch: asyncio.Task[None] | None = None
        self.restart: asyncio.Task[None] | None = None
        self.started_at: float | None = None
        self.restarts = 0

    def alive(self) -> bool:
        return self.engine is not None and self.engine.is_alive()

    def restarting(self) -> bool:
        return self.restart is not None and not self.restart.done()

    def launched(self, engine: EngineProcess, exit_watch: asyncio.Task[None]) -> None:
        """A new process was started; `exit_watch` awaits its end."""
        self.engine, self.exit_watch = engine, exit_watch
        self._changed()

    def ready(self, at: float) -> None:
        self.started_at = at
        self._changed()

    def restart_begun(self, task: asyncio.Task[None]) -> None:
        self.restart = task
        self._changed()

    def count_restart(self, *, stable: bool) -> int:
        """One more restart in a row (`stable`: the process ran long enough that the
        backoff starts over); returns its number."""
        self.restarts = 1 if stable else self.restarts + 1
        self._changed()
        return self.restarts
