"""Issue 13's hostile inputs, each as a named test: both apps on real uvicorn servers (raw
sockets where the bytes on the wire matter) or in-process, over fake engines.

Auth before any body byte, bounded bodies (413 on Content-Length and on the streamed count),
bounded JSON nesting (400), a total cap on the gateway's requests at once, no slash
redirects, docs off, a start refused on an open bind without a token, a configured token
checked and stripped, numeric inputs bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import json
import logging
import time
from collections.abc import Coroutine, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from pydantic import BaseModel, ValidationError
from starlette.types import ASGIApp
from support import asgi
from support.asgi import served
from support.fakesidecar import make_settings, make_sidecar
from support.fakevllm import FakeVllm
from support.gatewayworld import completion, world

from controller import cli
from controller.config.settings import Settings
from controller.observe.logs import RateLimit
from controller.state import State

TOKEN = "hostile-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BIG = 200 << 20  # the 200 MiB body


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


async def raw(
    port: int, head: bytes, chunks: list[bytes] | None = None, timeout_s: float = 5.0
) -> tuple[int, bytes]:
    """Send a hand-made request (headers, then body pieces as the server takes them) and read
    the answer until the server closes; (status, whole answer). A server that waits for a
    body it will not get fails the test by the timeout."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head)
        await writer.drain()
        for chunk in chunks or []:
            if reader.at_eof():
                break
            try:
                writer.write(chunk)
                await writer.drain()
            except ConnectionError:
                break  # answered and closed mid-body: what a refusal does
        data = await asyncio.wait_for(_read_all(reader), timeout_s)
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()
    status = int(data.split(b" ", 2)[1])
    return status, data


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    data = b""
    with contextlib.suppress(ConnectionError):
        while chunk := await reader.read(65536):
            data += chunk
    return data


def head(path: str, *, token: str | None, length: int | None, host: str = "t") -> bytes:
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}", "Content-Type: application/json"]
    lines.append("Connection: close")  # the answer ends with the connection
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    lines.append(
        f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"
    )
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def chunked(total: int, size: int = 16 << 10) -> list[bytes]:
    piece = b"[" * size
    return [b"%x\r\n%s\r\n" % (size, piece) for _ in range(total // size)] + [b"0\r\n\r\n"]


def control_app(token: str | None = TOKEN, **server: Any) -> ASGIApp:
    fakes = {"a": FakeVllm(name="a")}
    settings = make_settings(fakes, token)
    if server:
        settings = Settings.model_validate(
            {**settings.model_dump(), "server": {**settings.server.model_dump(), **server}}
        )
    registry = CollectorRegistry()
    return make_sidecar(settings, fakes, registry).app


# ----------------------------------------------------------------------------- auth first


def test_control_api_refuses_a_tokenless_body_before_reading_it() -> None:
    """The issue: a 200 MiB body without a token was read and parsed (RSS to ~457 MiB),
    answered 422 before 401. Now 401 comes from the headers alone: nothing is sent."""

    async def body() -> None:
        async with served(control_app()) as port:
            status, answer = await raw(port, head("/models/a/sleep", token=None, length=BIG))
            assert status == 401, answer
            status, _ = await raw(port, head("/models/a/sleep", token="wrong", length=BIG))
            assert status == 401

    run(body())


def test_gateway_refuses_a_tokenless_body_before_reading_it() -> None:
    async def body() -> None:
        async with world(token=TOKEN) as w, served(w.app, lifespan="off") as port:
            status, answer = await raw(port, head("/v1/completions", token=None, length=BIG))
            assert status == 401, answer
            assert b'"reason":"unauthorized"' in answer
            assert w.sample("hotswap_gateway_refused_total", model="", reason="unauthorized")

    run(body())


# ----------------------------------------------------------------------------- body caps


def test_a_body_over_the_cap_answers_413_on_its_content_length() -> None:
    async def body() -> None:
        async with served(control_app()) as port:
            status, answer = await raw(port, head("/models/a/sleep", token=TOKEN, length=BIG))
            assert status == 413, answer
        async with world(token=TOKEN) as w, served(w.app, lifespan="off") as port:
            status, answer = await raw(port, head("/v1/completions", token=TOKEN, length=BIG))
            assert status == 413, answer

    run(body())


def test_a_chunked_body_answers_413_once_its_count_passes_the_cap() -> None:
    """No Content-Length to refuse on: the streamed count is the limit (64 KiB for control)."""

    async def body() -> None:
        async with served(control_app()) as port:
            status, answer = await raw(
                port, head("/models/a/sleep", token=TOKEN, length=None), chunked(1 << 20)
            )
            assert status == 413, answer
        gateway = {"max_body_bytes": 64 << 10}
        async with world(token=TOKEN, gateway=gateway) as w, served(w.app, lifespan="off") as p:
            status, answer = await raw(
                p, head("/v1/completions", token=TOKEN, length=None), chunked(1 << 20)
            )
            assert status == 413, answer

    run(body())


def test_a_body_within_the_cap_still_passes() -> None:
    async def body() -> None:
        async with world(token=TOKEN) as w:
            long_prompt = {**completion("a"), "prompt": "x" * (2 << 20)}  # 2 MiB < 4 MiB
            r = await w.client.post("/v1/completions", json=long_prompt, headers=AUTH)
            assert r.status_code == 200, r.text

    run(body())


# ----------------------------------------------------------------------------- JSON depth


def test_deeply_nested_json_answers_400_on_both_apps() -> None:
    """The issue: `[` x 200000 gave 502 "internal error" and a logged traceback."""
    deep = b"[" * 200_000

    async def body() -> None:
        async with world(token=TOKEN) as w:
            r = await w.client.post("/v1/completions", content=deep, headers=AUTH)
            assert r.status_code == 400, r.text
            assert "deeper than 64" in r.json()["error"]["message"]
            # Brackets inside strings are text: a prompt full of them is fine.
            text = {**completion("a"), "prompt": "[" * 10_000}
            r = await w.client.post("/v1/completions", json=text, headers=AUTH)
            assert r.status_code == 200, r.text
        within = deep[:60_000]  # within the control API's 64 KiB
        app = control_app()
        async with asgi.client(app, "http://c") as c:
            r = await c.post("/models/a/sleep", content=within)
            assert r.status_code == 401, r.text  # auth first, even here
            r = await c.post("/models/a/sleep", content=within, headers=AUTH)
            assert r.status_code == 400, r.text
            assert "deeper than 16" in r.json()["message"]
            nested = b'{"level": 1, "x": ' + b"[" * 20 + b"]" * 20 + b"}"
            r = await c.post("/models/a/sleep", content=nested, headers=AUTH)
            assert r.status_code == 400, r.text

    run(body())


# ----------------------------------------------------------------------------- loop holds

MAX_HOLD_S = 0.050  # the bound: no request holds the event loop for longer
CONTROL_CAP = 64 << 10
GATEWAY_CAP = 4 << 20


def _fill(prefix: bytes, unit: bytes, suffix: bytes, cap: int) -> bytes:
    """`prefix + unit * n + suffix`, as long as fits in `cap` bytes."""
    return prefix + unit * ((cap - len(prefix) - len(suffix)) // len(unit)) + suffix


def adversarial_bodies(cap: int, model: str = "nope") -> dict[str, bytes]:
    """Bodies at `cap` that cost a checker the most per byte: structure everywhere, escaped
    quotes (the issue's 40 KB body that held the loop 13.6 s is the first), members."""
    head = b'{"model": "%s", "prompt": ' % model.encode()
    return {
        "escaped_quotes": _fill(b"[" * 65, b'\\"', b"", cap),
        "nested_groups": _fill(head + b"[", b"[" * 14 + b"]" * 14 + b",", b"[]]}", cap),
        "empty_lists": _fill(head + b"[", b"[],", b"[]]}", cap),
        "empty_strings": _fill(head + b"[", b'"",', b'""]}', cap),
        "members": _fill(b'{"model": "%s", ' % model.encode(), b'"a":1,', b'"b":1}', cap),
    }


async def longest_hold(request: Coroutine[Any, Any, httpx.Response]) -> tuple[float, int]:
    """Run `request` beside a ticker; the most CPU the loop spent between two ticks (time
    other tasks held it; thread CPU, so a busy machine's preemption does not count), and
    the answer's status."""
    holds: list[float] = []
    done = asyncio.Event()

    async def tick() -> None:
        last = time.thread_time()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.thread_time()
            holds.append(now - last)
            last = now

    ticker = asyncio.create_task(tick())
    await asyncio.sleep(0)  # the ticker takes its first reading before the request starts
    try:
        answer = await asyncio.create_task(request)
    finally:
        done.set()
        await ticker
    return max(holds, default=0.0), answer.status_code


@pytest.mark.parametrize("kind", list(adversarial_bodies(1024)))
def test_no_control_body_at_its_cap_holds_the_event_loop(kind: str) -> None:
    """The issue: a 40 KB body (escaped quotes after 65 brackets) held the control API's loop
    for 13.6 s: the nesting pre-check was quadratic on it. Now every body at the cap
    (64 KiB) is checked in slices, none holding the loop past the bound."""
    body = adversarial_bodies(CONTROL_CAP)[kind]

    async def run_it() -> None:
        app = control_app()
        async with asgi.client(app, "http://c") as c:
            held, status = await longest_hold(c.post("/models/a/sleep", content=body, headers=AUTH))
            assert 400 <= status < 500, status
            assert held <= MAX_HOLD_S, f"{kind}: the loop was held {held * 1000:.0f} ms"

    asyncio.run(run_it())


@pytest.mark.parametrize("kind", list(adversarial_bodies(1024)))
def test_no_gateway_body_at_its_cap_holds_the_event_loop(kind: str) -> None:
    """At the gateway's cap (4 MiB) too: the nesting check and what the gateway reads of the
    body (`model`, `stream`) hold the loop for at most the bound, whatever the body. The
    model is unknown, so nothing is forwarded: the time is all the gateway's own."""
    body = adversarial_bodies(GATEWAY_CAP)[kind]
    assert len(body) <= GATEWAY_CAP

    async def run_it() -> None:
        async with world(token=TOKEN) as w:
            held, status = await longest_hold(
                w.client.post("/v1/completions", content=body, headers=AUTH)
            )
            assert status in (400, 404), status
            assert held <= MAX_HOLD_S, f"{kind}: the loop was held {held * 1000:.0f} ms"

    asyncio.run(asyncio.wait_for(run_it(), 120))


# ----------------------------------------------------------------------------- types


@pytest.mark.parametrize(
    "bad", [{"stream": "true"}, {"stream": 1}, {"stream": ""}, {"model": 7}, {"model": ["a"]}]
)
def test_a_value_the_gateway_reads_of_the_wrong_type_answers_400(bad: dict[str, Any]) -> None:
    """The issue: `"stream": "true"` or `1` was forwarded (vLLM streams) while the gateway
    buffered the answer as non-streaming, so a disconnect no longer aborted generation."""

    async def body() -> None:
        async with world() as w:
            r = await w.client.post("/v1/completions", json={**completion("a"), **bad})
            assert r.status_code == 400, r.text
            assert r.json()["error"]["type"] == "BadRequestError"
            assert w.engines["a"].served == [], "nothing reached the engine"
            for ok in (True, False, None):
                r = await w.client.post("/v1/completions", json={**completion("a"), "stream": ok})
                assert r.status_code == 200, (ok, r.text)

    run(body())


# ----------------------------------------------------------------------------- disconnects


def _gone_request(port: int) -> bytes:
    body = json.dumps(completion("b")).encode()
    lines = [
        "POST /v1/completions HTTP/1.1",
        "Host: t",
        "Content-Type: application/json",
        f"Content-Length: {len(body)}",
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def _connect_and_close(port: int) -> None:
    """A client that sends a whole request and leaves at once."""
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_gone_request(port))
    await writer.drain()
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()


def test_a_held_request_whose_client_left_gives_its_slot_back_and_wakes_nothing() -> None:
    """The issue: four clients that connect and close filled the queue (the fifth, live one
    got 429), and a model was then evicted for nobody."""
    swap = {"min_awake_s": 2.0}  # `a` was just woken: `b` waits this long for its turn

    async def body() -> None:
        async with (
            world(gateway={"queue_size": 4}, swap=swap) as w,
            served(w.app, lifespan="off") as port,
        ):
            await w.coordinator.wake(
                w.manager.get("a")
            )  # woken now: b's wake must wait min_awake_s
            await asyncio.gather(*(_connect_and_close(port) for _ in range(4)))
            await asyncio.sleep(0.2)  # they arrive and are held (old: for good)
            for _ in range(80):  # each held request notices its client's departure
                if w.sample("hotswap_gateway_queue_depth", model="b") == 0:
                    break
                await asyncio.sleep(0.01)
            assert w.sample("hotswap_gateway_queue_depth", model="b") == 0, "slots kept"
            assert w.sample("hotswap_gateway_refused_total", model="b", reason="client_gone") == 4
            await asyncio.sleep(2.2)  # past min_awake_s: a wake for them would run now
            assert w.state("b") is State.SUSPENDED, "a model was woken for nobody"
            assert w.state("a") is State.RUNNING, "a model was evicted for nobody"
            # A live client now: its request is held, then served (not 429).
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                r = await c.post("/v1/completions", json=completion("b"), timeout=10)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == "b"

    run(body())


# ----------------------------------------------------------------------------- concurrency


def test_the_gateway_caps_its_requests_at_once_over_all_models() -> None:
    async def body() -> None:
        async with world(gateway={"max_concurrent": 2}, swap={"max_awake": 2}) as w:
            await w.coordinator.wake(w.manager.get("b"))
            hold = asyncio.Event()
            for e in w.engines.values():
                e.hold = hold
            first = asyncio.create_task(w.client.post("/v1/completions", json=completion("a")))
            second = asyncio.create_task(w.client.post("/v1/completions", json=completion("b")))
            for e in w.engines.values():
                await asyncio.wait_for(e.arrived.wait(), 5)
            r = await w.client.post("/v1/completions", json=completion("a"))
            assert r.status_code == 429, r.text
            assert r.headers["retry-after"] == "1"
            assert w.sample("hotswap_gateway_refused_total", model="", reason="too_many_requests")
            hold.set()
            assert (await first).status_code == 200
            assert (await second).status_code == 200
            r = await w.client.post("/v1/completions", json=completion("a"))
            assert r.status_code == 200, "the slots came back"

    run(body())


def test_a_request_that_finds_the_cap_full_is_refused_before_its_body_is_read() -> None:
    """With every slot taken, a new request is answered 429 + Retry-After from its head:
    its body (here 4 MiB announced, none sent) is neither waited for nor read and scanned.
    It used to be read and scanned whole, then refused: under the soak's load most of the
    gateway's CPU went to 4 MiB bodies refused 429 that way."""

    async def body() -> None:
        async with (
            world(gateway={"max_concurrent": 2}, swap={"max_awake": 2}) as w,
            served(w.app, lifespan="off") as port,
        ):
            await w.coordinator.wake(w.manager.get("b"))
            hold = asyncio.Event()
            for e in w.engines.values():
                e.hold = hold
            first = asyncio.create_task(w.client.post("/v1/completions", json=completion("a")))
            second = asyncio.create_task(w.client.post("/v1/completions", json=completion("b")))
            for e in w.engines.values():
                await asyncio.wait_for(e.arrived.wait(), 5)
            status, answer = await raw(port, head("/v1/completions", token=None, length=4 << 20))
            assert status == 429, answer
            assert b"retry-after: 1" in answer.lower()
            hold.set()
            assert (await first).status_code == 200
            assert (await second).status_code == 200

    run(body())


# ----------------------------------------------------------------------------- slow clients


def limited(**server: Any) -> tuple[ASGIApp, Settings]:
    """The control app and its settings, with `server` limits on top."""
    fakes = {"a": FakeVllm(name="a")}
    base = make_settings(fakes, TOKEN)
    settings = Settings.model_validate(
        {**base.model_dump(), "server": {**base.server.model_dump(), **server}}
    )
    return make_sidecar(settings, fakes, CollectorRegistry()).app, settings


async def closed_within(reader: asyncio.StreamReader, timeout_s: float) -> bytes:
    """What the server sent before it closed the connection (a timeout: it did not)."""
    return await asyncio.wait_for(_read_all(reader), timeout_s)


def test_a_head_sent_too_slowly_is_closed() -> None:
    """The issue: a half-sent request stayed open for good. Now a connection that has not
    sent a whole head within server.header_timeout_s is closed."""

    async def body() -> None:
        app, settings = limited(header_timeout_s=0.5)
        async with served(app, settings=settings) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /models/a/sleep HTTP/1.1\r\nHost: t\r\n")  # and no more
            await writer.drain()
            assert await closed_within(reader, 5) == b""
            writer.close()
            # A whole request on a new connection is still served.
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                assert (await c.get("/livez")).status_code == 200

    run(body())


def _get_head(pad: int) -> bytes:
    """A GET /livez head of 16 KiB + `pad` bytes (negative: that much under)."""
    start = b"GET /livez HTTP/1.1\r\nHost: t\r\nConnection: close\r\nX-Pad: "
    size = (16 << 10) + pad - len(start) - 4
    return start + b"p" * size + b"\r\n\r\n"


@pytest.mark.parametrize("pieces", [1, 64], ids=["one-write", "in-pieces"])
def test_a_request_head_over_16_kib_is_refused_and_closed(pieces: int) -> None:
    """A request head is held to 16 KiB (h11's cap, which httptools does not have): one
    byte under is served; one byte over answers 431 and closes, sent at once or in pieces;
    a 1 MiB head is cut off (the 431 may be lost to the reset of a close with unread bytes),
    and in pieces the connection closes before the client has sent it all."""

    async def send(port: int, data: bytes) -> tuple[bytes, int]:
        """(what the server answered before it closed, the bytes the client got to send)."""
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        step, sent = -(-len(data) // pieces), 0
        try:
            for i in range(0, len(data), step):
                if reader.at_eof() or writer.is_closing():
                    break
                try:
                    writer.write(data[i : i + step])
                    await writer.drain()
                except ConnectionError:
                    break
                sent = i + step
                await asyncio.sleep(0.002 if pieces > 1 else 0)
            return await closed_within(reader, 5), sent
        finally:
            writer.close()

    async def body() -> None:
        app, settings = limited()
        async with served(app, settings=settings) as port:
            answer, _ = await send(port, _get_head(-1))
            assert answer.startswith(b"HTTP/1.1 200"), answer[:100]
            answer, _ = await send(port, _get_head(1))
            assert answer.startswith(b"HTTP/1.1 431"), answer[:100]
            assert answer.endswith(b"Request header fields too large"), answer[-100:]
            answer, sent = await send(port, _get_head(1 << 20))
            assert answer == b"" or answer.startswith(b"HTTP/1.1 431"), answer[:100]
            if pieces > 1:
                assert sent < (1 << 20), "the server read a 1 MiB head whole"
            # The server still serves.
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                assert (await c.get("/livez")).status_code == 200

    run(body())


def test_a_head_after_a_body_on_one_connection_gets_its_own_16_kib() -> None:
    """Keep-alive: the head count starts again with each request, and a body's bytes are
    not a head's (a 60 KiB body sent with its head in one write is no head over 16 KiB)."""

    async def body() -> None:
        app, settings = limited()
        async with served(app, settings=settings) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            payload = b'{"level": 1, "pad": "' + b"x" * (60 << 10) + b'"}'
            first = (
                b"POST /models/a/sleep HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer %s\r\nContent-Length: %d\r\n\r\n%s"
                % (TOKEN.encode(), len(payload), payload)
            )
            writer.write(first)
            await writer.drain()
            line = await asyncio.wait_for(reader.readline(), 5)
            assert not line.startswith(b"HTTP/1.1 431"), line
            while (await asyncio.wait_for(reader.readline(), 5)) != b"\r\n":
                pass  # the rest of the first answer's head
            writer.write(_get_head(-1))  # ends with Connection: close
            await writer.drain()
            rest = await closed_within(reader, 5)
            assert b"HTTP/1.1 200" in rest, rest[-300:]
            writer.close()

    run(body())


def test_livez_is_answered_by_the_control_ports_protocol_without_the_app() -> None:
    """`GET /livez` on the control port is answered as its head is parsed, with the control
    API's own body: no request task, no middleware, no place in the loop's queue behind the
    requests in flight. Anything else (a query string, HEAD, the gateway's port, or
    `log.probe_access` on, so that the access log has the probes) goes to the app."""
    app = control_app()
    seen: list[str] = []

    async def counting(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            seen.append(f"{scope['method']} {scope['path']}?{scope['query_string'].decode()}")
        await app(scope, receive, send)

    def get(target: str, method: str = "GET") -> bytes:
        return f"{method} {target} HTTP/1.1\r\nhost: k\r\nconnection: close\r\n\r\n".encode()

    def body_of(answer: bytes) -> bytes:
        return answer.split(b"\r\n\r\n", 1)[1]

    async def body() -> None:
        async with served(counting, settings=Settings(), control=True) as port:
            status, fast = await raw(port, get("/livez"))
            assert (status, seen) == (200, [])
            assert b"content-type: application/json" in fast
            # kept alive and sent nothing more: still answered, and closed
            status, _ = await raw(port, b"GET /livez HTTP/1.1\r\nhost: k\r\n\r\n")
            assert (status, seen) == (200, [])
            status, slow = await raw(port, get("/livez?x=1"))
            assert (status, seen) == (200, ["GET /livez?x=1"])
            assert body_of(fast) == body_of(slow) == b'{"status":"ok"}'
            status, _ = await raw(port, get("/livez", "HEAD"))
            assert seen[-1] == "HEAD /livez?"
        seen.clear()
        logged = Settings.model_validate({"log": {"probe_access": True}})
        async with served(counting, settings=logged, control=True) as port:
            assert (await raw(port, get("/livez")))[0] == 200
        async with served(counting, settings=Settings()) as port:  # not the control port
            assert (await raw(port, get("/livez")))[0] == 200
        assert seen == ["GET /livez?", "GET /livez?"]

    run(body())


def test_a_body_sent_too_slowly_answers_408() -> None:
    async def body() -> None:
        app, settings = limited(body_timeout_s=0.5)
        async with served(app, settings=settings) as port:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(head("/models/a/sleep", token=TOKEN, length=100) + b'{"level"')
            await writer.drain()
            answer = await closed_within(reader, 5)
            assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
            writer.close()

    run(body())


def test_connections_waiting_for_a_head_are_capped() -> None:
    """The issue: 140 idle connections used up a 128-fd limit. Now at most
    server.max_unauthenticated connections may wait for their first head; one more is
    closed at once, and a whole request still gets through once they go."""

    async def body() -> None:
        app, settings = limited(max_unauthenticated=4, header_timeout_s=30)
        async with served(app, settings=settings) as port:
            idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(4)]
            await asyncio.sleep(0.2)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            assert await closed_within(reader, 5) == b"", "a fifth idle connection was kept"
            writer.close()
            for _, w in idle:
                w.close()
            await asyncio.sleep(0.2)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                assert (await c.get("/livez")).status_code == 200

    run(body())


def test_half_sent_bodies_hold_no_gateway_slot() -> None:
    """The issue: 4 half-sent gateway bodies held all max_concurrent slots (the 5th request
    got 429). A slot is now taken once a body is whole."""

    async def body() -> None:
        async with (
            world(gateway={"max_concurrent": 2}) as w,
            served(w.app, lifespan="off") as port,
        ):
            writers = []
            for _ in range(4):
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(head("/v1/completions", token=None, length=1000) + b'{"model"')
                await writer.drain()
                writers.append(writer)
            await asyncio.sleep(0.3)
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as c:
                r = await c.post("/v1/completions", json=completion("a"), timeout=10)
            assert r.status_code == 200, r.text
            for writer in writers:
                writer.close()

    run(body())


def test_a_flood_of_one_log_line_is_rate_limited() -> None:
    """The issue: out of file descriptors, the accept loop logged 102k errors (46 MB) in
    8 s. At most log.max_repeats_per_minute lines of one message get through a minute; the
    next one after says how many were dropped."""
    now = [0.0]
    records: list[str] = []
    logger = logging.getLogger("hotswap.test.flood")
    logger.propagate = False
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())  # type: ignore[method-assign]
    logger.addHandler(handler)
    logger.addFilter(RateLimit(10, clock=lambda: now[0]))
    for _ in range(100_000):
        logger.error("socket.accept() out of system resource")
    logger.error("another message")
    assert len(records) == 11
    now[0] = 61.0
    logger.error("socket.accept() out of system resource")
    assert records[-1].endswith("(99990 more like it dropped)"), records[-1]
    assert "asyncio" in logging.getLogger("asyncio").name  # the accept loop's logger


# ----------------------------------------------------------------------------- tokens

GATEWAY_TOKEN = "gateway-only-token"


def test_a_gateway_token_opens_the_gateway_and_never_the_control_api() -> None:
    """The issue: one token for inference and control, so any client that may infer could
    sleep or audit models. With gateway tokens set, each app takes only its own."""

    async def body() -> None:
        auth = {"gateway_tokens": ["other-client", GATEWAY_TOKEN]}
        async with world(token=TOKEN, auth=auth) as w:
            assert w.manager.settings.auth.gateway_tokens is not None
            control = w.control_app
            bearer = {"Authorization": f"Bearer {GATEWAY_TOKEN}"}
            async with asgi.client(control, "http://c", lifespan=False) as c:
                for method, path in (
                    ("GET", "/models"),
                    ("GET", "/models/a/audit"),
                    ("POST", "/models/a/sleep"),
                    ("POST", "/models/a/wake"),
                ):
                    r = await c.request(method, path, headers=bearer)
                    assert r.status_code == 401, (path, r.text)
                assert (await c.get("/models", headers=AUTH)).status_code == 200
            r = await w.client.post("/v1/completions", json=completion("a"), headers=bearer)
            assert r.status_code == 200, r.text
            r = await w.client.post("/v1/completions", json=completion("a"), headers=AUTH)
            assert r.status_code == 401, "the control token no longer opens the gateway"
            assert w.state("a") is State.RUNNING

    run(body())


def test_the_token_is_checked_once_per_request(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 27: auth ran twice per request (a middleware and a dependency, in both apps).
    Now the guard is each app's one check: one comparison per token per request."""
    compared: list[bytes] = []
    real = hmac.compare_digest

    def counting(a: Any, b: Any) -> bool:
        compared.append(b)
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", counting)

    async def body() -> None:
        async with world(token=TOKEN) as w:
            async with asgi.client(w.control_app, "http://c", lifespan=False) as c:
                compared.clear()
                assert (await c.get("/models", headers=AUTH)).status_code == 200
                assert len(compared) == 1, compared
            compared.clear()
            r = await w.client.post("/v1/completions", json=completion("a"), headers=AUTH)
            assert r.status_code == 200, r.text
            assert len(compared) == 1, compared
            compared.clear()
            assert (await w.client.get("/v1/models", headers=AUTH)).status_code == 200
            assert len(compared) == 1, compared

    run(body())


def test_a_token_on_the_command_line_warns(caplog: pytest.LogCaptureFixture) -> None:
    """`--token` shows in `ps`: it still works, with a warning that names the way out."""
    args = cli.build_parser().parse_args(["serve", "--token", "argv-token"])
    with caplog.at_level("WARNING"):
        settings = cli.settings_from_args(args)
    assert settings.auth.token is not None
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("--token" in m and "ps" in m and "token-file" in m for m in warned), warned
    assert not any("argv-token" in m for m in warned), "the warning must not echo the token"


class _Boom(httpx.AsyncBaseTransport):
    """An engine transport that fails: a bug (RuntimeError) or an unreachable socket."""

    def __init__(self, error: Exception) -> None:
        self.error = error

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path.startswith("/v1/"):
            raise self.error
        return httpx.Response(404)


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (RuntimeError("secret detail: /run/private/engine.sock"), 502),
        (httpx.ConnectError("[Errno 2] No such file: /run/private/engine.sock"), 503),
    ],
)
def test_an_error_body_carries_no_internal_text(error: Exception, status: int) -> None:
    """The issue: a 502 answered `internal error: RuntimeError: <the exception's text>` (and a
    503 the transport error's, with the engine's socket path) to any client."""

    async def body() -> None:
        async with world() as w:
            side_router = _Boom(error)
            for client in w.gateway.clients.values():
                client._transport = side_router
            r = await w.client.post("/v1/completions", json=completion("a"))
            assert r.status_code == status, r.text
            assert "/run/private" not in r.text
            assert "secret" not in r.text

    run(body())


def test_a_forward_whose_client_left_is_cancelled() -> None:
    """The issue: a forwarded request whose client disconnected ran on until the engine
    answered (up to request_timeout_s, 600 s), holding a drain for as long. Now the forward
    is cancelled at once and the model's count of requests in flight drops."""

    async def body() -> None:
        async with world() as w, served(w.app, lifespan="off") as port:
            hold = asyncio.Event()
            w.engines["a"].hold = hold  # the engine never answers until told
            payload = json.dumps(completion("a")).encode()
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            lines = [
                "POST /v1/completions HTTP/1.1",
                "Host: t",
                "Content-Type: application/json",
                f"Content-Length: {len(payload)}",
            ]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
            await writer.drain()
            await asyncio.wait_for(w.engines["a"].arrived.wait(), 5)
            lane = w.manager.get("a").record.lane
            assert lane.in_flight == 1
            writer.close()  # the client leaves
            for _ in range(300):
                if lane.in_flight == 0:
                    break
                await asyncio.sleep(0.01)
            assert lane.in_flight == 0, "the forward ran on after its client left"
            assert w.sample("hotswap_gateway_refused_total", model="a", reason="client_gone")
            sleep = w.coordinator.sleep(w.manager.get("a"))
            outcome = await asyncio.wait_for(sleep, 5)  # nothing in flight: drains at once
            assert outcome is not None
            assert w.state("a") is State.SUSPENDED
            hold.set()

    run(body())


# ----------------------------------------------------------------------------- safe defaults


def test_no_slash_redirect_on_either_app() -> None:
    """The issue: `POST /v1/completions/` with `Host: evil.example` answered 307 to
    http://evil.example/... before any auth, on both apps."""

    async def body() -> None:
        async with served(control_app(token=None)) as port:
            status, answer = await raw(
                port, head("/models/a/sleep/", token=None, length=2, host="evil.example"), [b"{}"]
            )
            assert status == 404, answer
            assert b"evil.example" not in answer
        async with world() as w, served(w.app, lifespan="off") as port:
            status, answer = await raw(
                port, head("/v1/completions/", token=None, length=2, host="evil.example"), [b"{}"]
            )
            assert status == 404, answer
            assert b"evil.example" not in answer

    run(body())


@pytest.mark.parametrize("path", ["/docs", "/redoc", "/openapi.json"])
def test_docs_routes_are_off_unless_enabled(path: str) -> None:
    async def body() -> None:
        for docs, expected in ((False, 404), (True, 200)):
            app = control_app(token=None, docs=docs)
            async with asgi.client(app, "http://c", lifespan=False) as c:
                r = await c.get(path)
                assert r.status_code == expected, (docs, r.text[:200])

    run(body())


@pytest.mark.parametrize(
    ("argv", "env"),
    [
        (["serve", "--host", "0.0.0.0"], {}),
        (["serve"], {"HOTSWAP_SERVER__HOST": "0.0.0.0"}),
        (["serve"], {"HOTSWAP_GATEWAY__ENABLED": "1", "HOTSWAP_GATEWAY__HOST": "::"}),
    ],
)
def test_an_open_bind_without_a_token_refuses_to_start(
    argv: list[str],
    env: dict[str, str],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The issue: `hotswap serve --host 0.0.0.0` without a token started, and sleep, wake and
    audit answered anyone. Now it stops at once, saying why in one line."""
    started: list[Settings] = []

    async def fake_serve(settings: Settings, demo: bool, demo_dir: Path | None) -> int:
        started.append(settings)
        return 0

    monkeypatch.setattr(cli, "serve", fake_serve)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    assert cli.main(argv) == cli.EXIT_USAGE
    assert not started
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert "without a token" in err
    assert "--insecure" in err
    # The two ways to start anyway: a token, or saying so.
    assert cli.main([*argv, "--insecure"]) == 0
    assert cli.main([*argv, "--token", "t0ken"]) == 0
    assert len(started) == 2
    assert started[0].server.insecure


# ----------------------------------------------------------------------------- the token


def test_a_secret_with_a_trailing_newline_still_lets_the_token_in(tmp_path: Path) -> None:
    """The issue: the presented token was stripped, the configured one was not, so a Secret
    file ending in a newline locked everyone out."""
    secret = tmp_path / "token"
    secret.write_text(f"{TOKEN}\n")

    async def body() -> None:
        for auth in ({"token": f"{TOKEN}\n"}, {"token_file": str(secret)}):
            fakes = {"a": FakeVllm(name="a")}
            settings = Settings.model_validate(
                {**make_settings(fakes).model_dump(exclude={"auth"}), "auth": auth}
            )
            registry = CollectorRegistry()
            app = make_sidecar(settings, fakes, registry).app
            async with asgi.client(app, "http://c") as c:
                r = await c.get("/models", headers=AUTH)
                assert r.status_code == 200, (auth, r.text)

    run(body())


@pytest.mark.parametrize("token", ["", "  \n", "to ken", "tok\x00en", "tok\x7fen", "tøken"])
def test_a_bad_configured_token_is_refused_at_start(token: str) -> None:
    with pytest.raises(ValidationError) as err:
        Settings(auth={"token": token})
    assert repr(token) not in str(err.value)  # the error never echoes it


# ----------------------------------------------------------------------------- bounds


def test_drain_timeout_has_an_upper_bound() -> None:
    """The issue: 1e308 was accepted, and admission stayed closed for ever."""

    async def body() -> None:
        app = control_app(token=None)
        async with asgi.client(app, "http://c") as c:
            for value in (1e308, 3600.5):
                r = await c.post("/models/a/sleep", json={"drain_timeout_s": value})
                assert r.status_code == 422, r.text
                assert "drain_timeout_s" in r.json()["message"]

    run(body())


@pytest.mark.parametrize("action", ["wake", "sleep"])
def test_wait_false_on_a_failed_model_answers_409_in_the_reply(action: str) -> None:
    """The issue: in hot-swap mode `?wait=false` on a FAILED model answered 202 `begin`; the
    409 only reached a log line."""

    async def body() -> None:
        fakes = {"a": FakeVllm(name="a")}
        hot_swap = {**make_settings(fakes).model_dump(), "gateway": {"enabled": True}}
        settings = Settings.model_validate(hot_swap)
        side = make_sidecar(settings, fakes, CollectorRegistry())
        assert side.swap is not None, "hot-swap mode"
        app = side.app
        async with asgi.client(app, "http://c") as c:
            await side.started.wait()  # the start-up probes run once it serves
            side.manager.get("a").mark_failed("engine died")
            r = await c.post(f"/models/a/{action}", params={"wait": "false"})
            assert r.status_code == 409, r.text
            assert r.json()["error"] == "TransitionConflict"
            assert "FAILED" in r.json()["message"]
            assert "engine died" in r.json()["message"]

    run(body())


def test_wait_false_wake_without_room_and_eviction_answers_409_in_the_reply() -> None:
    async def body() -> None:
        fakes = {"a": FakeVllm(name="a"), "b": FakeVllm(name="b")}
        one_awake = {"gateway": {"enabled": True}, "swap": {"max_awake": 1, "min_awake_s": 0}}
        settings = Settings.model_validate({**make_settings(fakes).model_dump(), **one_awake})
        side = make_sidecar(settings, fakes, CollectorRegistry())
        app = side.app
        async with asgi.client(app, "http://c") as c:
            await side.started.wait()  # the start-up probes run once it serves
            assert (await c.post("/models/b/sleep")).status_code == 200  # a runs, b sleeps
            r = await c.post("/models/b/wake", params={"wait": "false", "evict": "false"})
            assert r.status_code == 409, r.text
            assert r.json()["error"] == "WakeRefused"
            assert r.json()["plan"]["decision"] == "refuse"
            assert side.manager.get("b").snapshot().state is State.SUSPENDED

    run(body())


def _numeric_fields(model: type[BaseModel], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for name, info in model.model_fields.items():
        ann = info.annotation
        args = getattr(ann, "__args__", (ann,))
        nested = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)]
        for sub in nested:
            yield from _numeric_fields(sub, f"{prefix}{name}.")
        inner = getattr(args[0], "__args__", None) if getattr(ann, "__origin__", None) else None
        for sub in [a for a in inner or () if isinstance(a, type) and issubclass(a, BaseModel)]:
            yield from _numeric_fields(sub, f"{prefix}{name}[].")
        if any(a in (int, float) for a in args) and bool not in args:
            yield f"{prefix}{name}", info


def test_every_numeric_setting_has_an_upper_bound() -> None:
    fields = list(_numeric_fields(Settings))
    assert len(fields) > 20, [f for f, _ in fields]
    unbounded = [
        name
        for name, info in fields
        if not any(
            getattr(m, "le", None) is not None or getattr(m, "lt", None) is not None
            for m in info.metadata
        )
    ]
    assert not unbounded, unbounded
    with pytest.raises(ValidationError):
        Settings(gateway={"hold_timeout_s": 1e308})
    with pytest.raises(ValidationError):
        Settings(timeouts={"drain_s": float("nan")})
