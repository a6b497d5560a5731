"""One task group for every background task of the sidecar.

Every task is named, logs its own end at once (and so never leaves an exception
unretrieved), and is cancelled by `aclose`: nothing outlives the sidecar's shutdown.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine
from typing import Any, TypeVar

from controller.errors import WakeRefused

log = logging.getLogger("hotswap.tasks")

T = TypeVar("T")


class Tasks:
    """A set of named background tasks; `spawn` adds one, `aclose` cancels what is left."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[Any]] = set()

    def spawn(self, coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
        task = asyncio.create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return task

    def _ended(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            log.debug("task %s cancelled", task.get_name())
        elif (exc := task.exception()) is not None:
            # A wake held for a while (min_awake_s) is asked again by its caller: no warning.
            passing = isinstance(exc, WakeRefused) and exc.retry_after_s is not None
            level = logging.DEBUG if passing else logging.WARNING
            log.log(level, "task %s ended: %s: %s", task.get_name(), type(exc).__name__, exc)
        else:
            log.debug("task %s finished", task.get_name())

    def __len__(self) -> int:
        return len(self._tasks)

    async def cancel(self, *tasks: asyncio.Task[Any] | None) -> None:
        """Cancel the given tasks and wait for them to end."""
        live = [t for t in tasks if t is not None]
        for t in live:
            t.cancel()
        await asyncio.gather(*live, return_exceptions=True)

    async def aclose(self, timeout_s: float = 0.0) -> None:
        """Give the tasks `timeout_s` to finish, then cancel every one still running."""
        pending = set(self._tasks)
        if pending and timeout_s > 0:
            _, pending = await asyncio.wait(pending, timeout=timeout_s)
        await self.cancel(*pending)
