"""EngineClient against httpx.MockTransport: request shapes, error translation, reconnects."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from controller.config.settings import TimeoutSettings
from controller.engines.engine import EngineClient, RankError
from controller.errors import EngineError, EngineTimeout, EngineUnavailable

Handler = Callable[[httpx.Request], httpx.Response]


class Recorder:
    """A MockTransport handler that records requests and which connection (client) sent them."""

    def __init__(self, answer: Handler) -> None:
        self.answer = answer
        self.requests: list[httpx.Request] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.answer(request)


def engine(handler: Handler, **timeouts: float) -> EngineClient:
    return EngineClient(
        "http://engine:8000/",
        transport=httpx.MockTransport(handler),
        timeouts=TimeoutSettings(**timeouts),  # type: ignore[arg-type]
    )


def ok_ranks(n: int = 2, **extra: Any) -> httpx.Response:
    return httpx.Response(
        200, json={"results": [{"ok": True, "rank": r, **extra} for r in range(n)]}
    )


@pytest.mark.anyio
async def test_rpc_body_has_method_args_kwargs_and_never_timeout() -> None:
    rec = Recorder(lambda r: ok_ranks(2, barrier_s=0.001, late_ranks=[]))
    e = engine(rec)
    ranks = await e.rpc("hotswap_quiesce", 7.5, timeout_s=3.0, extra="x")
    assert [r["rank"] for r in ranks] == [0, 1]
    (req,) = rec.requests
    assert req.method == "POST"
    assert req.url.path == "/collective_rpc"
    body = json.loads(req.content)
    assert body == {"method": "hotswap_quiesce", "args": [7.5], "kwargs": {"extra": "x"}}
    assert "timeout" not in body
    # The HTTP client timeout carries the budget instead.
    assert req.extensions["timeout"]["read"] == 3.0
    await e.aclose()


@pytest.mark.anyio
async def test_rpc_rank_not_ok_keeps_every_rank_report() -> None:
    def answer(r: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            json={
                "results": [
                    {"ok": True, "rank": 0},
                    {"ok": False, "rank": 1, "error": "boom on rank 1"},
                ]
            },
        )

    e = engine(answer)
    with pytest.raises(RankError) as info:
        await e.rpc("hotswap_prepare", 1, timeout_s=1.0)
    assert "boom on rank 1" in info.value.message
    assert [r["rank"] for r in info.value.ranks] == [0, 1]
    assert [r["rank"] for r in info.value.failed] == [1]
    assert info.value.status == 502
    await e.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "body",
    [
        {"result": []},  # wrong key
        {"results": []},  # no rank answered
        {"results": ["True"]},  # vLLM str()-ed a non-dict return value
        {"results": [{"ok": True}, None]},
        [1, 2],
    ],
)
async def test_rpc_bad_bodies_are_engine_errors(body: Any) -> None:
    e = engine(lambda r: httpx.Response(200, json=body))
    with pytest.raises(EngineError) as info:
        await e.rpc("hotswap_info", timeout_s=1.0)
    assert not isinstance(info.value, RankError)
    await e.aclose()


@pytest.mark.anyio
async def test_rpc_body_not_json_is_engine_error() -> None:
    e = engine(lambda r: httpx.Response(200, text="<html>"))
    with pytest.raises(EngineError, match="not JSON"):
        await e.rpc("hotswap_info", timeout_s=1.0)
    await e.aclose()


@pytest.mark.anyio
async def test_5xx_is_engine_error_and_the_next_call_uses_a_new_connection() -> None:
    clients: list[int] = []
    answers = [
        httpx.Response(
            500, json={"error": {"message": "Call to collective_rpc method failed: x", "code": 500}}
        ),
        httpx.Response(200, json={"is_paused": True}),
    ]
    e = engine(lambda r: answers.pop(0))
    clients.append(id(e._client))
    with pytest.raises(EngineError, match="HTTP 500: Call to collective_rpc method failed") as info:
        await e.rpc("hotswap_suspend", 1, timeout_s=1.0)
    assert type(info.value) is EngineError
    clients.append(id(e._client))
    assert await e.is_paused() is True
    assert e.connections_dropped == 1
    assert clients[0] != clients[1]
    await e.aclose()


@pytest.mark.anyio
async def test_4xx_is_engine_error_without_dropping_the_connection() -> None:
    e = engine(lambda r: httpx.Response(404, json={"detail": "Not Found"}))
    with pytest.raises(EngineError, match="HTTP 404: Not Found"):
        await e.resume()
    assert e.connections_dropped == 0
    await e.aclose()


@pytest.mark.anyio
async def test_timeout_is_engine_timeout_with_a_new_connection() -> None:
    def answer(r: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=r)

    e = engine(answer)
    with pytest.raises(EngineTimeout, match="within 2 s") as info:
        await e.rpc("hotswap_suspend", 1, timeout_s=2.0)
    assert isinstance(info.value.__cause__, httpx.ReadTimeout)
    assert info.value.status == 504
    assert e.connections_dropped == 1
    await e.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(
    "exc_type", [httpx.ConnectError, httpx.ReadError, httpx.RemoteProtocolError]
)
async def test_transport_errors_are_engine_unavailable(
    exc_type: type[httpx.TransportError],
) -> None:
    def answer(r: httpx.Request) -> httpx.Response:
        raise exc_type("nope", request=r)

    e = engine(answer)
    with pytest.raises(EngineUnavailable) as info:
        await e.health()
    assert isinstance(info.value.__cause__, exc_type)
    assert e.connections_dropped == 1
    await e.aclose()


@pytest.mark.anyio
async def test_injected_client_is_replaced_after_an_error_but_not_closed() -> None:
    calls: list[str] = []

    def answer(r: httpx.Request) -> httpx.Response:
        calls.append(r.url.path)
        return httpx.Response(503) if len(calls) == 1 else httpx.Response(200)

    transport = httpx.MockTransport(answer)
    own = httpx.AsyncClient(base_url="http://engine:8000", transport=transport)
    e = EngineClient("http://engine:8000", own, transport=transport, timeouts=TimeoutSettings())
    assert await e.health() is False  # 503: vLLM's dead engine
    assert await e.health() is True
    assert e._client is not own
    assert not own.is_closed
    await e.aclose()
    assert not own.is_closed
    await own.aclose()


@pytest.mark.anyio
async def test_pause_resume_flags_and_timeouts() -> None:
    rec = Recorder(
        lambda r: httpx.Response(
            200,
            json={
                "/pause": {"status": "paused"},
                "/resume": {"status": "resumed"},
                "/is_paused": {"is_paused": False},
            }[r.url.path],
        )
    )
    e = engine(rec, control_s=4.0)
    await e.pause("wait", timeout_s=12.0)
    await e.pause("abort")
    await e.resume()
    assert await e.is_paused() is False
    wait, abort, resume = rec.requests[:3]
    assert dict(wait.url.params) == {"mode": "wait", "clear_cache": "true"}
    assert wait.extensions["timeout"]["read"] == 12.0
    assert dict(abort.url.params) == {"mode": "abort", "clear_cache": "true"}
    assert abort.extensions["timeout"]["read"] == 4.0
    assert resume.method == "POST"
    assert resume.url.path == "/resume"
    with pytest.raises(ValueError, match="mode"):
        await e.pause("sideways")  # type: ignore[arg-type]
    await e.aclose()


@pytest.mark.anyio
async def test_flag_with_a_bad_body_is_engine_error() -> None:
    e = engine(lambda r: httpx.Response(200, json={"is_paused": "yes"}))
    with pytest.raises(EngineError, match="is_paused"):
        await e.is_paused()
    await e.aclose()


@pytest.mark.anyio
async def test_warmup_sends_one_greedy_token_as_token_ids_to_the_served_model() -> None:
    def answer(r: httpx.Request) -> httpx.Response:
        if r.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "tiny"}]})
        return httpx.Response(200, json={"choices": [{"text": "", "finish_reason": "length"}]})

    rec = Recorder(answer)
    e = engine(rec, warmup_s=9.0)
    seconds = await e.warmup()
    assert seconds >= 0
    models, completion = rec.requests
    assert models.url.path == "/v1/models"
    body = json.loads(completion.content)
    assert body["model"] == "tiny"
    assert body["max_tokens"] == 1
    assert body["temperature"] == 0
    assert isinstance(body["prompt"], list)
    assert all(isinstance(t, int) for t in body["prompt"])
    assert completion.extensions["timeout"]["read"] == 9.0
    # A named model skips /v1/models.
    await e.warmup("named")
    assert [r.url.path for r in rec.requests[2:]] == ["/v1/completions"]
    await e.aclose()


@pytest.mark.anyio
async def test_warmup_without_choices_is_engine_error() -> None:
    e = engine(lambda r: httpx.Response(200, json={"choices": []}))
    with pytest.raises(EngineError, match="warm-up"):
        await e.warmup("m")
    await e.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("raised", "status", "may_desync"),
    [
        (httpx.ConnectError, None, False),  # nothing was delivered
        (httpx.ConnectTimeout, None, False),
        (httpx.ReadTimeout, None, True),  # sent, no answer: a reply may still come
        (httpx.ReadError, None, True),
        (httpx.RemoteProtocolError, None, True),
        (None, 500, True),  # the executor raised: its reply queues may be out of step
        (None, 400, False),  # refused whole
    ],
)
async def test_which_failures_may_leave_the_queues_out_of_step(
    raised: type[httpx.TransportError] | None, status: int | None, may_desync: bool
) -> None:
    def answer(r: httpx.Request) -> httpx.Response:
        if raised is not None:
            raise raised("nope", request=r)
        return httpx.Response(status or 200, json={"detail": "x"})

    e = engine(answer)
    with pytest.raises(EngineError) as info:
        await e.rpc("hotswap_info", timeout_s=2.0)
    assert info.value.may_desync is may_desync
    await e.aclose()


@pytest.mark.anyio
async def test_a_rank_that_answers_not_ok_leaves_the_queues_in_step() -> None:
    e = engine(lambda r: httpx.Response(200, json={"results": [{"ok": True}, {"ok": False}]}))
    with pytest.raises(RankError) as info:
        await e.rpc("hotswap_prepare", 1, timeout_s=2.0)
    assert info.value.may_desync is False
    await e.aclose()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("text", "sign"),
    [
        ("# HELP x\nprocess_start_time_seconds 1.79611398164e+09\nvllm:x 1\n", "1796113981.64"),
        ("vllm:num_requests_running 0\n", None),
        ("process_start_time_seconds nan-ish\n", None),
    ],
)
async def test_process_start_is_read_from_metrics_without_an_rpc(
    text: str, sign: str | None
) -> None:
    rec = Recorder(lambda r: httpx.Response(200, text=text))
    e = engine(rec)
    assert await e.process_start() == sign
    assert [r.url.path for r in rec.requests] == ["/metrics"]
    await e.aclose()


@pytest.mark.anyio
async def test_an_idle_connection_is_not_reused_as_the_engine_closes_it() -> None:
    """vLLM's server closes a connection idle for 5 s. A call that reuses one just then meets
    "Server disconnected without sending a response" (a /resume failed so in a long swap
    run). This server closes a connection that was idle for 1.5 s when the next request
    arrives on it, without an answer: the client must have dropped it by then."""
    idle_close_s = 1.5

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        loop = asyncio.get_running_loop()
        last = loop.time()
        try:
            while await reader.readuntil(b"\r\n\r\n"):
                if loop.time() - last >= idle_close_s:
                    break  # closed as the request crossed it: no answer
                body = b'{"is_paused": false}'
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
                    b"content-length: %d\r\n\r\n%s" % (len(body), body)
                )
                await writer.drain()
                last = loop.time()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    client = EngineClient(f"http://127.0.0.1:{port}", timeouts=TimeoutSettings())
    try:
        assert await client.is_paused() is False
        await asyncio.sleep(idle_close_s + 1.0)  # idle past the server's limit
        assert await client.is_paused() is False
    finally:
        await client.aclose()
        server.close()
        await server.wait_closed()


@pytest.mark.anyio
async def test_a_new_connection_pool_does_not_hold_the_event_loop() -> None:
    """After a 5xx or a transport error the client opens a new pool: that used to build a
    TLS context too (the CA bundle loaded, 20-50 ms of CPU on the event loop, at every
    dropped connection, also to a plain-HTTP or socket engine). Now one context serves the
    process: a drop costs well under a millisecond of the loop's CPU."""
    e = EngineClient("http://127.0.0.1:9", timeouts=TimeoutSettings())  # its own pool
    costs = []
    for _ in range(5):
        t0 = time.thread_time()
        await e._drop_connection()
        costs.append(time.thread_time() - t0)
    assert e.connections_dropped == 5
    assert max(costs) < 0.005, [round(c * 1000, 1) for c in costs]
    await e.aclose()
