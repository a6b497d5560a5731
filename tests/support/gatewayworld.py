"""The gateway's test world: fake vLLM engines with a data plane (completions answer
`from-<name>` and fail while the engine is paused or asleep, so a request that reaches a
sleeping engine shows up), one transport for all of them, and a sidecar in hot-swap mode
over them (`world`), its gateway app reached in-process."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings, TimeoutSettings
from controller.fleet.swap import SwapCoordinator
from controller.models.manager import Manager
from controller.state import State
from support import asgi
from support.fakevllm import FakeVllm, wire


@dataclass
class Engine:
    """A FakeVllm with a data plane: completions answer `from-<name>`."""

    fake: FakeVllm
    served: list[str] = field(default_factory=list)
    wrong: list[str] = field(default_factory=list)  # requests that reached it asleep
    hold: asyncio.Event | None = None  # completions wait for it when set
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    died: bool = False  # its data plane refuses connections, the control plane not yet

    async def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path not in ("/v1/completions", "/v1/chat/completions"):
            return await self.fake.handle(request)
        body = json.loads(request.content)
        if self.died and isinstance(body.get("prompt"), str):
            raise httpx.ConnectError("fake connection refused", request=request)
        if not isinstance(body.get("prompt", body.get("messages")), str | list) or isinstance(
            body.get("prompt"), list
        ):
            return await self.fake.handle(request)  # the manager's warm-up (token ids)
        if self.fake.paused or self.fake.suspended:
            self.wrong.append(path)
            return httpx.Response(500, json={"error": {"message": "engine is asleep"}})
        self.arrived.set()
        if self.hold is not None:
            await self.hold.wait()
        self.served.append(path)
        name = self.fake.name
        if body.get("stream"):
            chunks = [
                f"data: {json.dumps({'model': name, 'choices': [{'text': t}]})}\n\n".encode()
                for t in ("from-", name)
            ] + [b"data: [DONE]\n\n"]
            return httpx.Response(
                200, stream=Chunks(chunks), headers={"content-type": "text/event-stream"}
            )
        return httpx.Response(200, json={"model": name, "choices": [{"text": f"from-{name}"}]})


class Chunks(httpx.AsyncByteStream):
    """A body that arrives in pieces, as vLLM's SSE does."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = chunks

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            await asyncio.sleep(0)
            yield chunk


class Router(httpx.AsyncBaseTransport):
    """One transport for every engine, dispatched by host."""

    def __init__(self, engines: dict[str, Engine]) -> None:
        self.engines = engines

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host.split(".")[0]
        return await self.engines[host].handle(request)


@dataclass
class World:
    app: FastAPI
    client: httpx.AsyncClient
    engines: dict[str, Engine]
    manager: Manager
    coordinator: SwapCoordinator
    registry: CollectorRegistry
    control_app: Any = None  # the same sidecar's control API (not started: no lifespan)
    gateway: Any = None  # the Gateway behind `app`

    def state(self, name: str) -> State:
        return self.manager.get(name).snapshot().state

    def sample(self, metric: str, **labels: str) -> float:
        value = self.registry.get_sample_value(metric, labels)
        return 0.0 if value is None else value


@asynccontextmanager
async def world(
    names: tuple[str, ...] = ("a", "b"),
    *,
    token: str | None = None,
    guard: bool = True,
    router: Callable[[dict[str, Engine]], Router] = Router,
    rpc_s: float | None = None,
    **overrides: Any,
) -> AsyncIterator[World]:
    engines = {n: Engine(FakeVllm(name=n, world_size=1)) for n in names}
    timeouts = TimeoutSettings(drain_s=2.0, shutdown_s=1.0)
    if rpc_s is not None:
        timeouts = timeouts.model_copy(update={"rpc_s": rpc_s})
    per_model: dict[str, dict[str, Any]] = overrides.pop("per_model", {})
    for n, fails in overrides.pop("fail", {}).items():
        engines[n].fake.fail.update(fails)
    for n, attrs in overrides.pop("fakes", {}).items():  # a fake's answers, set before start
        for key, value in attrs.items():
            setattr(engines[n].fake, key, value)
    settings = Settings(
        models=[
            ModelSettings(name=n, url=f"http://{n}.engine.test", **per_model.get(n, {}))
            for n in names
        ],
        auth={"token": token, "guard_gateway": guard, **overrides.pop("auth", {})},
        timeouts=timeouts,
        gateway={"enabled": True, **overrides.pop("gateway", {})},
        swap={"max_awake": 1, "min_awake_s": 0.0, **overrides.pop("swap", {})},
    )
    side = wire(settings, router(engines))
    manager, coordinator, registry = side.manager, side.swap, side.registry
    assert coordinator is not None
    assert side.gateway_app is not None
    app = side.gateway_app
    await manager.start()
    for n in names[1:]:
        await coordinator.sleep(manager.get(n))  # one awake: the budget's steady state
    if side.idle is not None:
        side.idle.start()  # the sidecar's start() does this (its tasks end with the manager)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with asgi.client(app, "http://gateway", headers) as client:
        yield World(app, client, engines, manager, coordinator, registry, side.app, side.gateway)
    await manager.stop()
    await side.tasks.aclose()


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    asyncio.run(asyncio.wait_for(body(), 20))


def completion(model: str, stream: bool = False) -> dict[str, Any]:
    return {"model": model, "prompt": "hello", "max_tokens": 4, "stream": stream}


def chat(model: str) -> dict[str, Any]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}]}


async def ask(w: World, model: str, *, stream: bool = False) -> httpx.Response:
    return await w.client.post("/v1/completions", json=completion(model, stream))
