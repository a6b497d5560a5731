"""`hotswap serve`'s runtime: the Sidecar's two apps on uvicorn, signals, the demo directory.

uvicorn's split is the model: settings (controller.config.settings) are the config, this module
the server, controller.cli the command line. The control API's lifespan starts and stops
the Sidecar; the gateway, when enabled, is served next to it on its own port and follows it.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import math
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from starlette.types import ASGIApp

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings
from controller.errors import EXIT_OK, EXIT_STARTUP, CliError
from controller.http.connlimits import protocol
from controller.sidecar import Sidecar

log = logging.getLogger("hotswap.server")


class _Server(uvicorn.Server):
    """uvicorn's server, except that a signal first drains, then only sets the exit flag.

    uvicorn re-raises a captured SIGTERM after serving, which would kill the process before
    the demo engines are stopped; here the caller shuts everything down and picks the code.
    The first SIGTERM or SIGINT runs `drain` (the sidecar admits nothing new and lets the
    requests in flight finish, bounded) while both ports still answer, and only then asks
    the servers to exit; a second signal exits at once.
    """

    def __init__(
        self, config: uvicorn.Config, drain: Callable[[], Awaitable[object]] | None = None
    ) -> None:
        super().__init__(config)
        self.signals: list[int] = []
        self._drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can only be handled on the main thread
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals.append(sig)
        first = len(self.signals) == 1
        if not first or self._drain is None or self._loop is None or not self.started:
            super().handle_exit(sig, frame)
            return
        # A signal handler: the drain is scheduled on the loop, not run here.
        self._loop.call_soon_threadsafe(self._begin_drain, sig, frame)

    def _begin_drain(self, sig: int, frame: FrameType | None) -> None:
        async def drain_then_exit() -> None:
            try:
                assert self._drain is not None
                await self._drain()
            except Exception:
                log.exception("the drain at shutdown failed")
            finally:
                super(_Server, self).handle_exit(sig, frame)

        self._draining = asyncio.ensure_future(drain_then_exit())


class _GatewayServer(uvicorn.Server):
    """The gateway's server: it follows the control API's, which alone handles signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def uvicorn_config(
    app: ASGIApp,
    settings: Settings,
    host: str,
    port: int,
    *,
    control: bool = False,
    **extra: Any,
) -> uvicorn.Config:
    """One port's uvicorn config: the connection limits of `server.*` (the head deadline and
    the cap on head-less connections by controller.http.connlimits, the rest uvicorn's). On
    the control port (`control`) the protocol answers `GET /livez` itself, unless the
    probes are to be logged (`log.probe_access`: then the app answers and the access log
    has it)."""
    limits = settings.server
    http = protocol(
        limits.header_timeout_s,
        limits.keep_alive_s,
        limits.max_unauthenticated,
        answers_livez=control and not settings.log.probe_access,
    )
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_config=None,  # our root handler formats uvicorn's lines too
        lifespan="on",
        timeout_graceful_shutdown=math.ceil(settings.timeouts.shutdown_s),
        timeout_keep_alive=math.ceil(limits.keep_alive_s),
        limit_concurrency=limits.max_connections,
        http=http,
        **extra,
    )


def settle_heap() -> int:
    """Collect once, then move every object alive now (the imported modules, the apps, the
    settings: what the process keeps for good) out of the cyclic collector's reach
    (`gc.freeze`). A full collection walked them all, holding the event loop for tens of
    milliseconds of CPU each time (up to 72 ms in the soak's loop profile); now it walks
    only what was made since. Returns how many objects were frozen."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def run_server(settings: Settings) -> int:
    """Serve until a signal; the app's lifespan starts and stops the manager (and, in
    managed mode, the engines). With the gateway on, it is served next to it, on its port."""
    side = Sidecar(settings)
    frozen = settle_heap()  # the process's long-lived objects are built: before serving
    log.debug("%d start-up objects frozen out of the garbage collector's full passes", frozen)
    app = side.app
    gateway: _GatewayServer | None = None
    if side.gateway_app is not None:
        gw_app = side.gateway_app
        gateway = _GatewayServer(
            uvicorn_config(gw_app, settings, settings.gateway.host, settings.gateway.port)
        )
    config = uvicorn_config(app, settings, settings.server.host, settings.server.port, control=True)
    server = _Server(config, drain=side.drain)
    if gateway is None:
        await server.serve()
    else:
        gw_task = asyncio.create_task(_serve_gateway(gateway, server), name="hotswap-gateway")
        try:
            await server.serve()
        finally:
            gateway.should_exit = True
            await gw_task
        if not gateway.started:
            return EXIT_STARTUP
    if server.signals:
        return 128 + server.signals[0]  # the shell's convention for "ended by signal N"
    return EXIT_OK if server.started else EXIT_STARTUP


async def _serve_gateway(gateway: uvicorn.Server, control: uvicorn.Server) -> None:
    """Run the gateway; if it cannot start (port taken), stop the control API too."""
    try:
        await gateway.serve()
    except (SystemExit, OSError) as exc:  # uvicorn exits when it cannot bind
        log.error("the gateway did not start: %s", exc)
    if not gateway.started:
        control.should_exit = True


def demo_settings(settings: Settings, models: list[ModelSettings], workdir: Path) -> Settings:
    """The embedded default: managed engines behind the gateway, a budget of one awake
    model (unless one is configured), engine logs in the demo's work dir."""
    data = settings.model_dump()
    data["models"] = [m.model_dump(exclude_unset=True) for m in models]
    if settings.swap.budget_bytes is None and settings.swap.max_awake is None:
        data["swap"]["max_awake"] = 1
    if settings.supervisor.log_dir is None:
        data["supervisor"]["log_dir"] = workdir / "logs"
    return Settings.model_validate(data)


async def serve(settings: Settings, demo: bool, demo_dir: Path | None) -> int:
    if not demo:
        return await run_server(settings)
    try:
        from controller.demo import demo_models  # only for --demo
    except ImportError as exc:
        raise CliError(f"--demo needs controller.demo, which is not available: {exc}") from exc
    own = demo_dir is None
    workdir = Path(tempfile.mkdtemp(prefix="hotswap-demo-")) if demo_dir is None else demo_dir
    try:
        models = await demo_models(workdir)
        return await run_server(demo_settings(settings, models, workdir))
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)
