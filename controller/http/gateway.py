"""The OpenAI-compatible gateway: routes /v1 requests by `model` and wakes models on demand.

Only three paths exist: POST /v1/completions, POST /v1/chat/completions (streaming passed
through byte for byte) and GET /v1/models. Nothing else is forwarded, so no request to the
gateway ever reaches an engine's dev endpoints (/collective_rpc, /sleep, /pause, ...).

A request is checked (token, body, `model`), admitted by `controller.fleet.admission` (at once
when its model is RUNNING, else held while the swap coordinator wakes it), forwarded to
its engine, and counted in flight until its answer ends, so a drain=wait sleep waits for
it. Served on its own port by the same process as the control API.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import Receive

from controller.config.settings import Settings
from controller.engines.engine import KEEPALIVE_S, engine_transport
from controller.errors import ModelNotFound, Refusal
from controller.fleet.admission import Admission
from controller.fleet.swap import SwapCoordinator
from controller.http.apierrors import INTERNAL_ERROR
from controller.http.guard import Guard, Refused
from controller.http.jsonscan import Shape
from controller.http.openapi import document, gateway_table
from controller.models.manager import Manager
from controller.models.modelmanager import ModelManager
from controller.observe.swapmetrics import SwapMetrics

log = logging.getLogger("hotswap.gateway")

FORWARDED = ("/v1/completions", "/v1/chat/completions")
# Response headers worth passing back (hop-by-hop and length are the server's own business).
_PASS_HEADERS = ("content-type", "cache-control", "x-request-id")


def openai_error(refusal: Refusal) -> JSONResponse:
    """A refusal as the OpenAI-shaped error body clients of /v1 expect."""
    body: dict[str, Any] = {
        "error": {
            "message": refusal.message,
            "type": _ERROR_TYPES.get(refusal.status, "error"),
            "param": None,
            "code": refusal.status,
        }
    }
    if refusal.reason is not None:
        body["error"]["reason"] = refusal.reason
    body["error"].update(refusal.detail)
    headers = {}
    if refusal.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(refusal.retry_after_s)))
    if refusal.status == 401:
        headers["WWW-Authenticate"] = "Bearer"
    return JSONResponse(body, status_code=refusal.status, headers=headers)


_ERROR_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowed",
    408: "RequestTimeoutError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    502: "BadGateway",
    503: "ServiceUnavailable",
}


class Gateway:
    """Auth, parsing and forwarding of /v1 requests (admission is `controller.fleet.admission`'s);
    one per process, owned by the gateway app."""

    def __init__(
        self,
        settings: Settings,
        manager: Manager,
        coordinator: SwapCoordinator,
        metrics: SwapMetrics,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.cfg = settings.gateway
        self.manager = manager
        self.fleet = manager.fleet
        self.metrics = metrics
        self.admission = Admission(settings.gateway, manager, coordinator, metrics, monotonic)
        # The tokens the guard checks every request against (None: the gateway is open).
        self.tokens = settings.auth.gateway_secrets()
        timeout = httpx.Timeout(self.cfg.request_timeout_s, connect=settings.timeouts.control_s)
        limits = httpx.Limits(
            max_connections=None, max_keepalive_connections=64, keepalive_expiry=KEEPALIVE_S
        )
        # One client per engine, each with its own transport (a Unix socket's or TCP).
        self.clients = {
            m.name: httpx.AsyncClient(
                transport=transport if transport is not None else engine_transport(m.uds, limits),
                timeout=timeout,
            )
            for m in settings.models
        }

    async def aclose(self) -> None:
        await self.admission.aclose()
        await asyncio.gather(*(c.aclose() for c in self.clients.values()))

    # ---- forwarding ------------------------------------------------------------------------

    async def forward(self, request: Request, path: str) -> Response:
        raw = await request.body()
        shape: Shape | None = request.state.json if hasattr(request.state, "json") else None
        is_object = shape is not None and shape.is_object
        fields = _fields(raw, shape.fields) if shape is not None else {}
        name, stream = fields.get("model"), fields.get("stream")
        label = name if isinstance(name, str) and name in self.fleet else ""
        try:
            if not is_object:
                raise Refusal(400, None, "the request body must be a JSON object")
            if not isinstance(name, str) or not name:
                raise Refusal(400, None, "`model` is required: the name of a served model")
            # Every value the gateway itself acts on is checked: `"stream": "true"` would be
            # streamed by vLLM and buffered here, and a disconnect would no longer abort it.
            if stream is not None and not isinstance(stream, bool):
                raise Refusal(400, None, "`stream` must be true or false")
            if name not in self.fleet:
                raise Refusal(404, "unknown_model", f"The model `{name}` does not exist.")
            model = self.manager.get(name)  # the HTTP edge: a name becomes the model
            held = await self.admission.admit(model, request.receive)
        except Refusal as refusal:
            if refusal.reason is not None:
                self.metrics.refused(label, refusal.reason)
            self.metrics.request(label, refusal.status)
            if refusal.status >= 500 or refusal.status == 429:
                log.warning(
                    "%s %s -> %d %s",
                    path,
                    label,
                    refusal.status,
                    refusal.message,
                    extra={"model": label or None, "phase": "gateway"},
                )
            return openai_error(refusal)
        if held:  # why is the coordinator's line (a wake, or a wake held); the time is a metric
            log.debug("%s: request held %.3f s", name, held, extra={"model": name})
        return await self._send(model, path, raw, request, stream=stream is True)

    async def _send(
        self, model: ModelManager, path: str, raw: bytes, request: Request, *, stream: bool
    ) -> Response:
        """Forward an admitted request. Its answer is passed back as it comes, streamed or
        not (nothing is held whole here); the forward is cancelled, and its connection to
        the engine closed (vLLM aborts the generation), if the client leaves before the
        answer's headers; the in-flight count drops when the answer is done."""
        name, rec = model.name, model.record
        headers = {"content-type": "application/json"}
        if accept := request.headers.get("accept"):
            headers["accept"] = accept
        client = self.clients[name]
        req = client.build_request("POST", rec.settings.url + path, content=raw, headers=headers)
        left = _Once(rec.lane.leave)
        try:
            resp = await _unless_gone(client.send(req, stream=True), request.receive)
        except _ClientGone:
            left()
            self.metrics.request(name, 499)
            self.metrics.refused(name, "client_gone")
            log.info("%s: the client left; forwarding %s cancelled", name, path)
            return Response(status_code=499)  # nobody is there to read it
        except httpx.HTTPError as exc:
            left()
            # Its engine died or restarts (the supervisor restarts it): retry later.
            self.metrics.request(name, 503)
            self.metrics.refused(name, "engine_unavailable")
            log.warning("%s: forwarding %s failed: %r", name, path, exc, extra={"model": name})
            return openai_error(
                Refusal(
                    503,
                    "engine_unavailable",
                    f"{name}: the engine did not answer ({type(exc).__name__})",
                    retry_after_s=self.cfg.retry_after_s,
                )
            )
        except BaseException:
            left()
            raise
        self.metrics.request(name, resp.status_code)
        out_headers = {k: v for k, v in resp.headers.items() if k.lower() in _PASS_HEADERS}

        async def passthrough() -> AsyncIterator[bytes]:
            try:
                async for chunk in resp.aiter_bytes():
                    yield chunk
            finally:
                await resp.aclose()
                left()

        return StreamingResponse(passthrough(), status_code=resp.status_code, headers=out_headers)

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": rec.name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "vllm-hotswap",
                    "state": rec.state.value,
                }
                for rec in self.fleet.values()
            ],
        }


def _fields(raw: bytes, spans: dict[str, tuple[int, int]]) -> dict[str, object]:
    """The routed-on values, decoded from their spans (the guard's scan found them; nothing
    else of the body is parsed here). A value too long to be a name or a flag, or not JSON,
    reads as `_INVALID`, which no check accepts."""
    out: dict[str, object] = {}
    for key, (start, end) in spans.items():
        if end - start > _FIELD_MAX:
            out[key] = _INVALID
            continue
        try:
            out[key] = json.loads(raw[start:end])
        except ValueError:
            out[key] = _INVALID
    return out


_FIELD_MAX = 4096  # bytes of a `model` or `stream` value, blanks included
_INVALID = object()


class _ClientGone(Exception):
    """The client disconnected before the engine's answer began."""


async def _unless_gone(call: Awaitable[httpx.Response], receive: Receive) -> httpx.Response:
    """`call`'s answer, or _ClientGone as soon as `receive` says the client disconnected
    (the call is then cancelled: httpx closes its connection to the engine)."""
    sent = asyncio.ensure_future(call)
    gone = asyncio.ensure_future(_disconnect(receive))
    try:
        await asyncio.wait((sent, gone), return_when=asyncio.FIRST_COMPLETED)
    except BaseException:
        sent.cancel()
        gone.cancel()
        raise
    if sent.done():  # answered, or failed, first
        gone.cancel()
        return sent.result()
    sent.cancel()
    await asyncio.wait((sent,))
    if not sent.cancelled() and sent.exception() is None:
        await sent.result().aclose()  # it came as the client left: nobody to pass it to
    raise _ClientGone


async def _disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Once:
    """Call `fn` at most once (a stream's end and an error path may both try)."""

    def __init__(self, fn: Callable[[], None]) -> None:
        self._fn: Callable[[], None] | None = fn

    def __call__(self) -> None:
        fn, self._fn = self._fn, None
        if fn is not None:
            fn()


def create_gateway(gw: Gateway) -> FastAPI:
    """The gateway app over the sidecar's Gateway. Its lifespan only closes the HTTP client:
    the manager and the coordinator are started and stopped with the control app."""
    settings = gw.settings

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await gw.aclose()

    app = FastAPI(
        title="vllm-hotswap gateway",
        version="0.1.0",
        lifespan=lifespan,
        openapi_url=None,  # only the three routes below exist
        docs_url=None,
        redoc_url=None,
        redirect_slashes=False,  # a redirect would answer before auth, to any Host
    )

    async def completions(request: Request) -> Response:
        return await _guarded(lambda: gw.forward(request, "/v1/completions"))

    async def chat(request: Request) -> Response:
        return await _guarded(lambda: gw.forward(request, "/v1/chat/completions"))

    async def list_models(request: Request) -> Response:
        return JSONResponse(gw.models())  # the token: the guard's one check

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        return openai_error(Refusal(exc.status_code, None, str(exc.detail)))

    # The guard's reasons, as counted in hotswap_gateway_refused_total.
    reasons = {
        401: "unauthorized",
        429: "too_many_requests",
        413: "too_large",
        408: "body_timeout",
    }

    def guard_refusal(refused: Refused) -> Response:
        reason = reasons.get(refused.status)
        if reason is not None:
            gw.metrics.refused("", reason)
        gw.metrics.request("", refused.status)
        retry = 1.0 if refused.status == 429 else None
        return openai_error(Refusal(refused.status, reason, refused.message, retry_after_s=retry))

    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(
        Guard,
        render=guard_refusal,
        tokens=gw.tokens,  # the one auth check of every gateway request
        is_open=lambda path: False,
        max_body_bytes=settings.gateway.max_body_bytes,
        max_json_depth=settings.gateway.max_json_depth,
        body_timeout_s=settings.server.body_timeout_s,
        max_buffered_bytes=settings.gateway.max_body_buffer_bytes,
        json_fields=frozenset({"model", "stream"}),
        max_concurrent=settings.gateway.max_concurrent,
    )
    app.add_api_route("/v1/completions", completions, methods=["POST"])
    app.add_api_route("/v1/chat/completions", chat, methods=["POST"])
    app.add_api_route("/v1/models", list_models, methods=["GET"])
    names = [m.name for m in settings.models]
    document(app, gateway_table(auth=gw.tokens is not None, models=names))
    return app


async def _guarded(call: Callable[[], Awaitable[Response]]) -> Response:
    """Nothing unexpected becomes a 500: it is logged and answered 502 with the reason."""
    try:
        return await call()
    except ModelNotFound as exc:
        return openai_error(Refusal(404, None, exc.message))
    except Exception:
        log.exception("gateway: unexpected error")
        # The reason is in the log, with its traceback; the client learns nothing internal.
        return openai_error(Refusal(502, None, INTERNAL_ERROR))
