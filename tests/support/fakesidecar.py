"""A sidecar over fake vLLM engines (support.fakevllm.FakeVllm, each its own MockTransport),
in this process, its control API reached in memory: `make_settings` and `make_sidecar`
build it, `sidecar` runs it (its lifespan: the start-up probes) and yields a client, and
`scenario` makes an async test body a test over a fresh one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import Any

import httpx
from prometheus_client import CollectorRegistry

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings, TimeoutSettings
from controller.engines.engine import EngineClient
from controller.sidecar import Sidecar
from support import asgi
from support.fakevllm import FakeVllm


def make_settings(fakes: dict[str, FakeVllm], token: str | None = None, **models: Any) -> Settings:
    return Settings(
        models=[
            ModelSettings(name=n, url=f"http://{n}.engine.test", **models.get(n, {})) for n in fakes
        ],
        auth={"token": token},
        timeouts=TimeoutSettings(drain_s=5.0, shutdown_s=2.0),
    )


def make_sidecar(
    settings: Settings, fakes: dict[str, FakeVllm], registry: CollectorRegistry
) -> Sidecar:
    by_url = {m.url: fakes[m.name] for m in settings.models}

    def engine_factory(model: ModelSettings, timeouts: TimeoutSettings) -> EngineClient:
        return EngineClient(model.url, transport=by_url[model.url].transport(), timeouts=timeouts)

    return Sidecar(settings, registry=registry, engine_factory=engine_factory)


@asynccontextmanager
async def sidecar(
    fakes: dict[str, FakeVllm], token: str | None = None, models: dict[str, Any] | None = None
) -> AsyncIterator[httpx.AsyncClient]:
    settings = make_settings(fakes, token, **(models or {}))
    registry = CollectorRegistry()
    side = make_sidecar(settings, fakes, registry)
    app = side.app
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with asgi.client(app, "http://sidecar", headers) as client:
        await side.started.wait()  # the start-up probes run once the app serves
        yield client


Body = Callable[[httpx.AsyncClient, dict[str, FakeVllm]], Awaitable[None]]


def scenario(
    fakes: Callable[[], dict[str, FakeVllm]] | None = None,
    token: str | None = None,
    models: dict[str, Any] | None = None,
) -> Callable[[Body], Callable[[], None]]:
    """Run an async test body against a fresh sidecar over `fakes()` (default: one model "a")."""

    def wrap(body: Body) -> Callable[[], None]:
        def test() -> None:
            async def main() -> None:
                f = fakes() if fakes is not None else {"a": FakeVllm(name="a")}
                async with sidecar(f, token, models) as client:
                    await body(client, f)

            asyncio.run(main())

        test.__name__ = body.__name__
        test.__doc__ = body.__doc__
        return test

    return wrap
