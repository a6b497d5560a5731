"""The fault matrix's tools (the sidecar runs as support.sidecar.SidecarProcess): a
watcher that polls the sidecar's readiness and the engine's pause flag and in-flight count
throughout, a gateway client, and direct calls to the test extension's seams.

Every check is black-box: the sidecar is driven and read through its HTTP API only; the
engine's truth is read from vLLM's own endpoints (`/is_paused`, `/metrics`) and, between
cases, from the ranks' `hotswap_info`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx
from support import oneshot
from support.metrics import metric_sum
from support.sidecar import SidecarProcess

IN_FLIGHT = ("vllm:num_requests_running", "vllm:num_requests_waiting")


def engine_http(url: str, timeout_s: float = 60.0) -> httpx.Client:
    """A client of an engine at `url`: `unix:PATH` (its Unix socket) or an http URL."""
    if url.startswith("unix:"):
        transport = httpx.HTTPTransport(uds=url.removeprefix("unix:"))
        return httpx.Client(base_url="http://engine", transport=transport, timeout=timeout_s)
    return httpx.Client(base_url=url, timeout=timeout_s)


def rpc(base_url: str, method: str, *args: Any, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """One collective_rpc straight to the engine (only while no sidecar sends to it)."""
    with engine_http(base_url, timeout_s) as client:
        r = client.post(
            "/collective_rpc", json={"method": method, "args": list(args), "kwargs": {}}
        )
    r.raise_for_status()
    results: list[dict[str, Any]] = r.json()["results"]
    assert all(x.get("ok") for x in results), results
    return results


def hold_next(base_url: str, point: str, seconds: float, skip: int = 0) -> None:
    """Hold every rank at the fault point of the next (after `skip`) call that reaches it."""
    rpc(base_url, "hotswap_test_hold_next", point, seconds, skip)


class _UnixConnection(http.client.HTTPConnection):
    """http.client over a Unix socket (an engine's `--uds`)."""

    def __init__(self, path: str, timeout_s: float) -> None:
        super().__init__("localhost", timeout=timeout_s)
        self._path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        sock.connect(self._path)
        self.sock = sock


class _Poller:
    """One kept-alive connection for a watcher's polls: http.client, not httpx, since a poll
    every 20 ms through httpx cost about 1.5 ms of the test process's CPU (0.6 ms here),
    which over a matrix run is tens of seconds. A failed call closes the connection; the
    next one opens a new one (the engine or the sidecar may have been restarted)."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self._url = ""
        self._conn: http.client.HTTPConnection | None = None

    def get(self, url: str, path: str) -> tuple[int, bytes]:
        """(status, body) of GET `path` at `url` (`unix:PATH` or http://HOST:PORT); raises
        OSError or http.client.HTTPException. A kept connection the server closed meanwhile
        is opened anew and the call made once more (as httpx does)."""
        kept = self._conn is not None and url == self._url
        try:
            return self._once(url, path)
        except ConnectionError:  # reset or closed (http.client.RemoteDisconnected); not a timeout
            if not kept:
                raise
            return self._once(url, path)

    def _once(self, url: str, path: str) -> tuple[int, bytes]:
        if self._conn is None or url != self._url:
            self.close()
            if url.startswith("unix:"):
                self._conn = _UnixConnection(url.removeprefix("unix:"), self.timeout_s)
            else:
                where = urlsplit(url)
                host, port = where.hostname or "127.0.0.1", where.port
                self._conn = http.client.HTTPConnection(host, port, timeout=self.timeout_s)
            self._url = url
        try:
            self._conn.request("GET", path)
            r = self._conn.getresponse()
            return r.status, r.read()
        except (OSError, http.client.HTTPException):
            self.close()
            raise

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


@dataclass(frozen=True)
class Sample:
    sent: float
    received: float
    value: Any


@dataclass
class Watcher:
    """Polls, each in its own thread until stopped: the sidecar's per-model readiness, and the
    engine's `/is_paused` and in-flight requests. `violations()` names every moment the
    sidecar said ready while the engine was paused, and every request the engine held while
    paused (only the gateway sends requests while a watcher runs)."""

    sidecar: SidecarProcess
    name: str
    engine_url: str
    interval_s: float = 0.02
    max_s: float = 300.0
    health: list[Sample] = field(default_factory=list)
    engine: list[Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Watcher:
        for target in (self._poll_health, self._poll_engine):
            t = threading.Thread(target=target, daemon=True, name=target.__name__)
            t.start()
            self._threads.append(t)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(15.0)

    def _loop(self, poll: Any) -> None:
        deadline = time.monotonic() + self.max_s
        client = _Poller(5.0)
        try:
            while not self._stop.is_set() and time.monotonic() < deadline:
                sent = time.monotonic()
                value = poll(client)
                self._record(Sample(sent, time.monotonic(), value), poll)
                self._stop.wait(self.interval_s)
        finally:
            client.close()

    def _record(self, s: Sample, poll: Any) -> None:
        (self.health if poll == self._health_once else self.engine).append(s)

    def _poll_health(self) -> None:
        self._loop(self._health_once)

    def _poll_engine(self) -> None:
        self._loop(self._engine_once)

    def _health_once(self, client: _Poller) -> int:
        url = self.sidecar.url  # a new port after each restart of the sidecar
        if not url:
            return 0
        try:
            return client.get(url, f"/models/{self.name}/health")[0]
        except (OSError, http.client.HTTPException):
            return 0

    def _engine_once(self, client: _Poller) -> tuple[bool, int] | None:
        """(paused, requests in flight); the in-flight count only while paused, the one time
        `violations` reads it: vLLM renders its whole /metrics for it (about 7 ms of the
        engine's CPU a call, /is_paused 1.5 ms), which every 20 ms kept a quarter of a core
        busy for as long as a case ran."""
        try:
            status, body = client.get(self.engine_url, "/is_paused")  # on its socket
            if status != 200:
                return None
            paused = bool(json.loads(body)["is_paused"])
            if not paused:
                return False, 0
            body = client.get(self.engine_url, "/metrics")[1]
        except (OSError, http.client.HTTPException, ValueError, KeyError, TypeError):
            return None
        return paused, int(metric_sum(body.decode(errors="replace"), *IN_FLIGHT))

    def violations(self) -> list[str]:
        out: list[str] = []
        health = sorted(self.health, key=lambda s: s.sent)
        for e in self.engine:
            if e.value is None or not e.value[0]:
                continue
            paused_at, busy = e.sent, e.value[1]
            before = [h for h in health if h.received <= paused_at]
            after = [h for h in health if h.sent >= e.received]
            if before and after and before[-1].value == 200 and after[0].value == 200:
                out.append(
                    f"ready (200) before and after the engine was seen paused at {paused_at:.3f}"
                )
            if busy:
                out.append(
                    f"{busy} request(s) in the engine while it was paused at {paused_at:.3f}"
                )
        return out

    def ever_ready(self) -> bool:
        return any(h.value == 200 for h in self.health)


@dataclass
class GatewayClient:
    """Sends greedy completions through the gateway, one after the other, until stopped."""

    sidecar: SidecarProcess
    model: str
    expected: tuple[int, ...]
    timeout_s: float = 60.0
    answers: list[tuple[int, str]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def __enter__(self) -> GatewayClient:
        self._thread = threading.Thread(target=self._run, daemon=True, name="gateway-client")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.timeout_s + 10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.answers.append(self.once())
            self._stop.wait(0.05)

    def once(self) -> tuple[int, str]:
        """(status, what): 200 with the right tokens is "ok"; 0 = no sidecar to talk to."""
        if not self.sidecar.gateway_url:
            return 0, "no sidecar"
        t0 = time.monotonic()
        try:
            r = oneshot.post(
                f"{self.sidecar.gateway_url}/v1/completions",
                json=completion_body(self.model),
                timeout=self.timeout_s,
            )
        except httpx.TimeoutException:
            return -1, f"hung past {self.timeout_s:g} s"
        except httpx.HTTPError as exc:
            return 0, f"{type(exc).__name__}"
        if r.status_code == 200:
            got = tuple(r.json()["choices"][0]["token_ids"])
            return (
                200,
                "ok"
                if got == self.expected
                else f"wrong tokens {got} after {time.monotonic() - t0:.1f} s",
            )
        if r.status_code in (429, 503):
            return r.status_code, "refused" if "retry-after" in r.headers else "no Retry-After"
        return r.status_code, r.text[:200]

    def bad(self) -> list[tuple[int, str]]:
        return [
            a for a in self.answers if a[1] not in ("ok", "refused", "no sidecar") and a[0] != 0
        ]


def completion_body(model: str, max_tokens: int = 6) -> dict[str, Any]:
    return {
        "model": model,
        "prompt": "the quick brown fox",
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "return_token_ids": True,
    }


def greedy(url: str, model: str, timeout_s: float = 120.0) -> tuple[int, ...]:
    with engine_http(url, timeout_s) as client:
        r = client.post("/v1/completions", json=completion_body(model))
    r.raise_for_status()
    return tuple(r.json()["choices"][0]["token_ids"])


@contextlib.contextmanager
def stopped(pid_group: int) -> Iterator[None]:
    """SIGSTOP a process group for the duration; SIGCONT after, whatever happens."""
    os.killpg(pid_group, signal.SIGSTOP)
    try:
        yield
    finally:
        os.killpg(pid_group, signal.SIGCONT)
