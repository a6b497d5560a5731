"""The hostile-input guard in front of both apps (plain ASGI, outside FastAPI).

In this order, before the app sees anything:
1. auth, decided from the headers alone: a request without the token is answered 401
   before one byte of its body is read (nothing is buffered or parsed for it);
2. a body cap: 413 on a Content-Length above it, and on the streamed count of a body sent
   without one (chunked), the moment it passes the cap; and a deadline: a body not whole
   `body_timeout_s` after its head answers 408 (the head's own deadline is uvicorn's side,
   controller.http.connlimits);
3. a bound on JSON nesting (400), checked as the body arrives by a single-pass scanner
   (controller.http.jsonscan) in slices of `SLICE` bytes with a yield to the loop between
   them, so no body holds the event loop for long, whatever its bytes;
4. a cap on requests served at once (429), so held and streaming requests cannot pile up,
   taken only once the body is complete and checked: a half-sent body holds no slot; a
   request that finds every slot taken is refused from its head, its body never read.
An admitted body (at most the cap) is read here and replayed to the app, its scan's `Shape`
in `scope["state"]["json"]`; later `receive` calls go to the server's own, so the app still
sees the client's disconnect.
"""

from __future__ import annotations

import asyncio
import hmac
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controller.http.jsonscan import JsonScan, Shape, json_too_deep, member_run

__all__ = ["SLICE", "Guard", "Refused", "bearer_in", "bearer_ok", "json_too_deep"]

# Bytes scanned between two yields to the event loop: a few milliseconds of CPU at worst.
SLICE = 8 << 10


@dataclass(frozen=True)
class Refused:
    """A request the guard answers itself; the app's `render` gives it the app's error shape."""

    status: int
    error: str  # a short name: "Unauthorized", "PayloadTooLarge", ...
    message: str
    headers: dict[str, str] = field(default_factory=dict)


Render = Callable[[Refused], Response]


def bearer_ok(authorization: str | None, token: bytes) -> bool:
    """`Authorization: Bearer <token>`, compared in constant time (bytes: no TypeError on
    non-ASCII input); the scheme is case-insensitive, surrounding blanks are ignored."""
    return bearer_in(authorization, (token,))


def bearer_in(authorization: str | None, tokens: Sequence[bytes]) -> bool:
    """`bearer_ok` against several tokens: each compared (no early exit), so the time says
    nothing about which one, or how many, came close."""
    scheme, _, given = (authorization or "").strip().partition(" ")
    presented = given.strip().encode()
    matched = False
    for token in tokens:
        matched |= hmac.compare_digest(presented, token)
    return scheme.lower() == "bearer" and matched


class _TooLarge(Exception):
    pass


class _TooMuchHeld(Exception):
    pass


RETRY = {"Retry-After": "1"}


class _Held:
    """One request's share of the guard's `max_buffered_bytes`: grows to the body's size
    (its Content-Length at once, or as it streams in), given back when the request ends
    (the body is held until the app is done with it)."""

    def __init__(self, guard: Guard) -> None:
        self.guard = guard
        self.bytes = 0

    def take(self, size: int) -> bool:
        """Hold `size` bytes in all; False (nothing more taken) when that passes the cap."""
        more = size - self.bytes
        cap = self.guard.max_buffered_bytes
        if more <= 0:
            return True
        if cap is not None and self.guard.buffered + more > cap:
            return False
        self.guard.buffered += more
        self.bytes = size
        return True

    def release(self) -> None:
        self.guard.buffered -= self.bytes
        self.bytes = 0


class Guard:
    """ASGI middleware: auth from headers, concurrency cap, body cap, JSON depth bound.

    `is_open(path)` names the paths that need no token (probes, metrics); `tokens` are the
    ones that open the app (any one of them), None means no auth at all. This is the app's
    one auth check: no route checks the token again. `max_concurrent` None: no cap on
    requests at once.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        render: Render,
        tokens: Sequence[bytes] | None,
        is_open: Callable[[str], bool],
        max_body_bytes: int,
        max_json_depth: int,
        max_concurrent: int | None = None,
        body_timeout_s: float | None = None,
        max_buffered_bytes: int | None = None,
        json_fields: frozenset[str] = frozenset(),
    ) -> None:
        self.app = app
        self.render = render
        self.tokens = tokens
        self.is_open = is_open
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth
        self.max_concurrent = max_concurrent
        self.body_timeout_s = body_timeout_s  # from the head to the body's last byte
        self.max_buffered_bytes = max_buffered_bytes  # bodies held at once, all requests
        self.buffered = 0
        self.json_fields = json_fields  # top-level keys whose value spans the app reads
        member_run(json_fields, max_json_depth)  # compiled now, not on a request's time
        self.active = 0  # requests between the guard and their response's end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path: str = scope.get("path", "")
        if (
            self.tokens is not None
            and not self.is_open(path)
            and not bearer_in(headers.get("authorization"), self.tokens)
        ):
            await self._refuse(
                Refused(401, "Unauthorized", "a valid bearer token is required"),
                scope,
                receive,
                send,
                {"WWW-Authenticate": "Bearer"},
            )
            return
        await self._admit(scope, receive, send, headers)

    async def _admit(self, scope: Scope, receive: Receive, send: Send, headers: Headers) -> None:
        declared = headers.get("content-length")
        if declared is not None:
            if not (declared.isascii() and declared.isdigit()):
                bad = Refused(400, "BadRequest", "Content-Length must be a decimal byte count")
                await self._refuse(bad, scope, receive, send)
                return
            if int(declared) > self.max_body_bytes:
                await self._refuse(self._too_large(), scope, receive, send)
                return
        if self._full():  # refused now rather than after reading and scanning its body
            await self._refuse(self._busy(), scope, receive, send, RETRY)
            return
        held = _Held(self)
        try:
            if declared is not None and not held.take(int(declared)):
                await self._refuse(self._too_many_bytes(), scope, receive, send, RETRY)
                return
            await self._check_and_forward(scope, receive, send, held)
        finally:
            held.release()

    async def _check_and_forward(
        self, scope: Scope, receive: Receive, send: Send, held: _Held
    ) -> None:
        scanner = JsonScan(self.max_json_depth, self.json_fields)
        try:
            async with asyncio.timeout(self.body_timeout_s):
                body, gone = await self._read(receive, scanner, held)
        except _TooMuchHeld:
            await self._refuse(self._too_many_bytes(), scope, receive, send, RETRY)
            return
        except _TooLarge:
            await self._refuse(self._too_large(), scope, receive, send)
            return
        except TimeoutError:
            slow = Refused(
                408, "RequestTimeout", f"the body did not arrive within {self.body_timeout_s:g} s"
            )
            await self._refuse(slow, scope, receive, send)
            return
        if gone:
            return  # the client left before its body arrived: nobody to answer
        shape = scanner.result()
        if body and (shape.depth > self.max_json_depth or not shape.balanced):
            deep = Refused(
                400,
                "BadRequest",
                f"the JSON body nests deeper than {self.max_json_depth} levels "
                "or its brackets do not balance",
            )
            await self._refuse(deep, scope, receive, send)
            return
        if self._full():
            await self._refuse(self._busy(), scope, receive, send, RETRY)
            return
        self.active += 1
        try:
            await self._forward(scope, receive, send, body, shape)
        finally:
            self.active -= 1

    async def _forward(
        self, scope: Scope, receive: Receive, send: Send, body: bytes, shape: Shape
    ) -> None:
        """Hand the checked request to the app: its body replayed, its scan in the state."""
        scope.setdefault("state", {})["json"] = shape
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive, scanner: JsonScan, held: _Held) -> tuple[bytes, bool]:
        """The whole body, scanned as it arrives; _TooLarge as soon as the count passes the
        cap; (b"", True) when the client disconnected first. The scan stops early once the
        body is known to nest too deep (the body is still read, within the cap)."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return b"", True
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _TooLarge
            if not held.take(size):
                raise _TooMuchHeld
            chunks.append(chunk)
            await _scan(scanner, chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False

    def _full(self) -> bool:
        return self.max_concurrent is not None and self.active >= self.max_concurrent

    def _busy(self) -> Refused:
        return Refused(
            429,
            "TooManyRequests",
            f"{self.max_concurrent} requests are already being served; retry shortly",
        )

    def _too_many_bytes(self) -> Refused:
        return Refused(
            429,
            "TooManyRequests",
            f"{self.max_buffered_bytes} bytes of request bodies are already held; retry shortly",
        )

    def _too_large(self) -> Refused:
        return Refused(
            413, "PayloadTooLarge", f"the request body is larger than {self.max_body_bytes} bytes"
        )

    async def _refuse(
        self,
        refused: Refused,
        scope: Scope,
        receive: Receive,
        send: Send,
        extra: dict[str, str] | None = None,
    ) -> None:
        headers = {**refused.headers, **(extra or {})}
        response = self.render(Refused(refused.status, refused.error, refused.message, headers))
        # The body may be unread: closing the connection means the server need not drain it.
        response.headers["Connection"] = "close"
        await response(scope, receive, send)


async def _scan(scanner: JsonScan, chunk: bytes) -> None:
    """Feed `chunk` in slices, yielding to the event loop between them."""
    view = memoryview(chunk)
    for start in range(0, len(view), SLICE):
        if start:
            await asyncio.sleep(0)
        scanner.feed(view[start : start + SLICE])
