"""Connection limits uvicorn has no setting for: a deadline on the request head, a cap on
its size, and a cap on connections that have not sent one yet.

uvicorn bounds an idle keep-alive connection (`timeout_keep_alive`) and the connections at
once (`limit_concurrency`, 503), but not how long a head may take: a client that sends a
byte every few seconds holds its socket for good, and many such clients use up the
process's file descriptors before any of them reached the auth check (which needs the
whole head). Its httptools protocol (the C parser: a fraction of h11's CPU per request)
does not bound a head's size either, where h11 did (16 KiB). `protocol(...)` gives
uvicorn's httptools protocol all three bounds; the body's deadline is the guard's (it
reads the body).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger("hotswap.http")


# The largest request head (line and headers) answered: h11's default, which uvicorn's h11
# protocol applied before this module chose httptools.
MAX_HEAD_BYTES = 16 << 10

_TOO_LARGE = b"Request header fields too large"
_TOO_LARGE_ANSWER = (
    b"HTTP/1.1 431 Request Header Fields Too Large\r\n"
    b"content-type: text/plain; charset=utf-8\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_TOO_LARGE), _TOO_LARGE)
)


# `GET /livez`'s answer, written by the protocol itself (`HeadLimits.answers_livez`): the
# control API's body for it, byte for byte.
_LIVEZ_BODY = b'{"status":"ok"}'
_LIVEZ_ANSWER = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
    b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(_LIVEZ_BODY), _LIVEZ_BODY)
)


class HeadTooLarge(Exception):
    """A whole request head over the cap (raised inside the parser's callback)."""


class HeadLimits(HttpToolsProtocol):
    """uvicorn's httptools protocol with a head deadline, a head size cap and a cap on
    head-less connections.

    Subclassed per server by `protocol` (the class attributes below); `waiting` holds this
    server's connections that have not sent a whole first head.

    With `answers_livez` (the control port), a `GET /livez` is answered here, as its head
    is parsed: 200 `{"status":"ok"}` and the connection closed, on the event loop but
    without a request task, the app's middleware or a place in the loop's queue behind the
    requests in flight (a liveness probe says the loop runs; its answer waits for nothing
    else). Another method, a query string or a request pipelined behind one in progress
    goes to the app as any request.
    """

    max_head_bytes: int = MAX_HEAD_BYTES
    head_timeout_s: float = 10.0
    keep_alive_s: float = 5.0
    max_waiting: int = 64
    answers_livez: bool = False
    waiting: set[HeadLimits]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._head_timer: asyncio.TimerHandle | None = None
        self._armed_for: object = None  # the cycle in place when the deadline was armed
        # Bytes received of the head being sent; None while a body or an answer is (the
        # parser's callbacks move it). A message completed within a read leaves the next
        # head's first bytes in that read uncounted: a head is held to the cap plus at most
        # one read, never more.
        self._head_bytes: int | None = 0
        self._completed_in_read = False
        self._head_over = False
        self._answered = False  # a /livez answered here: the parser's later callbacks are not

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        if len(self.waiting) >= self.max_waiting:
            log.debug("closing a connection: %d wait for their first head", len(self.waiting))
            self.transport.close()
            return
        self.waiting.add(self)
        self._arm(self.head_timeout_s)

    def data_received(self, data: bytes) -> None:
        self._completed_in_read = False
        super().data_received(data)
        if self._head_timer is not None and self.cycle is not self._armed_for:
            self._disarm()  # a whole head arrived (it made a new request cycle)
        if self._head_bytes is not None and not self._completed_in_read:
            self._head_bytes += len(data)
            if self._head_bytes > self.max_head_bytes and not self.transport.is_closing():
                self._head_too_large()

    def on_headers_complete(self) -> None:
        self._head_bytes = None
        # The head's size as parsed (line and headers, their separators counted): a head
        # that came whole within one read was not counted by data_received.
        size = len(self.parser.get_method()) + len(self.url) + 14  # " ", " HTTP/1.1\r\n\r\n"
        size += sum(len(name) + len(value) + 4 for name, value in self.headers)
        if size > self.max_head_bytes:
            self._head_over = True
            # The parser turns it into an HttpParserError, which uvicorn answers with
            # send_400_response (here the 431), before a request cycle exists.
            raise HeadTooLarge(size)
        if self._is_livez():
            self._answer_livez()
            return
        super().on_headers_complete()

    def _is_livez(self) -> bool:
        """A plain `GET /livez` on a port that answers it, with no request in progress."""
        return (
            self.answers_livez
            and self.url == b"/livez"
            and self.parser.get_method() == b"GET"
            and (self.cycle is None or self.cycle.response_complete)
        )

    def _answer_livez(self) -> None:
        self._answered = True
        self._disarm()
        self.server_state.total_requests += 1
        self.transport.write(_LIVEZ_ANSWER)
        self.transport.close()

    def on_body(self, body: bytes) -> None:
        if not self._answered:
            super().on_body(body)

    def on_message_complete(self) -> None:
        if self._answered:
            return
        super().on_message_complete()
        self._head_bytes = 0
        self._completed_in_read = True

    def send_400_response(self, msg: str) -> None:
        if not self._head_over:
            super().send_400_response(msg)
            return
        log.debug("closing a connection: a request head over %d bytes", self.max_head_bytes)
        self._disarm()
        self.transport.write(_TOO_LARGE_ANSWER)
        self.transport.close()

    def _head_too_large(self) -> None:
        log.debug("closing a connection: a request head over %d bytes", self.max_head_bytes)
        self._disarm()
        if self.cycle is None or self.cycle.response_complete:  # no answer is being sent
            self.transport.write(_TOO_LARGE_ANSWER)
        self.transport.close()

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


def protocol(
    head_timeout_s: float, keep_alive_s: float, max_waiting: int, *, answers_livez: bool = False
) -> type[HeadLimits]:
    """A HeadLimits class for one server (its own set of waiting connections)."""
    attrs = {
        "head_timeout_s": head_timeout_s,
        "keep_alive_s": keep_alive_s,
        "max_waiting": max_waiting,
        "answers_livez": answers_livez,
        "waiting": set(),
    }
    return type("ServerHeadLimits", (HeadLimits,), attrs)
