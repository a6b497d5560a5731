"""The gateway and the swap coordinator against the real Manager over fake vLLM engines.

Each engine is a FakeVllm (control plane: pause, RPCs) plus a tiny data plane for /v1 that
answers with its own name and refuses work while paused or suspended, so a request that
reaches a sleeping engine shows up as a failure instead of passing silently.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from fakevllm import FakeVllm, wire
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings, TimeoutSettings
from controller.errors import DrainTimeout, WakeRefused
from controller.fleet.swap import SwapCoordinator
from controller.models.manager import Manager
from controller.state import State

TOKEN = "gw-token"


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
    async with (
        app.router.lifespan_context(app),
        httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app), base_url="http://gateway", headers=headers
        ) as client,
    ):
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


def test_alternating_requests_swap_and_answer_from_the_right_model() -> None:
    async def body() -> None:
        async with world() as w:
            order = ["a", "b", "a", "b", "b", "a"]
            for i, name in enumerate(order):
                if i % 2:
                    r = await w.client.post("/v1/chat/completions", json=chat(name))
                else:
                    r = await ask(w, name)
                assert r.status_code == 200, r.text
                assert r.json()["model"] == name
                awake = [n for n in ("a", "b") if w.state(n) is State.RUNNING]
                assert awake == [name]
            for e in w.engines.values():
                assert e.wrong == []
            # a was awake at the start: every change of model in `order` is one swap.
            assert w.sample("hotswap_swaps_total", model="b", result="ok") == 2
            assert w.sample("hotswap_swaps_total", model="a", result="ok") == 2
            assert w.sample("hotswap_evictions_total", model="a", reason="lru") == 2
            assert w.sample("hotswap_gateway_requests_total", model="a", code="200") == 3
            assert w.sample("hotswap_swap_duration_seconds_count", model="b") == 2
            assert w.sample("hotswap_gateway_hold_seconds_count", model="b") == 2

    run(body)


def test_streaming_is_passed_through() -> None:
    async def body() -> None:
        async with world() as w:
            r = await ask(w, "b", stream=True)
            assert r.status_code == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            events = [line for line in r.text.split("\n\n") if line]
            assert events[-1] == "data: [DONE]"
            texts = [json.loads(e[len("data: ") :])["choices"][0]["text"] for e in events[:-1]]
            assert "".join(texts) == "from-b"
            assert w.manager.fleet["b"].lane.in_flight == 0

    run(body)


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("POST", "/collective_rpc"),
        ("POST", "/sleep"),
        ("POST", "/wake_up"),
        ("POST", "/pause"),
        ("POST", "/resume"),
        ("GET", "/is_sleeping"),
        ("GET", "/metrics"),
        ("POST", "/v1/../collective_rpc"),
        ("POST", "/models/a/sleep"),
        ("GET", "/health"),
    ],
)
def test_no_dev_endpoint_is_reachable(method: str, path: str) -> None:
    async def body() -> None:
        async with world() as w:
            before = {n: list(e.fake.calls) for n, e in w.engines.items()}
            r = await w.client.request(method, path, json={"method": "hotswap_info"})
            assert r.status_code == 404, r.text
            assert r.json()["error"]["code"] == 404
            assert {n: list(e.fake.calls) for n, e in w.engines.items()} == before

    run(body)


def test_wrong_method_is_not_forwarded() -> None:
    async def body() -> None:
        async with world() as w:
            r = await w.client.get("/v1/completions")
            assert r.status_code == 405

    run(body)


def test_models_lists_every_model_with_its_state() -> None:
    async def body() -> None:
        async with world() as w:
            r = await w.client.get("/v1/models")
            data = {m["id"]: m["state"] for m in r.json()["data"]}
            assert data == {"a": "RUNNING", "b": "SUSPENDED"}

    run(body)


def test_unknown_model_and_bad_bodies() -> None:
    async def body() -> None:
        async with world() as w:
            r = await ask(w, "nope")
            assert r.status_code == 404
            assert r.json()["error"]["reason"] == "unknown_model"
            assert w.sample("hotswap_gateway_refused_total", model="", reason="unknown_model") == 1
            r = await w.client.post("/v1/completions", content=b"not json")
            assert r.status_code == 400
            r = await w.client.post("/v1/completions", json={"prompt": "x"})
            assert r.status_code == 400

    run(body)


@pytest.mark.parametrize(("guard", "expected"), [(True, 401), (False, 200)])
def test_token_guards_the_gateway_when_configured(guard: bool, expected: int) -> None:
    async def body() -> None:
        async with world(token=TOKEN, guard=guard) as w:
            r = await w.client.post(
                "/v1/completions", json=completion("a"), headers={"Authorization": "Bearer no"}
            )
            assert r.status_code == expected
            if expected == 401:
                # Refused from the headers alone: the body (and its model) is never read.
                assert w.sample("hotswap_gateway_refused_total", model="", reason="unauthorized")
                assert (
                    await w.client.get("/v1/models", headers={"Authorization": ""})
                ).status_code == 401
            r = await ask(w, "a")  # the right token
            assert r.status_code == 200

    run(body)


def test_a_full_queue_answers_429_and_the_held_requests_are_served() -> None:
    async def body() -> None:
        async with world(gateway={"queue_size": 2}) as w:
            gate = w.engines["b"].fake.block("hotswap_resume")
            tasks = [asyncio.create_task(ask(w, "b")) for _ in range(5)]
            await w.engines["b"].fake.entered["hotswap_resume"].wait()
            assert w.sample("hotswap_gateway_queue_depth", model="b") == 2
            gate.set()
            codes = sorted(r.status_code for r in await asyncio.gather(*tasks))
            assert codes == [200, 200, 429, 429, 429]
            assert w.sample("hotswap_gateway_refused_total", model="b", reason="queue_full") == 3
            assert w.sample("hotswap_gateway_queue_depth", model="b") == 0
            assert w.engines["b"].served == ["/v1/completions"] * 2

    run(body)


def test_an_engine_that_does_not_answer_is_503_with_retry_after() -> None:
    """The engine died under a RUNNING model (before the supervisor saw it): the forwarded
    request is refused with Retry-After, so a client retries instead of losing it."""

    async def body() -> None:
        async with world() as w:
            w.engines["a"].died = True
            r = await ask(w, "a")
            assert r.status_code == 503
            assert r.headers["retry-after"] == "5"
            assert r.json()["error"]["reason"] == "engine_unavailable"
            assert (
                w.sample("hotswap_gateway_refused_total", model="a", reason="engine_unavailable")
                == 1
            )
            assert w.manager.fleet["a"].lane.in_flight == 0

    run(body)


def test_a_failed_wake_answers_503_with_retry_after() -> None:
    async def body() -> None:
        async with world(gateway={"hold_timeout_s": 0.5}) as w:
            w.engines["b"].fake.fail["hotswap_restore_and_verify"] = "mismatch"
            r = await ask(w, "b")
            assert r.status_code == 503
            assert r.headers["retry-after"] == "5"
            assert r.json()["error"]["reason"] == "wake_failed"
            assert w.state("b") is State.FAILED
            assert w.sample("hotswap_swaps_total", model="b", result="failed") == 1
            # FAILED stays refused at once (the supervisor restarts managed engines).
            r = await ask(w, "b")
            assert r.status_code == 503
            assert w.sample("hotswap_gateway_refused_total", model="b", reason="wake_failed") == 2
            # a was evicted for b. A FAILED engine's process may still hold its memory, so a
            # waits (and is refused with Retry-After) until that process is known to be gone.
            r = await ask(w, "a")
            assert r.status_code == 503
            assert r.json()["error"]["reason"] == "wake_timeout"
            assert "retry-after" in r.headers
            w.coordinator.engine_gone = lambda rec: rec.name == "b"
            await asyncio.sleep(1.1)  # the refusal's own Retry-After (a busy peer: 1 s)
            assert (await ask(w, "a")).status_code == 200

    run(body)


def test_a_wake_that_outlasts_the_hold_answers_503_wake_timeout() -> None:
    async def body() -> None:
        async with world(gateway={"hold_timeout_s": 0.3}) as w:
            gate = w.engines["b"].fake.block("hotswap_resume")
            r = await ask(w, "b")
            assert r.status_code == 503
            assert r.json()["error"]["reason"] == "wake_timeout"
            assert "retry-after" in r.headers
            gate.set()
            for _ in range(100):
                if w.state("b") is State.RUNNING:
                    break
                await asyncio.sleep(0.02)
            assert (await ask(w, "b")).status_code == 200  # the wake itself went on

    run(body)


def test_evict_false_refuses_with_the_reason() -> None:
    async def body() -> None:
        async with world() as w:
            with pytest.raises(WakeRefused) as info:
                await w.coordinator.wake(w.manager.get("b"), evict=False)
            assert "evict=false" in info.value.message
            assert info.value.plan["evict"] == ["a"]
            assert info.value.to_dict()["plan"]["decision"] == "refuse"
            assert w.state("a") is State.RUNNING
            assert w.state("b") is State.SUSPENDED
            result = await w.coordinator.wake(w.manager.get("b"))
            assert result.plan.decision.value == "evict"
            assert result.evicted == ("a",)
            assert "LRU" in result.to_dict()["policy"]["reason"]

    run(body)


def test_eviction_waits_for_requests_in_flight_and_holds_new_ones() -> None:
    async def body() -> None:
        async with world() as w:
            a = w.engines["a"]
            a.hold = asyncio.Event()
            slow = asyncio.create_task(ask(w, "a"))
            await a.arrived.wait()
            for_b = asyncio.create_task(ask(w, "b"))
            for _ in range(50):
                if w.manager.fleet["a"].lane.closed:
                    break
                await asyncio.sleep(0.01)
            assert w.manager.fleet["a"].lane.closed
            late_a = asyncio.create_task(ask(w, "a"))  # must be held, not forwarded
            await asyncio.sleep(0.1)
            assert w.state("a") is State.RUNNING  # still draining the slow request
            assert not for_b.done()
            assert not late_a.done()
            a.hold.set()
            r = await slow
            assert r.status_code == 200
            assert r.json()["model"] == "a"
            assert (await for_b).json()["model"] == "b"
            assert (await late_a).json()["model"] == "a"
            assert a.wrong == []
            assert w.engines["b"].wrong == []

    run(body)


def test_drain_wait_timeout_keeps_the_model_running_and_admitting() -> None:
    async def body() -> None:
        async with world() as w:
            a = w.engines["a"]
            a.hold = asyncio.Event()
            slow = asyncio.create_task(ask(w, "a"))
            await a.arrived.wait()
            with pytest.raises(DrainTimeout):
                await w.coordinator.sleep(w.manager.get("a"), drain="wait", drain_timeout_s=0.1)
            assert w.state("a") is State.RUNNING
            assert not w.manager.fleet["a"].lane.closed
            a.hold.set()
            assert (await slow).status_code == 200

    run(body)


def test_min_awake_time_holds_the_request_until_the_swap_may_happen(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A wake held by min_awake_s is not a refusal: counted `held`, one INFO line a try
    (the reason), no warning, and the request then succeeds."""

    async def body() -> None:
        async with world(swap={"min_awake_s": 0.5}) as w:
            await w.coordinator.sleep(w.manager.get("a"))
            await w.coordinator.wake(w.manager.get("a"))  # a is fresh now
            loop = asyncio.get_running_loop()
            t0 = loop.time()
            r = await ask(w, "b")
            held = loop.time() - t0
            assert r.status_code == 200
            assert r.json()["model"] == "b"
            assert held >= 0.4
            tries = w.sample("hotswap_swaps_total", model="b", result="held")
            assert tries >= 1
            assert w.sample("hotswap_swaps_total", model="b", result="refused") == 0
            assert w.sample("hotswap_swaps_total", model="b", result="ok") == 1
            lines = [r for r in caplog.records if "held" in r.getMessage()]
            assert [r.levelno for r in lines] == [logging.INFO] * int(tries), lines
            assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    caplog.set_level(logging.INFO)
    run(body)


def test_a_past_failed_wake_does_not_fail_a_later_request() -> None:
    async def body() -> None:
        async with world() as w:
            w.engines["b"].fake.fail["hotswap_restore_and_verify"] = "mismatch"
            assert (await ask(w, "b")).status_code == 503
            assert (await ask(w, "b")).status_code == 503  # FAILED: refused at once
            # The engine is back (what a restart does): a fresh engine, probed asleep.
            w.engines["b"] = Engine(FakeVllm(name="b", world_size=1, started_at=2e9).asleep(1))
            await w.manager.get("b").probe()
            assert w.state("b") is State.SUSPENDED
            r = await ask(w, "b")
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "b"

    run(body)
