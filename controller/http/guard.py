"""The hostile-input guard in front of both apps (plain ASGI, outside FastAPI).

In this order, before the app sees anything:
1. auth, decided from the headers alone: a request without the token is answered 401
   before one byte of its body is read (nothing is buffered or parsed for it);
2. a cap on requests served at once (429), so held and streaming requests cannot pile up;
3. a body cap: 413 on a Content-Length above it, and on the streamed count of a body sent
   without one (chunked), the moment it passes the cap;
4. a bound on JSON nesting (400), checked without recursion, so the parser behind it never
   recurses deeper than the bound.
An admitted body (at most the cap) is read here and replayed to the app; later `receive`
calls go to the server's own, so the app still sees the client's disconnect.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable
from dataclasses import dataclass, field

from starlette.datastructures import Headers
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send


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
    scheme, _, given = (authorization or "").strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), token)


# A JSON string (escapes included): its brackets are text, not structure.
_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")
_ONE_KIND = bytes.maketrans(b"{}", b"[]")
_PAIR = re.compile(rb"\[\]")


def json_too_deep(body: bytes, limit: int) -> bool:
    """True when `body` nests arrays/objects deeper than `limit`, or its brackets do not
    balance (then it is not JSON either). No recursion: each pass removes the innermost
    pairs at C speed, so a hostile body costs at most `limit` linear passes."""
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # the usual case: too few brackets to nest that deep
    brackets = _STRING.sub(b"", body).translate(_ONE_KIND, _NOT_BRACKETS)
    for _ in range(limit):
        brackets, removed = _PAIR.subn(b"", brackets)
        if not brackets:
            return False
        if not removed:
            return True  # unbalanced: `[[[[` would send the parser down every level
    return bool(brackets)


class _TooLarge(Exception):
    pass


class Guard:
    """ASGI middleware: auth from headers, concurrency cap, body cap, JSON depth bound.

    `is_open(path)` names the paths that need no token (probes, metrics); `token` None means
    no auth at all. `max_concurrent` None: no cap on requests at once.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        render: Render,
        token: bytes | None,
        is_open: Callable[[str], bool],
        max_body_bytes: int,
        max_json_depth: int,
        max_concurrent: int | None = None,
    ) -> None:
        self.app = app
        self.render = render
        self.token = token
        self.is_open = is_open
        self.max_body_bytes = max_body_bytes
        self.max_json_depth = max_json_depth
        self.max_concurrent = max_concurrent
        self.active = 0  # requests between the guard and their response's end

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = Headers(scope=scope)
        path: str = scope.get("path", "")
        if (
            self.token is not None
            and not self.is_open(path)
            and not bearer_ok(headers.get("authorization"), self.token)
        ):
            await self._refuse(
                Refused(401, "Unauthorized", "a valid bearer token is required"),
                scope,
                receive,
                send,
                {"WWW-Authenticate": "Bearer"},
            )
            return
        if self.max_concurrent is not None and self.active >= self.max_concurrent:
            refusal = Refused(
                429,
                "TooManyRequests",
                f"{self.max_concurrent} requests are already being served; retry shortly",
            )
            await self._refuse(refusal, scope, receive, send, {"Retry-After": "1"})
            return
        self.active += 1
        try:
            await self._admit(scope, receive, send, headers)
        finally:
            self.active -= 1

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
        try:
            body, gone = await self._read(receive)
        except _TooLarge:
            await self._refuse(self._too_large(), scope, receive, send)
            return
        if gone:
            return  # the client left before its body arrived: nobody to answer
        if body and json_too_deep(body, self.max_json_depth):
            deep = Refused(
                400,
                "BadRequest",
                f"the JSON body nests deeper than {self.max_json_depth} levels "
                "or its brackets do not balance",
            )
            await self._refuse(deep, scope, receive, send)
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read(self, receive: Receive) -> tuple[bytes, bool]:
        """The whole body, or _TooLarge as soon as the count passes the cap; (b"", True) when
        the client disconnected first."""
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
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks), False

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
