"""The one adapter for all HTTP I/O to one vLLM OpenAI server.

Every call has an HTTP client timeout from `TimeoutSettings`; nothing is ever sent as a
`collective_rpc` `timeout` (a timed-out RPC leaves vLLM's reply queues out of step).
httpx errors are translated into `controller.errors` in one place, `_send`. After any 5xx
or transport error the pooled connection is dropped (vLLM closes it after a 5xx), so the
next call opens a new one. Nothing here retries: a failed RPC means FAILED upstream.
"""

from __future__ import annotations

import functools
import logging
import ssl
import time
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import httpx

from controller.config.settings import TimeoutSettings
from controller.errors import EngineError, EngineTimeout, EngineUnavailable

log = logging.getLogger("hotswap.engine")

PauseMode = Literal["wait", "abort", "keep"]

# Token ids, not text: works with --skip-tokenizer-init and with every vocabulary.
WARMUP_PROMPT = [1, 2, 3, 4]
# A pause of an idle engine answers in tens of milliseconds; a zero HTTP timeout would not.
MIN_PAUSE_TIMEOUT_S = 0.01
_BODY_EXCERPT = 500


class RankError(EngineError):
    """An RPC answered, but at least one rank reported `ok: false`; every rank's report is kept.
    Every rank answered, so every reply was read: the queues are in step."""

    may_desync = False

    def __init__(self, message: str, *, method: str, ranks: list[dict[str, Any]]) -> None:
        super().__init__(message)
        self.method = method
        self.ranks = ranks

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.ranks if r.get("ok") is not True]

    def to_dict(self) -> dict[str, object]:
        out = super().to_dict()
        out["ranks"] = [
            {"rank": r.get("rank"), "ok": r.get("ok"), "error": r.get("error")} for r in self.ranks
        ]
        return out


def _excerpt(resp: httpx.Response) -> str:
    """vLLM's error message if the body has one, else the start of the body."""
    try:
        body = resp.json()
    except ValueError:
        return resp.text[:_BODY_EXCERPT]
    if isinstance(body, dict):
        err = body.get("error")
        if isinstance(err, dict) and isinstance(err.get("message"), str):
            return str(err["message"])[:_BODY_EXCERPT]
        if isinstance(body.get("detail"), str):
            return str(body["detail"])[:_BODY_EXCERPT]
    return resp.text[:_BODY_EXCERPT]


# vLLM's server (uvicorn) closes a connection idle for 5 s; httpx would reuse one for 5 s
# too, so a call sent just as the server closes it met "Server disconnected without sending
# a response". Idle connections are dropped well before the server's limit instead.
KEEPALIVE_S = 2.0
ENGINE_POOL = httpx.Limits(
    max_connections=100, max_keepalive_connections=20, keepalive_expiry=KEEPALIVE_S
)


@functools.cache
def _tls() -> ssl.SSLContext:
    """httpx's default TLS context (an https engine is verified as before), built once per
    process: each build loads the CA bundle, 20-50 ms of CPU on the event loop, and every
    new transport (every dropped connection) used to build its own."""
    return httpx.create_ssl_context()


def engine_transport(
    uds: str | None, limits: httpx.Limits = ENGINE_POOL
) -> httpx.AsyncHTTPTransport:
    """The transport to an engine: on a Unix socket (vLLM's --uds), else TCP by URL."""
    return httpx.AsyncHTTPTransport(uds=uds, limits=limits, verify=_tls())


class EngineClient:
    """All HTTP to one vLLM server. Methods raise `EngineError` and its children only."""

    def __init__(
        self,
        base_url: str,
        client: httpx.AsyncClient | None = None,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
        uds: str | None = None,
        timeouts: TimeoutSettings,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts
        self.uds = uds
        self._transport = transport
        # An injected client belongs to the caller: used until the first error, never closed here.
        self._client = client if client is not None else self._new_client()
        self._owns_client = client is None
        self.connections_dropped = 0

    def _new_client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.base_url, transport=self._new_transport())

    def _new_transport(self) -> httpx.AsyncBaseTransport:
        # A closed client closes its transport: each new client gets its own socket pool.
        if self._transport is None:
            return engine_transport(self.uds)
        return self._transport

    async def _drop_connection(self) -> None:
        """Forget the pooled connection: vLLM closes it after a 5xx, and a broken one must go."""
        old, owned = self._client, self._owns_client
        self._client = self._new_client()
        self._owns_client = True
        self.connections_dropped += 1
        if owned:
            try:
                await old.aclose()
            except Exception:  # closing a broken pool must not hide the error being reported
                log.debug("closing the old connection pool of %s failed", self.base_url)

    def _timeout(self, seconds: float) -> httpx.Timeout:
        # Connecting to a loopback server is quick whatever the call's own budget is.
        return httpx.Timeout(seconds, connect=min(seconds, self.timeouts.control_s))

    async def _send(
        self,
        method: str,
        path: str,
        *,
        timeout_s: float,
        params: Mapping[str, str] | httpx.QueryParams | None = None,
        json: object = None,
        accept: tuple[int, ...] = (),
    ) -> httpx.Response:
        """The one place httpx errors become controller errors; `accept`: 5xx to return."""
        what = f"{method} {path}"
        try:
            resp = await self._client.request(
                method, path, params=params, json=json, timeout=self._timeout(timeout_s)
            )
        except httpx.TimeoutException as exc:
            await self._drop_connection()
            err: EngineError = EngineTimeout(
                f"{self.base_url}: {what} got no answer within {timeout_s:g} s"
            )
            err.may_desync = not isinstance(exc, httpx.ConnectTimeout)
            raise err from exc
        except httpx.TransportError as exc:
            await self._drop_connection()
            err = EngineUnavailable(f"{self.base_url}: {what} failed: {type(exc).__name__}: {exc}")
            err.may_desync = not isinstance(exc, httpx.ConnectError)
            raise err from exc
        except httpx.HTTPError as exc:
            await self._drop_connection()
            raise EngineError(
                f"{self.base_url}: {what} failed: {type(exc).__name__}: {exc}"
            ) from exc
        if resp.status_code >= 500:
            await self._drop_connection()
            if resp.status_code in accept:
                return resp
            raise EngineError(
                f"{self.base_url}: {what} -> HTTP {resp.status_code}: {_excerpt(resp)}"
            )
        if resp.status_code >= 400:
            err = EngineError(
                f"{self.base_url}: {what} -> HTTP {resp.status_code}: {_excerpt(resp)}"
            )
            err.may_desync = False  # refused whole: nothing ran
            raise err
        return resp

    def _json(self, resp: httpx.Response, what: str) -> Any:
        try:
            return resp.json()
        except ValueError as exc:
            raise EngineError(
                f"{self.base_url}: {what} answered a body that is not JSON: "
                f"{resp.text[:_BODY_EXCERPT]!r}"
            ) from exc

    async def _flag(self, path: str, key: str) -> bool:
        resp = await self._send("GET", path, timeout_s=self.timeouts.control_s)
        body = self._json(resp, path)
        if not isinstance(body, dict) or not isinstance(body.get(key), bool):
            raise EngineError(
                f"{self.base_url}: GET {path} answered {body!r}, expected {{{key!r}: bool}}"
            )
        return bool(body[key])

    async def health(self, timeout_s: float | None = None) -> bool:
        """True on 200; False on 503 (vLLM's dead engine). Unreachable raises."""
        t = self.timeouts.control_s if timeout_s is None else timeout_s
        resp = await self._send("GET", "/health", timeout_s=t, accept=(503,))
        return resp.status_code != 503

    async def is_paused(self) -> bool:
        return await self._flag("/is_paused", "is_paused")

    async def is_sleeping(self) -> bool:
        """vLLM's `/is_sleeping`: its scheduler paused or its executor asleep."""
        return await self._flag("/is_sleeping", "is_sleeping")

    async def pause(
        self, mode: PauseMode, clear_cache: bool = True, timeout_s: float | None = None
    ) -> None:
        """POST /pause. With mode=wait the answer comes once in-flight requests finished."""
        if mode not in ("wait", "abort", "keep"):
            raise ValueError(f"unknown pause mode {mode!r}")
        t = self.timeouts.control_s if timeout_s is None else max(timeout_s, MIN_PAUSE_TIMEOUT_S)
        params = {"mode": mode, "clear_cache": "true" if clear_cache else "false"}
        await self._send("POST", "/pause", params=params, timeout_s=t)

    async def resume(self) -> None:
        await self._send("POST", "/resume", timeout_s=self.timeouts.control_s)

    async def wake_up(
        self, tags: Sequence[str] | None = None, timeout_s: float | None = None
    ) -> None:
        """POST /wake_up: vLLM's own wake of `tags` (None: every pool), which ends vLLM's
        own sleep (its executor's flag) and, once nothing is asleep, resumes its scheduler
        (docs/contracts.md §1.5, §2.3)."""
        params = None if tags is None else httpx.QueryParams([("tags", str(t)) for t in tags])
        t = self.timeouts.control_s if timeout_s is None else timeout_s
        await self._send("POST", "/wake_up", timeout_s=t, params=params)

    async def sleep(self, level: int, timeout_s: float) -> None:
        """POST /sleep?level=N&mode=abort: vLLM's own sleep (docs/contracts.md §2.3); the
        answer comes once the sleep is done. Sent once: a timeout is a failure, never a
        resend."""
        if level not in (1, 2):
            raise ValueError(f"sleep level must be 1 or 2, not {level}")
        params = {"level": str(level), "mode": "abort"}
        await self._send("POST", "/sleep", params=params, timeout_s=timeout_s)

    async def reload_weights(self, timeout_s: float) -> None:
        """vLLM's own `reload_weights` through /collective_rpc (the weights refilled from the
        checkpoint; vLLM answers `{"results": [null, ...]}`), never with `timeout`."""
        body = {"method": "reload_weights", "args": [], "kwargs": {}}
        await self._send("POST", "/collective_rpc", json=body, timeout_s=timeout_s)

    async def reset_prefix_cache(self) -> bool:
        """POST /reset_prefix_cache (running requests preempted, as a clearing pause does):
        True when vLLM says the cache was reset; it refuses while blocks are held."""
        resp = await self._send(
            "POST",
            "/reset_prefix_cache",
            params={"reset_running_requests": "true"},
            timeout_s=self.timeouts.control_s,
        )
        body = self._json(resp, "/reset_prefix_cache")
        if not isinstance(body, dict) or not isinstance(body.get("success"), bool):
            raise EngineError(
                f"{self.base_url}: POST /reset_prefix_cache answered {body!r}, "
                "expected {'success': bool}"
            )
        return bool(body["success"])

    async def rpc(
        self, method: str, *args: Any, timeout_s: float, **kwargs: Any
    ) -> list[dict[str, Any]]:
        """One `collective_rpc` call; one dict per rank. Sent once, never with `timeout`."""
        body = {"method": method, "args": list(args), "kwargs": kwargs}
        resp = await self._send("POST", "/collective_rpc", json=body, timeout_s=timeout_s)
        data = self._json(resp, f"collective_rpc {method}")
        results = data.get("results") if isinstance(data, dict) else None
        if (
            not isinstance(results, list)
            or not results
            or not all(isinstance(r, dict) for r in results)
        ):
            raise EngineError(
                f"{self.base_url}: collective_rpc {method} answered {str(data)[:_BODY_EXCERPT]!r}, "
                'expected {"results": [dict, ...]}'
            )
        ranks: list[dict[str, Any]] = results
        bad = [r for r in ranks if r.get("ok") is not True]
        if bad:
            detail = "; ".join(
                f"rank {r.get('rank', '?')}: {r.get('error', 'ok is not true')}" for r in bad
            )
            raise RankError(
                f"{method} failed on {len(bad)} of {len(ranks)} ranks: {detail}",
                method=method,
                ranks=ranks,
            )
        return ranks

    async def served_models(self) -> tuple[str, ...]:
        """Every name /v1/models lists (the served model names)."""
        resp = await self._send("GET", "/v1/models", timeout_s=self.timeouts.control_s)
        data = self._json(resp, "/v1/models")
        entries = data.get("data") if isinstance(data, dict) else None
        if not isinstance(entries, list):
            raise EngineError(f"{self.base_url}: /v1/models answered no list: {data!r}")
        return tuple(
            e["id"] for e in entries if isinstance(e, dict) and isinstance(e.get("id"), str)
        )

    async def served_model(self) -> str:
        resp = await self._send("GET", "/v1/models", timeout_s=self.timeouts.control_s)
        data = self._json(resp, "/v1/models")
        try:
            name = data["data"][0]["id"]
        except (KeyError, IndexError, TypeError) as exc:
            raise EngineError(f"{self.base_url}: /v1/models answered no model: {data!r}") from exc
        if not isinstance(name, str):
            raise EngineError(f"{self.base_url}: /v1/models answered a non-string id: {name!r}")
        return name

    async def warmup(self, model: str | None = None) -> float:
        """One greedy 1-token completion; returns its seconds."""
        name = model if model is not None else await self.served_model()
        body = {"model": name, "prompt": WARMUP_PROMPT, "max_tokens": 1, "temperature": 0}
        start = time.monotonic()
        resp = await self._send(
            "POST", "/v1/completions", json=body, timeout_s=self.timeouts.warmup_s
        )
        elapsed = time.monotonic() - start
        data = self._json(resp, "/v1/completions")
        if not isinstance(data, dict) or not data.get("choices"):
            raise EngineError(
                f"{self.base_url}: warm-up completion answered {str(data)[:_BODY_EXCERPT]!r}"
            )
        return elapsed

    async def process_start(self) -> str | None:
        """A sign of which process answers, learned without an RPC: the API server's
        `process_start_time_seconds` on its /metrics (prometheus_client's process collector;
        vLLM 0.32 serves it). None when the engine does not report it."""
        resp = await self._send("GET", "/metrics", timeout_s=self.timeouts.control_s)
        for line in resp.text.splitlines():
            if line.startswith("process_start_time_seconds "):
                value = line.split()[1]
                try:
                    return repr(float(value))
                except ValueError:
                    return None
        return None

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()
