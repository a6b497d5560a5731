"""Connection limits uvicorn has no setting for: a deadline on the request head and a cap on
connections that have not sent one yet.

uvicorn bounds an idle keep-alive connection (`timeout_keep_alive`), a head's size (h11's
16 KiB) and the connections at once (`limit_concurrency`, 503), but not how long a head may
take: a client that sends a byte every few seconds holds its socket for good, and many
such clients use up the process's file descriptors before any of them reached the auth
check (which needs the whole head). `protocol(...)` gives uvicorn's h11 protocol both
bounds; the body's deadline is the guard's (it reads the body).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("hotswap.http")


class HeadLimits(H11Protocol):
    """uvicorn's h11 protocol with a head deadline and a cap on head-less connections.

    Subclassed per server by `protocol` (the class attributes below); `waiting` holds this
    server's connections that have not sent a whole first head.
    """

    head_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_waiting: int = 64
    waiting: set[HeadLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._armed_for: object = None  # the cycle in place when the deadline was armed

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if len(self.waiting) >= self.max_waiting:
            log.debug("closing a connection: %d wait for their first head", len(self.waiting))
            self.transport.close()
            return
        self.waiting.add(self)
        self._arm(self.head_timeout_s)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._armed_for:
            self._disarm()  # a whole head arrived (it made a new request cycle)

    def on_response_complete(self) -> None:
        before = self.cycle
        super().on_response_complete()
        if not self.transport.is_closing() and self.cycle is before:  # not pipelined
            # Keep-alive: the next head may idle first (uvicorn closes it after keep_alive).
            self._arm(self.keep_alive_s + self.head_timeout_s)

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _arm(self, after_s: float) -> None:
        self._disarm_timer()
        self._armed_for = self.cycle
        self._head_timer = self.loop.call_later(after_s, self._too_slow)

    def _disarm(self) -> None:
        self._disarm_timer()
        self.waiting.discard(self)

    def _disarm_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _too_slow(self) -> None:
        self._head_timer = None
        self.waiting.discard(self)
        if not self.transport.is_closing():
            log.debug("closing a connection: no whole request head in time")
            self.transport.close()


def protocol(head_timeout_s: float, keep_alive_s: float, max_waiting: int) -> type[HeadLimits]:
    """A HeadLimits class for one server (its own set of waiting connections)."""
    attrs = {
        "head_timeout_s": head_timeout_s,
        "keep_alive_s": keep_alive_s,
        "max_waiting": max_waiting,
        "waiting": set(),
    }
    return type("ServerHeadLimits", (HeadLimits,), attrs)
