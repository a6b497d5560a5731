"""The sidecar's own start and stop (issue 28 items 7 and 10), over fake engines: the
control port binds before the start-up reconciliation and answers 503 with the reason
meanwhile; a SIGTERM's drain admits nothing new (503 + Retry-After) and lets the requests
in flight finish, within its grace, before anything is stopped."""

from __future__ import annotations

import asyncio

import httpx
import uvicorn
from support.fakevllm import FakeVllm, wire
from support.gatewayworld import Engine, Router, completion, run

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings, TimeoutSettings
from controller.lifecycle import STARTING, STOPPING
from controller.sidecar import Sidecar
from controller.state import State


def sidecar(engines: dict[str, Engine], **settings: object) -> Sidecar:
    return wire(
        Settings(
            models=[
                ModelSettings(name=n, url=f"http://{n}.engine.test")  # type: ignore[call-arg]
                for n in engines
            ],
            server={"host": "127.0.0.1", "port": 0},  # type: ignore[arg-type]
            timeouts=TimeoutSettings(drain_s=2.0, shutdown_s=1.0),
            **settings,  # type: ignore[arg-type]
        ),
        Router(engines),
    )


def test_the_control_port_binds_before_the_start_up_reconciliation() -> None:
    """An engine that takes its time to answer the start-up probe: the port is bound at
    once, /livez answers, readiness answers 503 with the reason; once the probe is done,
    200. The reconciliation used to run before the bind (a long one met the
    startupProbe's limit)."""

    async def body() -> None:
        engines = {"a": Engine(FakeVllm(name="a", world_size=1))}
        probe = engines["a"].fake.block("/health")
        side = sidecar(engines)
        server = uvicorn.Server(
            uvicorn.Config(side.app, host="127.0.0.1", port=0, lifespan="on", log_config=None)
        )
        serving = asyncio.create_task(server.serve())
        try:
            for _ in range(250):
                if server.started:
                    break
                await asyncio.sleep(0.02)
            assert server.started, "the port was not bound during the start-up probe"
            port = server.servers[0].sockets[0].getsockname()[1]
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client:
                assert (await client.get("/livez")).status_code == 200
                for path in ("/health", "/models/a/health"):
                    r = await client.get(path)
                    assert r.status_code == 503
                    assert r.json()["reason"] == STARTING
                assert not side.started.is_set()
                probe.set()
                await asyncio.wait_for(side.started.wait(), 5)
                r = await client.get("/health")
                assert r.status_code == 200, r.text
                assert "reason" not in r.json()
        finally:
            probe.set()
            server.should_exit = True
            await serving

    run(body)


def test_a_drain_admits_nothing_new_and_lets_the_requests_in_flight_finish() -> None:
    """SIGTERM's first step: a new request is refused 503 with Retry-After (it used to be
    accepted, then fail once the engines were stopped), readiness says why, and the request
    in flight ends with its answer before the drain returns."""

    async def body() -> None:
        engines = {"a": Engine(FakeVllm(name="a", world_size=1))}
        side = sidecar(engines, gateway={"enabled": True})
        assert side.gateway_app is not None
        await side.start()
        assert side.manager.get("a").snapshot().state is State.RUNNING
        hold = engines["a"].hold = asyncio.Event()
        gw_app = side.gateway_app
        async with (
            gw_app.router.lifespan_context(gw_app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=gw_app), base_url="http://gateway"
            ) as gw,
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=side.app), base_url="http://control"
            ) as control,
        ):
            first = asyncio.ensure_future(gw.post("/v1/completions", json=completion("a")))
            await asyncio.wait_for(engines["a"].arrived.wait(), 5)
            drain = asyncio.ensure_future(side.drain(10.0))
            await asyncio.sleep(0.05)
            assert not drain.done()
            second = await gw.post("/v1/completions", json=completion("a"))
            assert second.status_code == 503
            assert second.headers["Retry-After"]
            assert second.json()["error"]["reason"] == "shutting_down"
            health = await control.get("/health")
            assert (health.status_code, health.json()["reason"]) == (503, STOPPING)
            hold.set()
            answer = await first
            assert answer.status_code == 200
            assert answer.json()["choices"][0]["text"] == "from-a"
            assert await asyncio.wait_for(drain, 5) == 0
        await side.stop()

    run(body)


def test_a_drain_is_bounded_by_its_grace() -> None:
    async def body() -> None:
        engines = {"a": Engine(FakeVllm(name="a", world_size=1))}
        side = sidecar(engines, gateway={"enabled": True})
        assert side.gateway_app is not None
        await side.start()
        hold = engines["a"].hold = asyncio.Event()
        gw_app = side.gateway_app
        async with (
            gw_app.router.lifespan_context(gw_app),
            httpx.AsyncClient(
                transport=httpx.ASGITransport(app=gw_app), base_url="http://gateway"
            ) as gw,
        ):
            first = asyncio.ensure_future(gw.post("/v1/completions", json=completion("a")))
            await asyncio.wait_for(engines["a"].arrived.wait(), 5)
            assert await side.drain(0.1) == 1  # still in flight when the grace ran out
            hold.set()
            await first
        await side.stop()

    run(body)
