"""Property-based fuzzing of both apps from their own OpenAPI schemas, with schemathesis.

Each app is built as `hotswap serve` builds it (hot-swap mode: the gateway, the swap
coordinator, a budget of one awake model) over fake engines, and reached in-process (ASGI,
its lifespan run once). Every operation gets positive cases (valid by its schema) and
negative ones (invalid by it), for the served model names and for any name, with the token,
without it, and on an app configured without one. Every answer must be documented (status,
content type, body schema, headers), an invalid request must be refused with a 4xx, and no
answer is a 500. At least 1,000 cases per app per run, in well under a minute.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import zlib
from collections import Counter
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)
from starlette.types import Receive, Scope, Send
from support.fakevllm import FakeVllm, wire
from support.gatewayworld import Chunks, Engine, Router

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings

# schemathesis and hypothesis are pytest plugins, so pytest rewrites each of their modules
# (ast.parse) as it is imported. The modules a fuzz case imports lazily are imported here, at
# collection, where no other thread runs: in CI (Python 3.11.7), after test_deep_sleep, one
# parsed during the first case raised "SystemError: AST constructor recursion depth mismatch".
LAZY_IMPORTS = (
    "hypothesis.strategies._internal.flatmapped",
    "hypothesis.strategies._internal.random",
    "schemathesis.core.jsonschema.numeric",
    "schemathesis.core.jsonschema.patterns",
    "schemathesis.core.schema_analysis",
    "schemathesis.core.text",
    "schemathesis.engine.link_calibration",
    "schemathesis.engine.supervisor",
    "schemathesis.generation._cache",
    "schemathesis.generation.body_overrides",
    "schemathesis.generation.dictionaries",
    "schemathesis.generation.hypothesis._response_matching",
    "schemathesis.generation.jsonschema.builder",
    "schemathesis.generation.jsonschema.strategy",
    "schemathesis.generation.stateful.control",
    "schemathesis.generation.value",
    "schemathesis.openapi.generation",
    "schemathesis.openapi.generation.filters",
    "schemathesis.specs.openapi._hypothesis",
    "schemathesis.specs.openapi._operation_lookup",
    "schemathesis.specs.openapi.adapter",
    "schemathesis.specs.openapi.adapter.base_paths",
    "schemathesis.specs.openapi.adapter.content_types",
    "schemathesis.specs.openapi.adapter.formdata",
    "schemathesis.specs.openapi.adapter.parameters",
    "schemathesis.specs.openapi.adapter.protocol",
    "schemathesis.specs.openapi.adapter.references",
    "schemathesis.specs.openapi.adapter.responses",
    "schemathesis.specs.openapi.adapter.security",
    "schemathesis.specs.openapi.adapter.servers",
    "schemathesis.specs.openapi.adapter.v2",
    "schemathesis.specs.openapi.adapter.v3_0",
    "schemathesis.specs.openapi.adapter.v3_1",
    "schemathesis.specs.openapi.adapter.v3_2",
    "schemathesis.specs.openapi.adapter.validators",
    "schemathesis.specs.openapi.analysis",
    "schemathesis.specs.openapi.auth_flow",
    "schemathesis.specs.openapi.auth_flow.models",
    "schemathesis.specs.openapi.auth_jwt",
    "schemathesis.specs.openapi.auths",
    "schemathesis.specs.openapi.content_keywords",
    "schemathesis.specs.openapi.converter",
    "schemathesis.specs.openapi.coverage",
    "schemathesis.specs.openapi.coverage._schema",
    "schemathesis.specs.openapi.coverage._wire",
    "schemathesis.specs.openapi.definitions",
    "schemathesis.specs.openapi.diagnostics",
    "schemathesis.specs.openapi.discriminator",
    "schemathesis.specs.openapi.error_feedback",
    "schemathesis.specs.openapi.examples",
    "schemathesis.specs.openapi.expressions",
    "schemathesis.specs.openapi.expressions.errors",
    "schemathesis.specs.openapi.expressions.extractors",
    "schemathesis.specs.openapi.expressions.lexer",
    "schemathesis.specs.openapi.expressions.nodes",
    "schemathesis.specs.openapi.expressions.parser",
    "schemathesis.specs.openapi.extra_data_source",
    "schemathesis.specs.openapi.headers",
    "schemathesis.specs.openapi.negative",
    "schemathesis.specs.openapi.negative.mutations",
    "schemathesis.specs.openapi.negative.types",
    "schemathesis.specs.openapi.negative.utils",
    "schemathesis.specs.openapi.negative.value_channel",
    "schemathesis.specs.openapi.operations",
    "schemathesis.specs.openapi.resources",
    "schemathesis.specs.openapi.schemas",
    "schemathesis.specs.openapi.semantic_pool",
    "schemathesis.specs.openapi.stateful",
    "schemathesis.specs.openapi.stateful.dependencies",
    "schemathesis.specs.openapi.stateful.dependencies.inputs",
    "schemathesis.specs.openapi.stateful.dependencies.layers",
    "schemathesis.specs.openapi.stateful.dependencies.models",
    "schemathesis.specs.openapi.stateful.dependencies.naming",
    "schemathesis.specs.openapi.stateful.dependencies.outputs",
    "schemathesis.specs.openapi.stateful.dependencies.resources",
    "schemathesis.specs.openapi.stateful.dependencies.schemas",
    "schemathesis.specs.openapi.stateful.inference",
    "schemathesis.specs.openapi.stateful.links",
    "schemathesis.specs.openapi.types",
    "schemathesis.specs.openapi.types.common",
    "schemathesis.specs.openapi.types.v2",
    "schemathesis.specs.openapi.types.v3",
    "schemathesis.specs.openapi.validation",
    "schemathesis.specs.openapi.warnings",
    "schemathesis.transport.asgi",
    "schemathesis.transport.requests",
    "schemathesis.transport.wsgi",
)
for _name in LAZY_IMPORTS:
    with contextlib.suppress(ImportError):  # another schemathesis release: its own layout
        importlib.import_module(_name)

TOKEN = "fuzz-token"
NAMES = ("a", "b")
CASES_PER_APP = 1000
# "Outside the documented schema": an undocumented status, content type, body or header.
DOCUMENTED = [
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


def fuzz_settings(token: str | None) -> Settings:
    return Settings(
        models=[ModelSettings(name=n, url=f"http://{n}.engine.test") for n in NAMES],
        auth={"token": token},
        timeouts={"drain_s": 1.0, "shutdown_s": 1.0, "rpc_s": 2.0, "control_s": 2.0},
        gateway={"enabled": True, "hold_timeout_s": 2.0, "queue_size": 4},
        swap={"max_awake": 1, "min_awake_s": 0.0},
    )


ENGINE_INPUT = {"/v1/completions": "prompt", "/v1/chat/completions": "messages"}


def engine_accepts(value: Any, path: str = "/v1/completions") -> bool:
    """The prompt (text, texts, token ids) or messages (objects) as vLLM takes them."""
    if path == "/v1/chat/completions":
        return isinstance(value, list) and all(isinstance(v, dict) for v in value)
    if isinstance(value, str):
        return True
    if not isinstance(value, list):
        return False
    kinds = [str, dict, int]
    return any(
        all(isinstance(v, kind) and not isinstance(v, bool) for v in value) for kind in kinds
    )


class WireRouter(Router):
    """Every /v1 answer as a real transport gives it: a stream not yet read (the fakes
    answer the bodies they do not model, e.g. no prompt, with an already-read response)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path in ENGINE_INPUT:
            # What the fakes do not model, vLLM refuses: 400 with an OpenAI error body.
            body = json.loads(request.content)
            if not engine_accepts(body.get(ENGINE_INPUT[path]), path):
                error = {"message": "bad request", "type": "BadRequestError", "param": None}
                refused = httpx.Response(400, json={"error": {**error, "code": 400}})
                return httpx.Response(
                    400, headers=refused.headers, stream=Chunks([refused.content])
                )
        response = await super().handle_async_request(request)
        if not path.startswith("/v1/"):
            return response
        body = await response.aread()
        return httpx.Response(response.status_code, headers=response.headers, stream=Chunks([body]))


class Pair:
    """Both apps over one manager, as `hotswap serve` runs them: the control app's lifespan
    starts and stops the manager; HTTP goes to the `target` app."""

    def __init__(self, token: str | None, target: str) -> None:
        self.settings = fuzz_settings(token)
        self.engines = {n: Engine(FakeVllm(name=n, world_size=1)) for n in NAMES}
        router = WireRouter(self.engines)
        side = wire(self.settings, router)  # the Sidecar `hotswap serve` builds
        assert side.gateway_app is not None
        self.side = side
        self.control = side.app
        self.gateway = side.gateway_app
        self.target = self.control if target == "control" else self.gateway

    @asynccontextmanager
    async def lifespan(self) -> AsyncIterator[None]:
        async with (
            self.control.router.lifespan_context(self.control),
            self.gateway.router.lifespan_context(self.gateway),
        ):
            await self.side.started.wait()  # the start-up probes run once the apps serve
            yield

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.target(scope, receive, send)
            return
        assert (await receive())["type"] == "lifespan.startup"
        async with self.lifespan():
            await send({"type": "lifespan.startup.complete"})
            assert (await receive())["type"] == "lifespan.shutdown"
        await send({"type": "lifespan.shutdown.complete"})


@dataclass
class Tally:
    cases: int = 0
    statuses: Counter[int] = field(default_factory=Counter)
    operations: Counter[str] = field(default_factory=Counter)

    def __str__(self) -> str:
        return f"{self.cases} cases, statuses {dict(sorted(self.statuses.items()))}"


def run_cases(strategy: Any, examples: int, check: Callable[[schemathesis.Case], None]) -> None:
    @given(case=strategy)
    @settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,  # the same cases every run: CI is reproducible
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def one(case: schemathesis.Case) -> None:
        check(case)

    one()


def served(case: schemathesis.Case) -> None:
    """A gateway body names a served model in two cases out of three (a random name stops at
    the 404), so the rest of the path gets fuzzed: type checks, holding, waking, forwarding.
    Only a valid name is replaced: a negative case made by `model` itself stays as it is."""
    body = case.body
    if not isinstance(body, dict):
        return
    if isinstance(body.get("model"), str) and body["model"]:
        pick = zlib.crc32(repr(sorted(body.items(), key=str)).encode()) % 3
        if pick < len(NAMES):
            body["model"] = NAMES[pick]


def fuzz(pair: Pair, headers: dict[str, str], examples: int, tally: Tally) -> None:
    schema = schemathesis.openapi.from_dict(pair.target.openapi())
    schema.app = pair
    for result in schema.get_all_operations():
        op = result.ok()
        named = "{name}" in op.path
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            checks = [*DOCUMENTED, negative_data_rejection] if mode.is_negative else DOCUMENTED

            def check(case: schemathesis.Case, checks: list[Any] = checks) -> None:
                served(case)
                response = case.call(headers=headers, timeout=10)
                tally.cases += 1
                tally.statuses[response.status_code] += 1
                tally.operations[case.operation.label] += 1
                assert response.status_code != 500, response.text
                case.validate_response(response, checks=checks)

            # A served model's name (the routes past the 404), then any name at all.
            for path in [*({"name": n} for n in NAMES), None] if named else [None]:
                try:
                    strategy = op.as_strategy(generation_mode=mode, path_parameters=path)
                    run_cases(strategy, examples, check)
                except Unsatisfiable:
                    # Nothing to break (no parameter, no body): no negative case exists.
                    assert mode.is_negative, op.label


@pytest.mark.parametrize("target", ["control", "gateway"])
def test_fuzz_every_answer_is_documented_and_none_is_a_500(target: str) -> None:
    tally = Tally()
    n = 30 if target == "control" else 130  # the gateway has 3 operations, control 9
    secured = Pair(TOKEN, target)
    fuzz(secured, {"Authorization": f"Bearer {TOKEN}"}, n, tally)
    fuzz(secured, {}, n // 3, tally)  # no token: 401 before anything else
    fuzz(Pair(None, target), {}, n * 2 // 3, tally)
    print(f"\nfuzz {target}: {tally}; per operation {dict(tally.operations)}")
    assert tally.cases >= CASES_PER_APP, tally
    assert 500 not in tally.statuses
    assert len({s for s in tally.statuses if 200 <= s < 300}) >= 1, "nothing got through"
