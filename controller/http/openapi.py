"""Every answer each route can give, with its body, in both apps' OpenAPI documents.

FastAPI documents a route's 200 and its own 422 only; the guard (400, 401, 408, 413, 429), the
error tree (404, 409, 502, 504), readiness (503) and the gateway (its OpenAI-shaped errors,
SSE) answer too. `document(app, table)` puts them all in the app's schema, which is what the
fuzzing (tests/controller/test_fuzz.py) holds every answer to, and what `/openapi.json`
serves when `server.docs` is on.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ConfigDict, Field, RootModel

from controller.state import Gate, State

# ----------------------------------------------------------------------------- control bodies


class ErrorBody(BaseModel):
    """Every control API error: the error class, why, and where when known."""

    model_config = ConfigDict(extra="allow")  # per class: tensors, late_ranks, plan, ...

    error: str
    message: str
    model: str | None = None
    phase: str | None = None


class ValidationDetail(BaseModel):
    loc: list[str]
    msg: str
    type: str


class ValidationErrorBody(ErrorBody):
    details: list[ValidationDetail]


class PhaseBody(BaseModel):
    name: str
    duration_s: float
    ok: bool
    ranks: list[dict[str, Any]]
    detail: dict[str, Any]


class TransitionBody(BaseModel):
    kind: str
    from_state: State
    to_state: State
    result: str
    level: int | None
    started_at: float
    ended_at: float
    duration_s: float
    error: str | None
    failed_phase: str | None
    phases: list[PhaseBody]


class OutcomeBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    action: str
    state: State
    verified: bool
    level: int | None
    transition: TransitionBody | None
    policy: dict[str, Any] | None = Field(None, description="Hot-swap mode: the policy's decision.")
    location: str | None = Field(None, description="With ?wait=false: where to follow it.")


class SnapshotBody(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str
    state: State
    since: float
    gate: Gate
    verified: bool
    ready: bool
    level: int | None
    last_transition: TransitionBody | None
    last_error: str | None
    extra: dict[str, Any]
    fleet: dict[str, Any] | None = Field(
        None,
        description="Placement (devices, CUDA_VISIBLE_DEVICES), the bytes the policy counts "
        "(footprint, asleep, host) and the model's idle sleep.",
    )


class CompactTransitionBody(BaseModel):
    kind: str
    result: str
    duration_s: float
    ended: str | None
    error: str | None
    failed_phase: str | None


class CompactModelBody(BaseModel):
    """GET /models' default entry: the state and readable times, no phases."""

    name: str
    state: State
    ready: bool
    verified: bool
    unverified_wake: bool = False
    level: int | None
    phase: str | None
    since: str | None = Field(description="ISO 8601 UTC.")
    for_s: float = Field(description="Seconds in this state.")
    last_used: str | None = Field(description="The last gateway request's end, ISO 8601 UTC.")
    devices: list[str]
    last_transition: CompactTransitionBody | None
    last_error: str | None


class OneModelBody(RootModel[SnapshotBody | CompactModelBody]):
    """GET /models/{name}: every field, or with ?detail=compact its compact entry."""


class ModelsBody(BaseModel):
    awake: list[str] | None = Field(None, description="Compact: the models RUNNING now.")
    models: list[CompactModelBody] | list[SnapshotBody]
    fleet: dict[str, Any] | None = Field(
        None,
        description="The fleet settings (swap.devices, host_budget and its bytes, idle sleep) "
        "and the host bytes all models hold.",
    )


class AuditBody(BaseModel):
    model: str
    level: int
    ranks: list[dict[str, Any]]


class HealthEntry(BaseModel):
    state: State
    verified: bool
    unverified_wake: bool = Field(
        False,
        description="Served after a wake nothing verified, as the model's "
        "accept_unverified_wake allows (docs/contracts.md §2.3); verified is then false.",
    )
    gate: Gate
    ready: bool


class HealthBody(BaseModel):
    ready: bool
    models: dict[str, HealthEntry]
    reason: str | None = Field(
        None, description="Why not ready whatever the models: starting, or shutting down."
    )


class LivezBody(BaseModel):
    status: str


# ----------------------------------------------------------------------------- gateway bodies


class OpenAIError(BaseModel):
    model_config = ConfigDict(extra="allow")  # a refused wake adds its `plan`

    message: str
    type: str
    param: str | None
    code: int
    reason: str | None = None


class OpenAIErrorBody(BaseModel):
    error: OpenAIError


class ModelEntry(BaseModel):
    id: str
    object: str
    created: int
    owned_by: str
    state: State | None


class ModelListBody(BaseModel):
    object: str
    data: list[ModelEntry]


class GatewayRequest(BaseModel):
    """What the gateway reads of a /v1 body (400 when its type is wrong); the rest goes to
    the engine as sent, and the engine judges it."""

    model_config = ConfigDict(extra="allow")

    model: str = Field(min_length=1, description="The name of a served model.")
    stream: bool | None = Field(None, description="true: the answer is an SSE stream.")


class CompletionRequest(GatewayRequest):
    prompt: str | list[str] | list[int] = Field(description="The engine's; passed through.")


class ChatRequest(GatewayRequest):
    messages: list[dict[str, Any]] = Field(description="The engine's; passed through.")


# ----------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Answer:
    """One documented answer: its body (a model, or raw content by media type) and headers."""

    description: str
    body: type[BaseModel] | None = None
    content: Mapping[str, Mapping[str, Any]] | None = None
    headers: Sequence[str] = ()


@dataclass(frozen=True)
class Route:
    answers: Mapping[int, Answer]
    body: type[BaseModel] | None = None  # a request body FastAPI does not parse itself
    body_examples: Sequence[Mapping[str, Any]] = field(default_factory=tuple)


HEADER_DOCS = {
    "Location": "Where to follow the transition (GET it).",
    "Retry-After": "Seconds to wait before trying again.",
    "WWW-Authenticate": "Bearer.",
}


# A sleep or wake while the sidecar starts or shuts down (controller.http.api.admitting).
NOT_ADMITTING = Answer(
    "NotAdmitting: the sidecar is starting (its start-up reconciliation) or shutting down "
    "(`reason`); nothing changed. Try again after Retry-After.",
    ErrorBody,
    headers=["Retry-After"],
)


def control_table(auth: bool) -> dict[tuple[str, str], Route]:
    """The control API's routes and every answer each can give; `auth`: a token is set."""

    def err(what: str) -> Answer:
        return Answer(what, ErrorBody)

    # The guard's and the catch-all's answers, on every route.
    common = {
        400: err("A bad Content-Length, or JSON nested too deep (server.max_json_depth)."),
        408: err("The body did not arrive within server.body_timeout_s."),
        413: err("The body is larger than server.max_body_bytes."),
        502: err("The engine failed, or anything unexpected (never a 500)."),
    }
    guarded = (
        {**common, 401: Answer("No valid bearer token.", ErrorBody, headers=["WWW-Authenticate"])}
        if auth
        else common
    )
    invalid = {422: Answer("A parameter or the body is invalid.", ValidationErrorBody)}
    missing = {404: err("No model of that name.")}
    transition = {
        200: Answer("The transition's outcome (or a no-op with the current state).", OutcomeBody),
        202: Answer(
            "?wait=false: started; follow the Location.", OutcomeBody, headers=["Location"]
        ),
        409: err(
            "Not now: the opposite transition is in flight, the model is FAILED, "
            "or (wake) the policy refuses."
        ),
        503: NOT_ADMITTING,
        504: err("An engine call or the drain timed out."),
        **missing,
        **invalid,
        **guarded,
    }
    metrics_text = {"text/plain": {"schema": {"type": "string"}}}
    health = {
        200: Answer("Ready.", HealthBody),
        503: Answer(
            "Not ready: a model it gates is not RUNNING and verified, or the sidecar is "
            "starting (its start-up reconciliation) or shutting down (`reason`).",
            HealthBody,
        ),
    }
    # A sleep's 422 is also a deep sleep that cannot be done here (the reason, no `details`).
    sleep = {
        **transition,
        422: err(
            "A parameter or the body is invalid (`details`), or a deep sleep cannot be done "
            "here (DeepSleepRefused: why; nothing changed)."
        ),
    }
    return {
        ("post", "/models/{name}/sleep"): Route(sleep),
        ("post", "/models/{name}/wake"): Route(transition),
        ("get", "/models"): Route({200: Answer("Every model.", ModelsBody), **invalid, **guarded}),
        ("get", "/models/{name}"): Route(
            {200: Answer("The model.", OneModelBody), **missing, **invalid, **guarded}
        ),
        ("get", "/models/{name}/audit"): Route(
            {
                200: Answer("Per rank: every tensor, its pool, whether it is at risk.", AuditBody),
                409: err("The model's state allows no audit now."),
                504: err("The engine did not answer in time."),
                **missing,
                **invalid,
                **guarded,
            }
        ),
        ("get", "/health"): Route({**health, **common}),
        ("get", "/models/{name}/health"): Route({**health, **missing, **common}),
        ("get", "/livez"): Route({200: Answer("The loop answers.", LivezBody), **common}),
        ("get", "/metrics"): Route(
            {200: Answer("Prometheus text.", content=metrics_text), **common}
        ),
    }


def gateway_table(auth: bool, models: Sequence[str]) -> dict[tuple[str, str], Route]:
    def err(what: str, *headers: str) -> Answer:
        return Answer(what, OpenAIErrorBody, headers=headers)

    common = {
        400: err("A bad Content-Length, or JSON nested too deep (gateway.max_json_depth)."),
        408: err("The body did not arrive within server.body_timeout_s."),
        413: err("The body is larger than gateway.max_body_bytes."),
        429: err(
            "The model's queue is full, or gateway.max_concurrent requests are being served.",
            "Retry-After",
        ),
    }
    if auth:
        common[401] = err("No valid bearer token.", "WWW-Authenticate")
    answer: dict[str, dict[str, Any]] = {
        "application/json": {"schema": {"type": "object"}},
        # One schema per event: `data:` lines carry the engine's JSON chunks, then [DONE].
        "text/event-stream": {
            "schema": {"type": "object", "properties": {"data": {"type": "string"}}}
        },
    }
    forwarded = {
        200: Answer("The engine's answer (an SSE stream with stream: true).", content=answer),
        400: err(
            "The body is not a JSON object, or a value the gateway reads is of the "
            "wrong type; or the engine's own 400 (vLLM's errors are OpenAI-shaped too)."
        ),
        404: err("No model of that name (or the engine's own 404)."),
        499: err("The client disconnected while its request was held (nobody reads it)."),
        502: err("The engine did not answer."),
        503: err(
            "The model's wake failed or did not finish within gateway.hold_timeout_s.",
            "Retry-After",
        ),
        **common,
    }
    completion = [{"model": m, "prompt": "hello", "max_tokens": 4} for m in models[:1]]
    chat = [{"model": m, "messages": [{"role": "user", "content": "hi"}]} for m in models[:1]]
    return {
        ("post", "/v1/completions"): Route(forwarded, CompletionRequest, completion),
        ("post", "/v1/chat/completions"): Route(forwarded, ChatRequest, chat),
        ("get", "/v1/models"): Route(
            {200: Answer("Every model with its state.", ModelListBody), **common}
        ),
    }


# ----------------------------------------------------------------------------- into the schema


def document(app: FastAPI, table: Mapping[tuple[str, str], Route]) -> None:
    """Replace each listed route's answers in `app.openapi()` with the table's."""
    generate: Callable[[], dict[str, Any]] = app.openapi

    def openapi() -> dict[str, Any]:
        if getattr(app.state, "documented", False) and app.openapi_schema:
            return app.openapi_schema
        schema = generate()
        components = schema.setdefault("components", {}).setdefault("schemas", {})

        def ref(model: type[BaseModel]) -> dict[str, Any]:
            js = model.model_json_schema(ref_template="#/components/schemas/{model}")
            for name, sub in js.pop("$defs", {}).items():
                components[name] = sub
            components[model.__name__] = js
            return {"$ref": f"#/components/schemas/{model.__name__}"}

        for (method, path), route in table.items():
            op = schema["paths"][path][method]
            responses: dict[str, Any] = {}
            for status, ans in sorted(route.answers.items()):
                entry: dict[str, Any] = {"description": ans.description}
                if ans.body is not None:
                    entry["content"] = {"application/json": {"schema": ref(ans.body)}}
                elif ans.content is not None:
                    entry["content"] = {k: dict(v) for k, v in ans.content.items()}
                if ans.headers:
                    entry["headers"] = {
                        h: {"description": HEADER_DOCS[h], "schema": {"type": "string"}}
                        for h in ans.headers
                    }
                responses[str(status)] = entry
            op["responses"] = responses
            if route.body is not None:
                media: dict[str, Any] = {"schema": ref(route.body)}
                if route.body_examples:
                    media["examples"] = {
                        f"example{i}": {"value": dict(v)} for i, v in enumerate(route.body_examples)
                    }
                op["requestBody"] = {"required": True, "content": {"application/json": media}}
        app.openapi_schema = schema
        app.state.documented = True
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
