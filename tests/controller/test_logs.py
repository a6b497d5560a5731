"""Structured logging: JSON lines and readable text, both carrying model/phase/rank."""

from __future__ import annotations

import asyncio
import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send
from support.asgi import served

from controller.config.settings import LogFormat, LogSettings, Settings
from controller.observe.logs import configure_logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    access = logging.getLogger("uvicorn.access")
    access_filters = list(access.filters)
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)
    access.filters[:] = access_filters


@pytest.mark.usefixtures("restore_root")
def test_json_lines_carry_context() -> None:
    out = io.StringIO()
    configure_logging(LogSettings(format=LogFormat.JSON, level="info"), stream=out)
    log = logging.getLogger("controller.test")
    log.info("suspended %d bytes", 4096, extra={"model": "a", "phase": "suspend", "rank": 1})
    log.debug("hidden at INFO")
    log.warning("plain")
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("with traceback", extra={"model": "b"})
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert len(lines) == 3
    first, second, third = lines
    assert first["msg"] == "suspended 4096 bytes"
    assert (first["level"], first["logger"]) == ("INFO", "controller.test")
    assert (first["model"], first["phase"], first["rank"]) == ("a", "suspend", 1)
    assert first["ts"].endswith("+00:00")
    assert "model" not in second
    assert "rank" not in second
    assert third["model"] == "b"
    assert "ValueError: bad" in third["exc"]


@pytest.mark.usefixtures("restore_root")
def test_text_lines_show_context_and_reconfigure_replaces() -> None:
    first = io.StringIO()
    configure_logging(LogSettings(format=LogFormat.TEXT), stream=first)
    out = io.StringIO()
    configure_logging(LogSettings(format=LogFormat.TEXT, level="DEBUG"), stream=out)
    log = logging.getLogger("controller.test")
    log.debug("quiesced", extra={"model": "a", "phase": "quiesce", "rank": 0})
    log.info("no context")
    text = out.getvalue().splitlines()
    assert len(text) == 2
    assert "DEBUG" in text[0]
    assert "[model=a phase=quiesce rank=0] quiesced" in text[0]
    assert "controller.test no context" in text[1]
    assert "[" not in text[1].split("controller.test", 1)[1]
    assert first.getvalue() == "", "the first handler was replaced, not kept"
    with pytest.raises(json.JSONDecodeError):
        json.loads(text[0])


def test_bad_level_refused() -> None:
    with pytest.raises(ValueError, match="log level"):
        configure_logging(LogSettings(level="LOUD"), stream=io.StringIO())


async def _status_app(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers every request with the status in its `?status=` (200 without one)."""
    if scope["type"] != "http":
        return
    query = dict(p.split("=", 1) for p in scope["query_string"].decode().split("&") if "=" in p)
    status = int(query.get("status", "200"))
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def _access_lines(probe_access: bool, requests: list[tuple[str, str]]) -> list[str]:
    """uvicorn.access lines of `requests` (method, path) served as `hotswap serve` serves
    (its uvicorn config, its logging set-up)."""
    out = io.StringIO()
    configure_logging(LogSettings(probe_access=probe_access), stream=out)

    async def body() -> None:
        async with (
            served(_status_app, lifespan="off", settings=Settings()) as port,
            httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as client,
        ):
            for method, path in requests:
                await client.request(method, path)

    asyncio.run(asyncio.wait_for(body(), 30))
    return [line for line in out.getvalue().splitlines() if "uvicorn.access" in line]


PROBES = [
    ("GET", "/livez"),
    ("GET", "/health"),
    ("HEAD", "/health"),
    ("GET", "/models/a/health"),
    ("GET", "/metrics"),
    ("GET", "/metrics?name[]=x"),
]
NOT_PROBES: list[tuple[str, Any]] = [
    ("GET", "/health?status=503"),  # a failed readiness probe
    ("GET", "/livez?status=500"),
    ("GET", "/models/a/health?status=503"),
    ("GET", "/models/a"),
    ("POST", "/models/a/sleep"),
    ("POST", "/livez"),  # not what a probe sends
    ("GET", "/models/a/b/health"),
    ("GET", "/livez/"),
    ("GET", "/v1/models"),
]


@pytest.mark.usefixtures("restore_root")
def test_the_access_log_leaves_out_successful_probes() -> None:
    """The kubelet probes /livez and /health every few seconds and Prometheus scrapes
    /metrics: a line each was noise (and most of a probe's CPU). Those that succeed are not
    logged; a failed probe and every other request are."""
    lines = _access_lines(False, PROBES + NOT_PROBES)
    assert len(lines) == len(NOT_PROBES), lines
    for (method, path), line in zip(NOT_PROBES, lines, strict=True):
        assert f'"{method} {path} HTTP/1.1"' in line, (path, line)


@pytest.mark.usefixtures("restore_root")
def test_probe_access_logs_the_successful_probes_too() -> None:
    lines = _access_lines(True, PROBES + NOT_PROBES)
    assert len(lines) == len(PROBES) + len(NOT_PROBES), lines
    # Reconfigured without it, the probes are left out again (the filter is not doubled).
    assert len(_access_lines(False, PROBES)) == 0
