"""Awaitable changes, and the base of a record's parts.

`Changes` is an asyncio.Condition whose notify needs no lock: every change completes the
current waiters' future at once (state changes happen in plain methods, which cannot take
an async lock). A `Part` is one piece of a model's record (controller.models.record), kept
by the module that owns it: its fields are written only by its own methods, and each of
those calls `_changed()`, so whoever waits on the record is told and nothing polls
(tests/controller/test_record_ownership.py holds the rule).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


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


class Part:
    """One piece of a record: written only through its own methods, each of which notifies."""

    def __init__(self, changes: Changes) -> None:
        self._changes = changes

    def _changed(self) -> None:
        self._changes.notify()
