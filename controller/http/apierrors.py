"""The control API's error answers: one JSON shape for every refusal, never a 500.

`hotswap_error` maps the error tree (`errors.http_status`) to its status and body,
`validation_error` a request that does not fit its schema (422, only loc/msg/type),
`http_error` Starlette's own (404, 405), `guard_refusal` the hostile-input guard's; and
`NeverFiveHundred`, the outermost middleware, turns anything unexpected into a logged 502
with a reason.
"""

from __future__ import annotations

import http
import logging
import math
from typing import Any

from fastapi import Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controller.errors import HotswapError, NotAdmitting, Unauthorized, http_status
from controller.http.guard import Refused

log = logging.getLogger("hotswap.api")

# What an unexpected error tells the client: its reason is in the log, with the traceback.
INTERNAL_ERROR = "internal error (see the sidecar's log)"


def error_body(exc: HotswapError, request: Request | None = None) -> dict[str, Any]:
    body = exc.to_dict()
    if "model" not in body and request is not None and "name" in request.path_params:
        body["model"] = request.path_params["name"]
    return body


async def hotswap_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HotswapError)
    status = http_status(exc)
    if status >= 500:
        log.warning(
            "%s %s -> %d %s: %s",
            request.method,
            request.url.path,
            status,
            type(exc).__name__,
            exc.message,
            extra={"model": exc.model or request.path_params.get("name"), "phase": exc.phase},
        )
    headers: dict[str, str] | None = None
    if isinstance(exc, Unauthorized):
        headers = {"WWW-Authenticate": "Bearer"}
    elif isinstance(exc, NotAdmitting):
        headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
    return JSONResponse(error_body(exc, request), status_code=status, headers=headers)


async def validation_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, RequestValidationError)
    # Only loc/msg/type: `input` and `ctx` may hold bytes or exceptions that JSON cannot carry.
    details = [
        {
            "loc": [str(x) for x in e.get("loc", ())],
            "msg": str(e.get("msg", "")),
            "type": str(e.get("type", "")),
        }
        for e in exc.errors()
    ]
    message = "; ".join(f"{'.'.join(d['loc'])}: {d['msg']}" for d in details) or "invalid request"
    body = {"error": "ValidationError", "message": message, "details": details}
    if "name" in request.path_params:
        body["model"] = request.path_params["name"]
    return JSONResponse(body, status_code=422)


async def http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, StarletteHTTPException)
    try:
        phrase = http.HTTPStatus(exc.status_code).phrase
    except ValueError:
        phrase = "HTTPError"
    body = {"error": phrase.replace(" ", "").replace("-", ""), "message": str(exc.detail)}
    return JSONResponse(body, status_code=exc.status_code, headers=exc.headers)


def guard_refusal(refused: Refused) -> Response:
    """The guard's answers in the control API's error shape."""
    body = {"error": refused.error, "message": refused.message}
    return JSONResponse(body, status_code=refused.status, headers=refused.headers)


class NeverFiveHundred:
    """Outermost catch-all: an unexpected exception becomes a logged 502 with a reason.

    A plain ASGI middleware rather than an `Exception` handler: Starlette re-raises after
    running such a handler, which would put a traceback (and a 500) in the server's path.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            log.exception("unexpected error on %s %s", scope.get("method"), scope.get("path"))
            if started:
                raise  # headers are gone: nothing better can be sent
            body = {"error": "InternalError", "message": INTERNAL_ERROR}
            await JSONResponse(body, status_code=502)(scope, receive, send)
