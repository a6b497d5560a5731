"""The gateway and the swap coordinator against the real Manager over fake vLLM engines.

Each engine is a FakeVllm (control plane: pause, RPCs) plus a tiny data plane for /v1 that
answers with its own name and refuses work while paused or suspended, so a request that
reaches a sleeping engine shows up as a failure instead of passing silently.
"""

from __future__ import annotations

import asyncio
import json
import logging

import pytest
from support.fakevllm import FakeVllm
from support.gatewayworld import Engine, ask, chat, completion, run, world

from controller.errors import DrainTimeout, WakeRefused
from controller.state import State

TOKEN = "gw-token"


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
            assert "least used" in result.to_dict()["policy"]["reason"]

    run(body)


def test_the_model_asked_most_stays_awake_over_the_one_asked_last() -> None:
    """Two awake of three: a asked three times, then b once; c's wake evicts b, the least
    used, not a, the least recently used."""

    async def body() -> None:
        async with world(("a", "b", "c"), swap={"max_awake": 2}) as w:
            for name in ("a", "a", "a", "b"):
                assert (await ask(w, name)).status_code == 200
            assert [w.state(n) for n in "ab"] == [State.RUNNING] * 2
            r = await ask(w, "c")
            assert r.status_code == 200, r.text
            assert (w.state("a"), w.state("b"), w.state("c")) == (
                State.RUNNING,
                State.SUSPENDED,
                State.RUNNING,
            )

    run(body)


def test_a_wake_that_evicts_nothing_lets_the_next_wake_run_beside_it() -> None:
    """Room for all three: b's wake is stuck in its copies, c's wake is planned and served
    meanwhile (the device's lock went once b was RESUMING); then b's request is served."""

    async def body() -> None:
        async with world(("a", "b", "c"), swap={"max_awake": 3}) as w:
            gate = w.engines["b"].fake.block("hotswap_resume")
            b = asyncio.create_task(ask(w, "b"))
            await w.engines["b"].fake.entered["hotswap_resume"].wait()
            assert w.state("b") is State.RESUMING
            r = await asyncio.wait_for(ask(w, "c"), 5.0)  # the old code: behind b's wake
            assert r.status_code == 200, r.text
            assert w.state("b") is State.RESUMING
            gate.set()
            assert (await b).status_code == 200
            assert [w.state(n) for n in "abc"] == [State.RUNNING] * 3

    run(body)


def test_a_swap_lets_the_next_one_run_once_its_victim_is_asleep() -> None:
    """Two awake of three: c's wake evicts one of a and b and is stuck in its copies; the
    evicted one's next request evicts the other and is served meanwhile."""

    async def body() -> None:
        async with world(("a", "b", "c"), swap={"max_awake": 2}) as w:
            assert (await ask(w, "b")).status_code == 200
            gate = w.engines["c"].fake.block("hotswap_resume")
            c = asyncio.create_task(ask(w, "c"))
            await w.engines["c"].fake.entered["hotswap_resume"].wait()
            gone = next(n for n in "ab" if w.state(n) is State.SUSPENDED)
            r = await asyncio.wait_for(ask(w, gone), 5.0)  # the old code: behind c's wake
            assert r.status_code == 200, r.text
            assert w.state("c") is State.RESUMING
            gate.set()
            assert (await c).status_code == 200
            assert sorted(n for n in "abc" if w.state(n) is State.RUNNING) == sorted([gone, "c"])

    run(body)


def test_a_wake_that_must_evict_a_model_still_waking_waits_for_it_not_a_retry() -> None:
    """Room for one: b's wake is stuck in its copies (RESUMING, the lock gone); c's wake
    finds nothing evictable yet, waits for b to be awake, then evicts it: no refusal."""

    async def body() -> None:
        async with world(("a", "b", "c")) as w:
            await w.coordinator.sleep(w.manager.get("a"))
            gate = w.engines["b"].fake.block("hotswap_resume")
            b = asyncio.create_task(ask(w, "b"))
            await w.engines["b"].fake.entered["hotswap_resume"].wait()
            c = asyncio.create_task(ask(w, "c"))
            await asyncio.sleep(0.2)  # c's plan: b still RESUMING
            gate.set()
            assert (await b).status_code == 200
            assert (await c).status_code == 200
            assert w.sample("hotswap_swaps_total", model="c", result="held") == 0
            assert w.sample("hotswap_evictions_total", model="b", reason="lru") == 1

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
