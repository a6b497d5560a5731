"""An app of the sidecar's in a test, two ways: in memory (`client`: its lifespan run, an
httpx client over httpx.ASGITransport) or on a real uvicorn server on a loopback port the
server binds itself (`served`: port 0, read back once it listens)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator, Mapping
from typing import Any

import httpx
import uvicorn

from controller.config.settings import Settings
from controller.server import uvicorn_config
from support.wait import until


@contextlib.asynccontextmanager
async def client(
    app: Any,
    base_url: str = "http://sidecar",
    headers: Mapping[str, str] | None = None,
    *,
    lifespan: bool = True,
) -> AsyncIterator[httpx.AsyncClient]:
    """An httpx client of `app` in memory, inside its lifespan (lifespan=False: the app's
    start-up and shut-down are the test's own). An exception the app raises reaches the
    test (httpx's raise_app_exceptions)."""
    async with contextlib.AsyncExitStack() as stack:
        if lifespan:
            await stack.enter_async_context(app.router.lifespan_context(app))
        transport = httpx.ASGITransport(app=app)
        yield await stack.enter_async_context(
            httpx.AsyncClient(transport=transport, base_url=base_url, headers=headers)
        )


class _Server(uvicorn.Server):
    """uvicorn without its signal handlers: the test owns the process's signals."""

    def install_signal_handlers(self) -> None:
        pass

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


@contextlib.asynccontextmanager
async def served(
    app: Any,
    *,
    lifespan: str = "on",
    settings: Settings | None = None,
    start_s: float = 10.0,
    control: bool = False,
) -> AsyncIterator[int]:
    """`app` on a real uvicorn server on a loopback port; yields the port. With `settings`,
    configured as `hotswap serve` configures it (its protocol and connection limits; the
    control port's with `control`)."""
    if settings is None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, lifespan=lifespan, log_config=None)
    else:
        config = uvicorn_config(app, settings, "127.0.0.1", 0, control=control)
        config.lifespan = lifespan
    server = _Server(config)
    task = asyncio.create_task(server.serve())
    try:
        await until(lambda: server.started or task.done(), timeout_s=start_s, recheck_s=0.01)
        assert server.started, "uvicorn did not start"
        yield server.servers[0].sockets[0].getsockname()[1]
    finally:
        server.should_exit = True
        await task
