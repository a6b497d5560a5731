"""The soak's load: a bounded asyncio + httpx driver run beside the soak's swap cycles.

Four kinds of traffic, all to this machine's loopback, each bounded in count and time and
stopped by `Load.stop`:

- completions: `workers` clients sending the soak's prompts to the model the soak's cycle
  is on (`Load.target`), back to back, so that with the soak's own clients the gateway
  runs at its `max_concurrent` cap; every answer must be 200 with that model's reference
  output, or 429/503 with Retry-After (then the request is retried after it, as the
  soak's clients do); anything else is `lost`, `hung` or `wrong`;
- bodies at the caps: a body of exactly `max_body_bytes` (a valid request for a model
  nobody serves: 404, read and checked whole), one byte over it (413) and JSON one level
  deeper than `max_json_depth` (400); 429/503 with Retry-After (the cap is full) count as
  refused; a connection the server closes while the body is still being sent (it may
  answer early, before the body, and close) is counted as `closed_early`; any other
  status, a 5xx or a timeout is a problem;
- half-open and slow connections (`slow` at once): connect and send nothing, send the
  headers a byte at a time, or announce a body and send a part of it; each is held until
  the server closes it or `hold_s` passes (how many the server closed is reported);
- `/livez` on the control port every `livez_every_s`, from a process of its own in a session
  of its own (stdlib only: the latency is the sidecar's, not this driver's event loop's, and
  where the kernel shares the CPU out by session the prober does not share this driver's):
  every sample kept, with the prober's own wait for a CPU during each.

Everything is counted in a `Report`; the soak asserts on it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httpx

# The /livez prober: GET every `every` seconds, one "latency_s ok waited_s sidecar_waited_s"
# line per probe, until killed or its parent (the driver) is gone. Waited: time runnable but
# waiting for a CPU during the probe (schedstat), the prober's own and the sidecar's event
# loop thread's (its main thread): the machine's share of the latency, not the sidecar's.
_PROBE = """
import http.client, os, sys, time
host, port, every, out = sys.argv[1], int(sys.argv[2]), float(sys.argv[3]), sys.argv[4]
sidecar = sys.argv[5]
parent = os.getppid()
def waited(pid="self"):
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, ValueError, IndexError):
        return 0.0
with open(out, "a", buffering=1) as f:
    while os.getppid() == parent:
        w, ws, t = waited(), waited(sidecar), time.monotonic()
        try:
            c = http.client.HTTPConnection(host, port, timeout=5)
            c.request("GET", "/livez")
            ok = c.getresponse().status == 200
            c.close()
        except OSError:
            ok = False
        took = time.monotonic() - t
        f.write(f"{took:.6f} {int(ok)} {waited() - w:.6f} {waited(sidecar) - ws:.6f}\\n")
        time.sleep(max(0.0, every - took))
"""
ATTEMPT_TIMEOUT_S = 200.0  # one HTTP attempt (the soak's REQUEST_TIMEOUT_S)
DEADLINE_S = 400.0  # one logical request, retries included


@dataclass
class Report:
    outcomes: Counter[str] = field(default_factory=Counter)
    problems: list[str] = field(default_factory=list)
    livez_s: list[float] = field(default_factory=list)
    livez_prober_wait_s: list[float] = field(default_factory=list)  # per probe, in order
    livez_sidecar_wait_s: list[float] = field(default_factory=list)  # likewise
    slow_opened: int = 0
    slow_closed_by_server: int = 0
    caps: Counter[str] = field(default_factory=Counter)

    def problem(self, kind: str, what: str) -> None:
        self.outcomes[kind] += 1
        if len(self.problems) < 50:
            self.problems.append(f"{kind}: {what}")

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.livez_s)
        probes = list(
            zip(self.livez_s, self.livez_prober_wait_s, self.livez_sidecar_wait_s, strict=True)
        )
        own = sorted(t - w for t, w, _ in probes)
        # less both waits, at least 0: the two can overlap (the loop waited for a CPU for
        # other work while the prober waited for one), which makes this a lower bound
        sidecars = sorted(max(0.0, t - w - s) for t, w, s in probes)

        def pct(q: float, of: list[float] = lat) -> float:
            return round(of[min(len(of) - 1, int(q * len(of)))] * 1000, 1) if of else 0.0

        return {
            "outcomes": dict(self.outcomes),
            "caps": dict(self.caps),
            "slow_connections": self.slow_opened,
            "slow_closed_by_server": self.slow_closed_by_server,
            "livez": {"n": len(lat), "p50_ms": pct(0.5), "p99_ms": pct(0.99), "max_ms": pct(1.0)},
            # each probe's latency less the prober's own wait for a CPU during it
            "livez_less_prober_wait": {
                "p99_ms": pct(0.99, own),
                "max_ms": pct(1.0, own),
                "prober_waited_s": round(sum(self.livez_prober_wait_s), 2),
            },
            # and less the sidecar's loop thread's wait for a CPU during it: what the sidecar's
            # own work (a scan, a blocking call on the loop) made the probe wait
            "livez_less_cpu_waits": {
                "p99_ms": pct(0.99, sidecars),
                "max_ms": pct(1.0, sidecars),
                "sidecar_waited_s": round(sum(self.livez_sidecar_wait_s), 2),
            },
            "problems": self.problems[:20],
        }


class Load:
    """Runs on its own thread and event loop from `start` to `stop`."""

    def __init__(
        self,
        gateway: str,
        control: str,
        refs: dict[tuple[str, str, bool], str],
        target: str,
        *,
        sidecar_pid: int,
        workers: int,
        max_body_bytes: int,
        max_json_depth: int,
        slow: int = 16,
        hold_s: float = 20.0,
        livez_every_s: float = 0.1,
    ) -> None:
        self.gateway, self.control, self.refs = gateway, control, refs
        self.target = target  # the model the soak's cycle is on (the soak sets it)
        self.workers, self.slow, self.hold_s = workers, slow, hold_s
        self.max_body_bytes, self.max_json_depth = max_body_bytes, max_json_depth
        self.livez_every_s = livez_every_s
        self.sidecar_pid = sidecar_pid  # whose loop thread's wait for a CPU the prober reads
        self.report = Report()
        self._stop = threading.Event()
        self._open = threading.Event()  # cleared by `pause`: no new completion starts
        self._open.set()
        self.in_flight = 0  # completions started and not yet answered
        self._thread = threading.Thread(target=self._run, name="soak-load", daemon=True)

    def start(self) -> None:
        url = urlsplit(self.control)
        fd, self._probe_out = tempfile.mkstemp(prefix="livez-", suffix=".txt")
        os.close(fd)
        args = [url.hostname or "127.0.0.1", str(url.port or 80), str(self.livez_every_s)]
        self._probe = subprocess.Popen(
            [sys.executable, "-c", _PROBE, *args, self._probe_out, str(self.sidecar_pid)],
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # as the kubelet, outside the sidecar's and the load's
        )
        self._thread.start()

    def stop(self, timeout_s: float = DEADLINE_S + 30) -> dict[str, Any]:
        self._stop.set()
        self._probe.kill()
        self._probe.wait(10)
        with open(self._probe_out) as f:
            for line in f.read().splitlines():
                took, ok, waited, sidecar_waited = line.split()
                self.report.livez_s.append(float(took))
                self.report.livez_prober_wait_s.append(float(waited))
                self.report.livez_sidecar_wait_s.append(float(sidecar_waited))
                if ok != "1":
                    self.report.problem("livez", f"not 200 after {float(took):.3f} s")
        os.unlink(self._probe_out)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.report.problem("hung", "the load generator did not stop")
        return self.report.summary()

    def pause(self, timeout_s: float = 120.0) -> bool:
        """Start no new completion and wait (bounded) until none is in flight, e.g. before
        the soak SIGKILLs an engine: a stream cut by a killed engine is the kill's, not the
        sidecar's. True when none was left in flight."""
        self._open.clear()
        deadline = time.monotonic() + timeout_s
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.05)
        return self.in_flight == 0

    def resume(self) -> None:
        self._open.set()

    def _run(self) -> None:
        asyncio.run(self._main())

    async def _main(self) -> None:
        limits = httpx.Limits(max_connections=self.workers + 4, max_keepalive_connections=8)
        async with httpx.AsyncClient(
            base_url=self.gateway, timeout=ATTEMPT_TIMEOUT_S, limits=limits
        ) as gw:
            tasks = [asyncio.create_task(self._completions(gw, i)) for i in range(self.workers)]
            tasks += [asyncio.create_task(self._slow(i)) for i in range(self.slow)]
            tasks.append(asyncio.create_task(self._caps(gw)))
            await asyncio.to_thread(self._stop.wait)
            await asyncio.gather(*tasks)

    # -- completions at the concurrency cap ---------------------------------------------

    async def _completions(self, gw: httpx.AsyncClient, i: int) -> None:
        rng = random.Random(i)
        prompts = sorted({p for _, p, _ in self.refs})
        while not self._stop.is_set():
            if not self._open.is_set():
                await asyncio.sleep(0.05)
                continue
            model, prompt, stream = self.target, rng.choice(prompts), rng.random() < 0.5
            self.in_flight += 1
            try:
                await self._request(gw, model, prompt, stream)
            finally:
                self.in_flight -= 1

    async def _request(self, gw: httpx.AsyncClient, model: str, prompt: str, stream: bool) -> None:
        want = self.refs[(model, prompt, stream)]
        what = f"{model} stream={stream} {prompt!r}"
        body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0.0}
        body.update(ignore_eos=True, stream=stream)
        t0 = time.monotonic()
        while time.monotonic() - t0 < DEADLINE_S:
            try:
                status, text, retry_after = await _attempt(gw, body, stream)
            except httpx.TimeoutException as exc:
                return self.report.problem("hung", f"{what}: {exc!r}")
            except (httpx.HTTPError, ValueError, KeyError) as exc:
                return self.report.problem("lost", f"{what}: {type(exc).__name__}: {exc}")
            if status == 200:
                if text != want:
                    return self.report.problem("wrong", f"{what}: {text!r} != {want!r}")
                self.report.outcomes["ok"] += 1
                return None
            if status in (429, 503) and retry_after.isdigit():
                self.report.outcomes[f"refused_{status}"] += 1
                await asyncio.sleep(min(float(retry_after), 1.0) * (0.5 + random.random() / 2))
                continue
            return self.report.problem("other", f"{what}: HTTP {status} {text[:200]}")
        return self.report.problem("lost", f"{what}: not answered in {DEADLINE_S:g} s")

    # -- bodies at the caps ------------------------------------------------------------

    async def _caps(self, gw: httpx.AsyncClient) -> None:
        head = b'{"model": "no-such-model", "max_tokens": 1, "prompt": "'
        pad = self.max_body_bytes - len(head) - 2
        at_cap = head + b"a" * pad + b'"}'
        over = at_cap[:-2] + b'a"}'
        depth = self.max_json_depth + 1
        deep = b'{"model": "x", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        cases = [("at_cap", at_cap, 404), ("over_cap", over, 413), ("too_deep", deep, 400)]
        while not self._stop.is_set():
            for name, data, want in cases:
                if self._stop.is_set():
                    break
                try:
                    r = await gw.post(
                        "/v1/completions",
                        content=data,
                        headers={"content-type": "application/json"},
                        timeout=30.0,
                    )
                except httpx.TimeoutException as exc:
                    self.report.problem("caps", f"{name}: no answer in 30 s: {exc!r}")
                    continue
                except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
                    self.report.caps[f"{name}_closed_early"] += 1
                    continue
                except httpx.HTTPError as exc:
                    self.report.problem("caps", f"{name}: {type(exc).__name__}: {exc}")
                    continue
                refused = r.status_code in (429, 503) and r.headers.get("retry-after", "")
                if r.status_code == want:
                    self.report.caps[name] += 1
                elif refused:
                    self.report.caps[f"{name}_refused_{r.status_code}"] += 1
                else:
                    self.report.problem("caps", f"{name}: HTTP {r.status_code}, want {want}")
            await asyncio.sleep(0.5)

    # -- half-open and slow connections ----------------------------------------------------

    async def _slow(self, i: int) -> None:
        url = urlsplit(self.gateway)
        host, port = url.hostname or "127.0.0.1", url.port or 80
        kinds = ("idle", "slow_headers", "partial_body")
        n = 0
        while not self._stop.is_set():
            kind = kinds[(i + n) % len(kinds)]
            n += 1
            try:
                reader, writer = await asyncio.open_connection(host, port)
            except OSError as exc:
                self.report.problem("slow_connect", f"{kind}: {exc}")
                await asyncio.sleep(1.0)
                continue
            self.report.slow_opened += 1
            try:
                if await self._hold(kind, reader, writer):
                    self.report.slow_closed_by_server += 1
            finally:
                writer.close()
                with contextlib.suppress(OSError):
                    await writer.wait_closed()

    async def _hold(
        self, kind: str, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> bool:
        """Hold one connection as `kind` says; True when the server closed it first."""
        head = b"POST /v1/completions HTTP/1.1\r\nhost: soak\r\ncontent-type: application/json\r\n"
        if kind == "partial_body":
            writer.write(head + b"content-length: 100000\r\n\r\n" + b'{"model": "')
        deadline = time.monotonic() + self.hold_s
        sent = 0
        while time.monotonic() < deadline and not self._stop.is_set():
            if kind == "slow_headers" and sent < len(head):
                writer.write(head[sent : sent + 1])  # never reaches the blank line
                sent += 1
            try:
                await writer.drain()
                got = await asyncio.wait_for(reader.read(4096), timeout=0.5)
            except TimeoutError:
                continue
            except OSError:
                return True
            if not got:  # EOF: the server closed it (an answer, e.g. 408, may come first)
                return True
        return False


class StreamedText:
    """A streamed completion's text, fed its SSE lines (`line` is True at `[DONE]`); `text()`
    raises httpx.RemoteProtocolError when the stream ended without it."""

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.done = False

    def line(self, line: str) -> bool:
        if not line.startswith("data: "):
            return False
        data = line.removeprefix("data: ")
        if data == "[DONE]":
            self.done = True
        else:
            self.parts.append(json.loads(data)["choices"][0]["text"])
        return self.done

    def text(self) -> str:
        if not self.done:
            raise httpx.RemoteProtocolError("the stream ended without [DONE]")
        return "".join(self.parts)


async def _attempt(
    gw: httpx.AsyncClient, body: dict[str, Any], stream: bool
) -> tuple[int, str, str]:
    """One HTTP attempt: (status, the generated text or the error body, Retry-After)."""
    if not stream:
        r = await gw.post("/v1/completions", json=body)
        text = r.json()["choices"][0]["text"] if r.status_code == 200 else r.text
        return r.status_code, text, r.headers.get("retry-after", "")
    async with gw.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            return r.status_code, r.text, r.headers.get("retry-after", "")
        streamed = StreamedText()
        async for line in r.aiter_lines():
            if streamed.line(line):
                break
        return 200, streamed.text(), ""
