"""The sidecar's own start and stop (issue 28 items 7 and 10), over fake engines: the
control port binds before the start-up reconciliation and answers 503 with the reason
meanwhile; a SIGTERM's drain admits nothing new (503 + Retry-After) and lets the requests
in flight finish, within its grace, before anything is stopped."""

from __future__ import annotations

import asyncio

import httpx
import uvicorn
from support import asgi
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
    once, /livez answers, readiness answers 503 with the reason, and so do a sleep and a
    wake (NotAdmitting, with Retry-After: they answered 409); once the probe is done, 200.
    The reconciliation used to run before the bind (a long one met the startupProbe's
    limit)."""

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
                for verb in ("sleep", "wake"):  # no state change before the probes end
                    r = await client.post(f"/models/a/{verb}")
                    assert r.status_code == 503, r.text
                    assert (r.json()["reason"], r.json()["message"]) == ("starting", STARTING)
                    assert r.headers["Retry-After"]
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
            asgi.client(gw_app, "http://gateway") as gw,
            asgi.client(side.app, "http://control", lifespan=False) as control,
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
        async with asgi.client(gw_app, "http://gateway") as gw:
            first = asyncio.ensure_future(gw.post("/v1/completions", json=completion("a")))
            await asyncio.wait_for(engines["a"].arrived.wait(), 5)
            assert await side.drain(0.1) == 1  # still in flight when the grace ran out
            hold.set()
            await first
        await side.stop()

    run(body)


def test_a_draining_sidecar_refuses_sleep_and_wake_and_changes_nothing() -> None:
    """From a SIGTERM on, the control API's state changes answer 503 NotAdmitting with
    Retry-After and the reason (bad input is still judged first: 404, 422), and nothing is
    asked of an engine: the awake model stays RUNNING, the sleeping one SUSPENDED. They used to be
    accepted: a sleep ran (drained, suspended) and a wake resumed an engine the stop was
    about to take down."""

    async def body() -> None:
        engines = {
            "a": Engine(FakeVllm(name="a", world_size=1)),
            "b": Engine(FakeVllm(name="b", world_size=1).asleep()),
        }
        side = sidecar(engines, gateway={"enabled": True, "retry_after_s": 7})
        assert side.gateway_app is not None
        await side.start()
        assert side.manager.get("a").snapshot().state is State.RUNNING
        assert side.manager.get("b").snapshot().state is State.SUSPENDED
        hold = engines["a"].hold = asyncio.Event()
        gw_app = side.gateway_app
        async with (
            asgi.client(gw_app, "http://gateway") as gw,
            asgi.client(side.app, "http://control", lifespan=False) as control,
        ):
            first = asyncio.ensure_future(gw.post("/v1/completions", json=completion("a")))
            await asyncio.wait_for(engines["a"].arrived.wait(), 5)
            drain = asyncio.ensure_future(side.drain(10.0))
            await asyncio.sleep(0.05)
            assert not drain.done()  # the request in flight holds the drain open
            before = {n: len(e.fake.calls) for n, e in engines.items()}
            asks = [
                ("a", "sleep", {"json": {"level": 1, "drain": "abort"}}),
                ("a", "sleep", {"params": {"wait": "false"}}),
                ("a", "wake", {}),
                ("b", "wake", {}),
                ("b", "wake", {"params": {"wait": "false", "evict": "false"}}),
                ("b", "sleep", {"json": {"level": 2}}),
            ]
            for name, verb, kw in asks:
                r = await asyncio.wait_for(control.post(f"/models/{name}/{verb}", **kw), 5)
                assert r.status_code == 503, (name, verb, r.status_code, r.text)
                assert r.headers["Retry-After"] == "7"
                got = r.json()
                assert (got["error"], got["reason"]) == ("NotAdmitting", "shutting_down")
                assert (got["message"], got["model"]) == (STOPPING, name)
            assert side.manager.get("a").snapshot().state is State.RUNNING
            assert side.manager.get("b").snapshot().state is State.SUSPENDED
            for name, engine in engines.items():
                asked = engine.fake.calls[before[name] :]
                changes = [c for c in asked if c in ("/pause", "/resume") or "sleep" in c]
                changes += [c for c in asked if "wake" in c or "suspend" in c]
                assert not changes, (name, asked)
            judged = [  # bad input is judged first, as always
                (await control.post("/models/nobody/wake")).status_code,
                (await control.post("/models/a/sleep", json={"level": 3})).status_code,
            ]
            assert judged == [404, 422]
            reads = await control.get("/models/a")  # reads answer as always
            assert reads.status_code == 200
            hold.set()
            assert (await first).status_code == 200
            assert await asyncio.wait_for(drain, 5) == 0
            late = await control.post("/models/b/wake")  # after the drain, in the stop
            assert late.status_code == 503
        await side.stop()

    run(body)
