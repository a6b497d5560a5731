"""The gateway's memory at its caps (issue 28 item 3): concurrent max-size bodies and large
non-streamed answers, through a real uvicorn server on loopback, the sidecar's RSS growth
held under a bound derived from its settings, itself under the pod's limit in deploy/."""

from __future__ import annotations

import asyncio
import os
import re
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from support.asgi import served
from support.gatewayworld import Router, world

from controller.config.servesettings import GatewaySettings

MiB = 1 << 20
REPO = Path(__file__).resolve().parents[2]
ANSWER_BYTES = 2 * MiB  # each answer, not streamed by the engine: sent whole, in pieces
SLACK = 96 * MiB  # the interpreter's churn (sockets, buffers, the test's tasks), after other tests


def pod_limit() -> int:
    """The sidecar container's memory limit in deploy/ (the base deployment)."""
    text = (REPO / "deploy/k8s/base/deployment.yaml").read_text()
    limits = re.findall(r"limits:\s*\n(?:\s+\w+: .*\n)*?\s+memory: (\d+)Mi", text)
    return min(int(x) for x in limits) * MiB


def bound(gateway: GatewaySettings) -> int:
    """What the gateway may add at its caps: every held body joined once from its pieces
    (twice the cap at the join), plus slack."""
    return 2 * gateway.max_body_buffer_bytes + SLACK


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class BigAnswers(Router):
    """The engines' data plane: a body is counted, not parsed; the answer is large and not
    streamed (one JSON document sent in pieces, as any HTTP server may)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path not in ("/v1/completions", "/v1/chat/completions"):
            return await super().handle_async_request(request)
        if len(request.content) < 1024:  # the manager's warm-up
            return await super().handle_async_request(request)
        return httpx.Response(200, stream=_Answer(), headers={"content-type": "application/json"})


class _Answer(httpx.AsyncByteStream):
    async def __aiter__(self) -> AsyncIterator[bytes]:
        piece = b" " * (64 << 10)
        for _ in range(ANSWER_BYTES // len(piece)):
            await asyncio.sleep(0)
            yield piece


def test_the_gateway_at_its_caps_stays_within_its_memory_bound() -> None:
    """The issue: the gateway held a body about 3.4 times and buffered whole answers: 16
    concurrent 4 MiB requests took the sidecar from 57 to 282 MiB. Now bodies are held once
    and capped in all (gateway.max_body_buffer_bytes), answers pass through as they come."""
    cap = {"max_body_buffer_bytes": 24 * MiB, "max_concurrent": 24}
    clients = 24
    body = b'{"model": "a", "prompt": "' + b"x" * (4 * MiB - 64) + b'"}'
    peak = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], rss())
            stop.wait(0.005)

    async def pieces() -> AsyncIterator[bytes]:
        """The body in pieces, so the client's own send buffers stay small (its memory is
        in the same process as the gateway's)."""
        view = memoryview(body)
        for start in range(0, len(view), 64 << 10):
            yield bytes(view[start : start + (64 << 10)])

    async def one(c: httpx.AsyncClient) -> int:
        for _ in range(400):
            try:
                length = {"content-length": str(len(body))}
                post = c.stream("POST", "/v1/completions", content=pieces(), headers=length)
                async with post as r:
                    got = 0
                    async for chunk in r.aiter_bytes():
                        got += len(chunk)
            except httpx.TransportError:
                # Refused (429) before the whole body was sent: the server closed as it
                # answered, which the client may see as a broken connection.
                await asyncio.sleep(0.05)
                continue
            if r.status_code != 429:
                assert got == ANSWER_BYTES
                return r.status_code
            await asyncio.sleep(0.05)
        return 429

    async def run() -> None:
        async with (
            world(gateway=cap, router=BigAnswers) as w,
            served(w.app, lifespan="off", settings=w.manager.settings) as port,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as c,
        ):
            settings = w.manager.settings.gateway
            assert await one(c) == 200  # warm: every lazy import and buffer made once
            start = rss()
            peak[0] = start
            sampler = threading.Thread(target=sample, daemon=True)
            sampler.start()
            try:
                codes = await asyncio.gather(*(one(c) for _ in range(clients)))
            finally:
                stop.set()
                sampler.join()
            assert codes == [200] * clients
            grown = peak[0] - start
            print(f"RSS {start / MiB:.0f} MiB -> peak {peak[0] / MiB:.0f} MiB")
            assert grown <= bound(settings), f"grew {grown / MiB:.0f} MiB"

    asyncio.run(asyncio.wait_for(run(), 240))


def test_the_default_bound_fits_the_pod() -> None:
    """At the default settings the bound, on top of a sidecar's own memory, stays under the
    deploy's limit."""
    process = 128 * MiB  # the sidecar's request in deploy/: its steady memory with room
    assert process + bound(GatewaySettings()) <= pod_limit()
