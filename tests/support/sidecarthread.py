"""The real sidecar (the `Sidecar` that `hotswap serve` builds: its control app, and its
gateway app when the settings turn it on, served by uvicorn on loopback) in a background
thread of the test process, for tests that read its records (the other way to run it, as a
process of its own, is support.sidecar.SidecarProcess); engines kept across sidecars
(EngineHost), a /health poller, and small clients for the sidecar's API and for vLLM's
completions.

Everything talks real HTTP over 127.0.0.1, so concurrency (probes during a wake, wakes
racing each other) is what a deployment sees.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import Any

import httpx
import uvicorn

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings
from controller.engines.launcher import EngineProcess
from controller.sidecar import Sidecar
from support import oneshot
from support.metrics import metric_sum

ModelsSource = Callable[[], AbstractAsyncContextManager[list[ModelSettings]]]


def attached(models: list[ModelSettings]) -> ModelsSource:
    """A models source for engines someone else started (and stops)."""

    @contextlib.asynccontextmanager
    async def source() -> AsyncIterator[list[ModelSettings]]:
        yield models

    return source


def bound_port(server: uvicorn.Server) -> int:
    """The port a started uvicorn server listens on (it was given port 0)."""
    port: int = server.servers[0].sockets[0].getsockname()[1]
    return port


class EngineHost:
    """Keeps a models source's engines (e.g. controller.demo.demo_engines) running on a thread
    of its own until `stop()`, so several sidecars, one after the other, can attach to them
    (the engines' keepers die with the thread that started them: it outlives every sidecar)."""

    def __init__(self, models_source: ModelsSource) -> None:
        self._source = models_source
        self.models: list[ModelSettings] = []
        self.error: BaseException | None = None
        self._ready = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine-host", daemon=True)

    def _run(self) -> None:
        async def main() -> None:
            async with self._source() as models:
                self.models = list(models)
                self._ready.set()
                await asyncio.to_thread(self._stop.wait)

        try:
            asyncio.run(main())
        except BaseException as exc:
            self.error = exc
        finally:
            self._ready.set()

    def start(self, timeout_s: float = 900.0) -> EngineHost:
        self._thread.start()
        if not self._ready.wait(timeout_s):
            raise TimeoutError(f"the engines were not up after {timeout_s:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"the engines did not start: {self.error!r}")
        return self

    def stop(self, timeout_s: float = 180.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)


@dataclass(frozen=True)
class DemoPair:
    """The demo's two engines (attached, kept by an EngineHost) and each one's greedy answer
    as it booted."""

    models: dict[str, ModelSettings]
    baseline: dict[str, Completion]


def leave_awake(side: SidecarThread) -> None:
    """Wake every model `side` holds asleep, so the next sidecar over the same engines (a
    shared EngineHost) finds them as they booted: awake."""
    api = Api(side.base_url)
    for m in side.models:
        if api.state(m.name)["state"] != "RUNNING":
            r = api.wake(m.name)
            assert r.status_code == 200, r.text


class SidecarThread:
    """Runs `models_source` (e.g. controller.demo.demo_engines) and the sidecar app over the models
    it yields, in one event loop on a background thread, like `hotswap serve` does: the
    control API, and the gateway next to it when the settings turn it on."""

    def __init__(self, models_source: ModelsSource, **settings: Any) -> None:
        self._source = models_source
        # The managed engines at the test's own priority unless the test says otherwise: the
        # sidecar runs in the test process, whose session (one CPU share where the kernel
        # groups by session) holds the other lanes of a check run too, and their tests would
        # come before these engines at the default nice (supervisor.engine_nice).
        settings["supervisor"] = {"engine_nice": 0, **settings.get("supervisor", {})}
        self._settings = settings
        # Port 0: each server binds a free port itself (a port chosen free beforehand can be
        # taken before it is bound); the URLs are read back once they listen.
        self.base_url = ""
        self.gateway_url: str | None = None
        self.models: list[ModelSettings] = []
        self.ctx: Sidecar | None = None
        self.error: BaseException | None = None
        self._servers: list[uvicorn.Server] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="sidecar", daemon=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._main())
        except BaseException as exc:
            self.error = exc
        finally:
            self._done.set()

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        async with self._source() as models:
            self.models = models
            self._settings.setdefault("gateway", {})
            self._settings["gateway"] = {"port": 0, **self._settings["gateway"]}
            settings = Settings(
                models=models, server={"host": "127.0.0.1", "port": 0}, **self._settings
            )
            side = Sidecar(settings)
            settings = side.settings  # with the managed engines' sockets placed
            self.models = list(settings.models)
            apps: list[tuple[Any, int]] = [(side.app, 0)]
            if side.gateway_app is not None:
                apps.append((side.gateway_app, settings.gateway.port))
            self._servers = [
                uvicorn.Server(
                    uvicorn.Config(
                        application,
                        host="127.0.0.1",
                        port=port,
                        log_config=None,
                        log_level="warning",
                        lifespan="on",
                    )
                )
                for application, port in apps
            ]
            self.ctx = side
            await asyncio.gather(*(s.serve() for s in self._servers))

    def start(self, timeout_s: float = 600.0, booted: bool = False) -> SidecarThread:
        """Wait until every server is up and, with `booted`, the managed engines booted."""
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._up(booted):
            if self._done.is_set():
                raise RuntimeError(f"the sidecar stopped during start-up: {self.error!r}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the sidecar was not up after {timeout_s:.0f} s")
            time.sleep(0.1)
        return self

    def _up(self, booted: bool) -> bool:
        if self.ctx is None or not self._servers or not all(s.started for s in self._servers):
            return False
        if not self.ctx.started.is_set():  # the ports bind before the start-up probes end
            return False
        urls = [f"http://127.0.0.1:{bound_port(s)}" for s in self._servers]
        self.base_url = urls[0]
        self.gateway_url = urls[1] if len(urls) > 1 else None
        sup = self.ctx.supervisor
        return not booted or (sup is not None and sup.booted.is_set())

    def stop(self, timeout_s: float = 180.0) -> None:
        for s in self._servers:
            s.should_exit = True
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise TimeoutError("the sidecar thread did not stop")
        if self.error is not None:
            raise self.error

    def model(self, name: str) -> ModelSettings:
        return next(m for m in self.models if m.name == name)

    def state(self, name: str) -> str:
        """The model's state, read from the manager's memory (no HTTP)."""
        assert self.ctx is not None
        return self.ctx.manager.get(name).snapshot().state.value

    def wait_state(self, name: str, state: str, timeout_s: float = 300.0) -> None:
        """Until the model's record is in `state`: awaited on the sidecar's loop, woken by the
        record's changes (nothing polls), bounded by `timeout_s`."""
        assert self.ctx is not None
        assert self._loop is not None
        record = self.ctx.fleet[name]
        waiting = record.wait_for(lambda r: r.state.value == state, timeout_s)
        reached = asyncio.run_coroutine_threadsafe(waiting, self._loop).result(timeout_s + 10)
        if not reached:
            raise TimeoutError(f"{name} is {self.state(name)}, not {state}")


def attach(name: str, engine: EngineProcess | ModelSettings, **model: Any) -> ModelSettings:
    """The settings of a model served by `engine` (someone else's process, or a model
    attached to one, on its socket); `model`: more of its ModelSettings (e.g. fused_sleep)."""
    return ModelSettings.model_validate(
        {"name": name, "uds": str(engine.uds), "served_model_name": name, **model}
    )


@contextlib.contextmanager
def sidecar_over(
    name: str,
    engine: EngineProcess | ModelSettings,
    model: dict[str, Any] | None = None,
    **settings: Any,
) -> Iterator[Api]:
    """The sidecar attached to one running engine that serves `name`, as its API client;
    `model`: more of the model's settings; `settings` go to the sidecar's Settings (e.g.
    timeouts)."""
    model_settings = attach(name, engine, **(model or {}))
    side = SidecarThread(attached([model_settings]), **settings).start()
    try:
        yield Api(side.base_url)
    finally:
        side.stop()


@dataclass(frozen=True)
class Poll:
    sent: float  # unix seconds, the clock the manager stamps transitions with
    received: float
    status: int


class HealthPoller:
    """Polls a readiness URL every few ms in its own thread until stopped (bounded in time)."""

    def __init__(self, url: str, interval_s: float = 0.005, max_s: float = 300.0) -> None:
        self.url = url
        self.interval_s = interval_s
        self.max_s = max_s
        self.polls: list[Poll] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="health-poller", daemon=True)

    def _run(self) -> None:
        deadline = time.monotonic() + self.max_s
        with httpx.Client(timeout=5.0) as client:
            while not self._stop.is_set() and time.monotonic() < deadline:
                sent = time.time()
                try:
                    status = client.get(self.url).status_code
                except httpx.HTTPError:
                    status = 0
                self.polls.append(Poll(sent, time.time(), status))
                self._stop.wait(self.interval_s)

    def __enter__(self) -> HealthPoller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10.0)

    def between(self, start: float, end: float) -> list[Poll]:
        """Polls sent at or after `start` and answered at or before `end`."""
        return [p for p in self.polls if p.sent >= start and p.received <= end]

    def after(self, t: float) -> list[Poll]:
        return [p for p in self.polls if p.sent >= t]


class Api:
    """A thin client of the sidecar's HTTP API."""

    def __init__(self, base_url: str, timeout_s: float = 300.0) -> None:
        self.base_url = base_url
        self.timeout_s = timeout_s

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return oneshot.post(f"{self.base_url}{path}", timeout=self.timeout_s, **kw)

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return oneshot.get(f"{self.base_url}{path}", timeout=self.timeout_s, **kw)

    def sleep(self, name: str, level: int, **body: Any) -> httpx.Response:
        return self.post(f"/models/{name}/sleep", json={"level": level, **body})

    def wake(self, name: str, **params: Any) -> httpx.Response:
        return self.post(f"/models/{name}/wake", params=params)

    def state(self, name: str) -> dict[str, Any]:
        r = self.get(f"/models/{name}")
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    def wait_state(self, name: str, state: str, timeout_s: float = 120.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            body = self.state(name)
            if body["state"] == state:
                return body
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} still {body['state']} after {timeout_s:.0f} s: {body}")
            time.sleep(0.05)

    def metric(self, name: str, **labels: str) -> float:
        """The sum of the samples of `name` whose labels include `labels`."""
        return metric_sum(self.get("/metrics").text, name, **labels)

    def transitions_total(self, name: str, kind: str, result: str = "ok") -> float:
        return self.metric("hotswap_transitions_total", model=name, kind=kind, result=result)


@dataclass(frozen=True)
class Completion:
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]


PROMPT = "the quick brown fox"


Target = str | EngineProcess | ModelSettings


def http(target: Target, timeout_s: float = 120.0) -> httpx.Client:
    """A client of a URL (the sidecar, the gateway) or of an engine (a process or a model's
    settings), on its Unix socket when it has one."""
    if isinstance(target, EngineProcess):
        return target.client(timeout=timeout_s)
    if isinstance(target, ModelSettings):
        transport = httpx.HTTPTransport(uds=target.uds) if target.uds else None
        return httpx.Client(base_url=target.url, transport=transport, timeout=timeout_s)
    return httpx.Client(base_url=target, timeout=timeout_s)


def post(
    target: str | EngineProcess, path: str, timeout_s: float = 120.0, **kw: Any
) -> httpx.Response:
    """One POST to a URL or to an engine on its socket, on a connection closed after it."""
    with http(target, timeout_s) as client:
        return client.post(path, **kw)


def complete(
    target: Target,
    model: str,
    prompt: str = PROMPT,
    max_tokens: int = 8,
    timeout_s: float = 120.0,
) -> Completion:
    """A greedy completion from a vLLM server (or the gateway): token ids and logprobs."""
    with http(target, timeout_s) as client:
        r = client.post(
            "/v1/completions",
            json={
                "model": model,
                "prompt": prompt,
                "max_tokens": max_tokens,
                "temperature": 0.0,
                "ignore_eos": True,
                "logprobs": 1,
                "return_token_ids": True,
            },
        )
    r.raise_for_status()
    choice = r.json()["choices"][0]
    return Completion(tuple(choice["token_ids"]), tuple(choice["logprobs"]["token_logprobs"]))
