"""The HTTP surface: app factory, thin routes, bearer auth; its error answers: apierrors.

Auth is the guard's (controller.http.guard), once per request, before any route runs.
Routes only translate HTTP to manager calls and snapshots to JSON; every decision lives in
the manager and the state machine. Readiness (/health) reads snapshots from memory and never
calls an engine. Nothing here answers 500: anything unexpected becomes a 502 with a reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from fastapi import Body, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.exceptions import HTTPException as StarletteHTTPException

from controller.config.bounds import HOUR_S
from controller.config.settings import Settings
from controller.errors import (
    HotswapError,
    NotAdmitting,
)
from controller.fleet.coordinator import Coordinator
from controller.fleet.supervisor import Supervisor
from controller.http.apierrors import (
    NeverFiveHundred,
    guard_refusal,
    hotswap_error,
    http_error,
    validation_error,
)
from controller.http.guard import Guard
from controller.http.openapi import control_table, document
from controller.http.views import (
    compact_dict,
    fleet_summary,
    health_entry,
    model_dict,
    outcome_dict,
    plain,
)
from controller.models.manager import Manager
from controller.models.modelmanager import ModelManager, Outcome
from controller.state import Action, State, overall_ready

log = logging.getLogger("hotswap.api")


# ----------------------------------------------------------------------------- dependencies


@dataclass(frozen=True)
class AppContext:
    """What the routes need (built by the Sidecar), read by the routes' dependencies."""

    settings: Settings
    manager: Manager
    registry: CollectorRegistry
    coordinator: Coordinator  # with hot swap, wakes go through the policy
    supervisor: Supervisor | None = None  # managed mode: the sidecar runs the engines


def get_context(request: Request) -> AppContext:
    ctx: AppContext = request.app.state.hotswap
    return ctx


ContextDep = Annotated[AppContext, Depends(get_context)]


def get_manager(ctx: ContextDep) -> Manager:
    return ctx.manager


ManagerDep = Annotated[Manager, Depends(get_manager)]


def get_model(name: str, manager: ManagerDep) -> ModelManager:
    """The named model's manager; ModelNotFound (404) for a name the sidecar does not know."""
    return manager.get(name)


ModelDep = Annotated[ModelManager, Depends(get_model)]


def admitting(name: str, ctx: AppContext) -> None:
    """A sleep's or wake's first step once its input is judged (404, 422 as always): while
    the sidecar starts or shuts down, 503 NotAdmitting with Retry-After, before anything is
    asked of the model."""
    life = ctx.manager.life
    why = life.reason()
    if why is not None:
        raise NotAdmitting(
            why,
            reason="shutting_down" if life.stopping else "starting",
            retry_after_s=ctx.settings.gateway.retry_after_s,
            model=name,
        )


# ----------------------------------------------------------------------------- request bodies

Level = Annotated[int, Field(ge=1, le=2, strict=True, description="Sleep level: 1 or 2.")]


class SleepBody(BaseModel):
    """POST /models/{name}/sleep; every field optional (defaults from the settings)."""

    model_config = ConfigDict(extra="forbid")

    level: Level | None = None
    drain: Literal["wait", "abort"] = "wait"
    drain_timeout_s: float | None = Field(
        None,
        ge=0,
        le=HOUR_S,
        allow_inf_nan=False,
        description="Seconds, at most an hour; default drain_s (wait) or 0 (abort).",
    )
    keep_prefix_cache: bool | None = Field(
        None,
        strict=True,
        description="Keep the KV cache, so vLLM's prefix cache hits after the wake (level 1 "
        "only); null: the model's setting.",
    )

    deep: bool | None = Field(
        None,
        strict=True,
        description="Checkpoint the engine's processes after the sleep, leaving the GPU "
        "(docs/contracts.md §2.2); null: the model's deep_sleep. 422 where it cannot be.",
    )

    @model_validator(mode="after")
    def _kept_at_level_1(self) -> SleepBody:
        if self.keep_prefix_cache and self.level == 2:
            raise ValueError(
                "keep_prefix_cache applies to level 1 only: level 2 discards the weights "
                "and the KV cache"
            )
        return self


# ----------------------------------------------------------------------------- routes


async def sleep_model(
    name: str,
    model: ModelDep,
    ctx: ContextDep,
    body: Annotated[SleepBody | None, Body()] = None,
    wait: bool = True,
) -> Response:
    req = body if body is not None else SleepBody.model_validate({})
    admitting(name, ctx)
    if req.keep_prefix_cache and (req.level or model.settings.default_level) != 1:
        message = (
            "keep_prefix_cache applies to level 1 only, and this model sleeps at level "
            f"{model.settings.default_level} by default: send level 1 with it"
        )
        body_ = {"error": "ValidationError", "message": message, "model": name}
        return JSONResponse(body_, status_code=422)
    deep = await model.check_deep(req.deep)  # a refusal (422) before anything changes
    # None: the manager applies the model's default level and the drain timeout's default;
    # with hot swap the gateway's requests in flight are drained too.
    args = (model, req.level, req.drain, req.drain_timeout_s)
    kept = req.keep_prefix_cache
    if not wait:
        started = ctx.coordinator.begin_sleep(*args, keep_prefix_cache=kept, deep=deep)
        return _accepted(name, started)
    outcome = await ctx.coordinator.sleep(*args, keep_prefix_cache=kept, deep=deep)
    return JSONResponse(outcome_dict(name, outcome))


async def wake_model(
    name: str, model: ModelDep, ctx: ContextDep, wait: bool = True, evict: bool = True
) -> Response:
    """Hot-swap mode: the swap policy decides (evicting the least used models unless
    evict=false, which answers 409 with the reason instead); its decision is in the
    answer's `policy`."""
    admitting(name, ctx)
    if not wait:
        return _accepted(name, ctx.coordinator.begin_wake(model, evict=evict))
    result = await ctx.coordinator.wake(model, evict=evict)
    outcome = result.outcome or Outcome(Action.NOOP, model.snapshot())
    body = outcome_dict(name, outcome)
    if result.plan is not None:
        body["policy"] = result.to_dict()
    return JSONResponse(body)


def _accepted(name: str, started: Outcome) -> Response:
    """202 for ?wait=false: the transition runs on; GET the Location to follow it."""
    body = outcome_dict(name, started)
    body["location"] = f"/models/{name}"
    return JSONResponse(body, status_code=202, headers={"Location": f"/models/{name}"})


Detail = Annotated[
    Literal["compact", "full"],
    Query(description="compact: who is awake, in readable times; full: every field."),
]


async def list_models(
    manager: ManagerDep, ctx: ContextDep, detail: Detail = "compact"
) -> dict[str, Any]:
    host = ctx.coordinator.host_budget_bytes()
    fleet = fleet_summary(manager.fleet, manager.settings, host)
    records = list(manager.fleet.values())
    if detail == "full":
        return {"models": [model_dict(r, manager.settings) for r in records], "fleet": fleet}
    return {
        "awake": [r.name for r in records if r.state is State.RUNNING],
        "models": [compact_dict(r) for r in records],
        "fleet": fleet,
    }


async def get_model_state(
    model: ModelDep, manager: ManagerDep, detail: Detail = "full"
) -> dict[str, Any]:
    """One model, every field (`detail=compact`: its compact entry)."""
    if detail == "compact":
        return compact_dict(model.record)
    return model_dict(model.record, manager.settings)


async def audit_model(
    name: str,
    model: ModelDep,
    level: Annotated[int | None, Query(ge=1, le=2)] = None,
) -> dict[str, Any]:
    lvl = level if level is not None else model.settings.default_level
    ranks = await model.audit(lvl)
    return {"model": name, "level": lvl, "ranks": plain(ranks)}


async def health(manager: ManagerDep) -> Response:
    snaps = manager.snapshots()
    why = manager.life.reason()  # starting (the start-up reconciliation) or stopping
    ready = why is None and overall_ready(snaps)
    body: dict[str, Any] = {
        "ready": ready,
        "models": {n: health_entry(s, s.counts_ready) for n, s in snaps.items()},
    }
    if why is not None:
        body["reason"] = why
    return JSONResponse(body, status_code=200 if ready else 503)


async def model_health(name: str, model: ModelDep, manager: ManagerDep) -> Response:
    snap = model.snapshot()
    why = manager.life.reason()
    ready = why is None and snap.ready
    body: dict[str, Any] = {"ready": ready, "models": {name: health_entry(snap, ready)}}
    if why is not None:
        body["reason"] = why
    return JSONResponse(body, status_code=200 if ready else 503)


async def livez() -> dict[str, str]:
    return {"status": "ok"}


async def metrics(ctx: ContextDep) -> Response:
    return Response(generate_latest(ctx.registry), media_type=CONTENT_TYPE_LATEST)


def _open_path(path: str) -> bool:
    """Probes and scrapes need no token; every other path does (an unknown one too)."""
    if path in ("/livez", "/health", "/metrics"):
        return True
    parts = path.split("/")
    return len(parts) == 4 and parts[1] == "models" and bool(parts[2]) and parts[3] == "health"


# ----------------------------------------------------------------------------- factory


def create_app(
    ctx: AppContext, lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None
) -> FastAPI:
    """The control API over the sidecar's parts; `lifespan` starts and stops them."""
    settings = ctx.settings
    tokens = settings.auth.control_secrets()
    docs = settings.server.docs  # off by default: the schema maps every route for a caller
    app = FastAPI(
        title="vllm-hotswap",
        version="0.1.0",
        lifespan=lifespan,
        openapi_url="/openapi.json" if docs else None,
        docs_url="/docs" if docs else None,
        redoc_url="/redoc" if docs else None,
        redirect_slashes=False,  # a redirect would answer before auth, to any Host
    )
    app.state.hotswap = ctx  # read by get_context, the routes' one dependency

    app.add_exception_handler(HotswapError, hotswap_error)
    app.add_exception_handler(RequestValidationError, validation_error)
    app.add_exception_handler(StarletteHTTPException, http_error)
    app.add_middleware(
        Guard,
        render=guard_refusal,
        tokens=tokens,  # the one auth check of every control request
        is_open=_open_path,
        max_body_bytes=settings.server.max_body_bytes,
        max_json_depth=settings.server.max_json_depth,
        body_timeout_s=settings.server.body_timeout_s,
    )
    app.add_middleware(NeverFiveHundred)

    # Open: probes and scrapes must work without the token.
    app.add_api_route("/livez", livez, methods=["GET"])
    app.add_api_route("/health", health, methods=["GET"])
    app.add_api_route("/models/{name}/health", model_health, methods=["GET"])
    app.add_api_route("/metrics", metrics, methods=["GET"])

    # Token: the guard checked it before the request got here.
    app.add_api_route("/models", list_models, methods=["GET"])
    app.add_api_route("/models/{name}", get_model_state, methods=["GET"])
    app.add_api_route("/models/{name}/audit", audit_model, methods=["GET"])
    app.add_api_route("/models/{name}/sleep", sleep_model, methods=["POST"])
    app.add_api_route("/models/{name}/wake", wake_model, methods=["POST"])
    document(app, control_table(auth=tokens is not None))
    return app
