"""The `hotswap` command: argument parsing into Settings, and the client commands against a
live sidecar (uvicorn in a thread, engines faked), and `serve` as a real process."""

from __future__ import annotations

import asyncio
import gc
import io
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from prometheus_client import CollectorRegistry
from support.fakevllm import FakeVllm

from controller import cli, client, server
from controller.config.modelsettings import ModelSettings
from controller.config.settings import LogFormat, Settings, TimeoutSettings
from controller.engines.engine import EngineClient
from controller.engines.sockets import free_port
from controller.errors import EngineStartError
from controller.sidecar import Sidecar

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """The developer's own HOTSWAP_* variables must not leak into these tests."""
    for key in list(os.environ):
        if key.startswith("HOTSWAP_"):
            monkeypatch.delenv(key)


@pytest.fixture(autouse=True)
def restore_logging() -> Iterator[None]:
    """`serve` installs a root handler on the captured stderr; take it away afterwards."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(h)
    root.setLevel(level)


def serve_settings(*argv: str) -> Settings:
    args = cli.build_parser().parse_args(["serve", *argv])
    return cli.settings_from_args(args)


# ----------------------------------------------------------------------------- serve arguments


def test_serve_flags_become_settings() -> None:
    s = serve_settings(
        *("--host", "0.0.0.0", "--port", "9001", "--token", "tok"),
        *("--log-format", "json", "--log-level", "DEBUG"),
        *("--engine", "a=http://127.0.0.1:8001/", "--engine", "b=http://127.0.0.1:8002"),
    )
    assert (s.server.host, s.server.port) == ("0.0.0.0", 9001)
    assert s.auth.token is not None
    assert s.auth.token.get_secret_value() == "tok"
    assert (s.log.format, s.log.level) == (LogFormat.JSON, "DEBUG")
    assert [(m.name, m.url) for m in s.models] == [
        ("a", "http://127.0.0.1:8001"),
        ("b", "http://127.0.0.1:8002"),
    ]


def test_serve_defaults_without_flags() -> None:
    s = serve_settings()
    assert (s.server.host, s.server.port, s.auth.token, s.models) == ("127.0.0.1", 8800, None, [])


def test_env_twins_and_flags_win(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOTSWAP_SERVER__PORT", "9100")
    monkeypatch.setenv("HOTSWAP_SERVER__HOST", "127.0.0.2")
    monkeypatch.setenv("HOTSWAP_LOG__FORMAT", "json")
    monkeypatch.setenv("HOTSWAP_AUTH__TOKEN", "from-env")
    monkeypatch.setenv("HOTSWAP_ENGINES", "x=http://127.0.0.1:7001, y=http://127.0.0.1:7002")
    s = serve_settings()
    assert (s.server.host, s.server.port, s.log.format) == ("127.0.0.2", 9100, LogFormat.JSON)
    assert s.auth.token is not None
    assert s.auth.token.get_secret_value() == "from-env"
    assert [m.name for m in s.models] == ["x", "y"]
    s = serve_settings("--port", "9200", "--token", "cli", "--engine", "z=http://127.0.0.1:7003")
    # The flag wins; the untouched sibling field still comes from the environment.
    assert (s.server.host, s.server.port) == ("127.0.0.2", 9200)
    assert s.auth.token is not None
    assert s.auth.token.get_secret_value() == "cli"
    assert [m.name for m in s.models] == ["z"]


def test_config_file_and_engine_replaces_its_models(tmp_path: Path) -> None:
    cfg = tmp_path / "models.yaml"
    cfg.write_text(
        "server: {port: 8900}\n"
        "models:\n"
        "  - {name: big, url: 'http://127.0.0.1:8101', default_level: 2, gate: swappable}\n"
    )
    s = serve_settings("--config", str(cfg))
    assert s.server.port == 8900
    assert [(m.name, m.default_level, m.gate.value) for m in s.models] == [("big", 2, "swappable")]
    s = serve_settings("--config", str(cfg), "--engine", "small=http://127.0.0.1:8102")
    assert s.server.port == 8900
    assert [m.name for m in s.models] == ["small"]


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        ("noequals", "expected NAME=URL"),
        ("a=", "expected NAME=URL"),
        ("=http://127.0.0.1:1", "expected NAME=URL"),
        ("a=127.0.0.1:8001", "http://"),
        ("bad name!=http://127.0.0.1:1", "pattern"),
    ],
)
def test_bad_engine_is_a_clear_error(
    spec: str, why: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(cli.CliError, match=why):
        cli.parse_engine(spec)
    assert cli.main(["serve", "--engine", spec]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert err.startswith("hotswap: --engine")
    assert spec in err
    assert "Traceback" not in err


def test_duplicate_engines_and_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["serve", "--engine", "a=http://127.0.0.1:1", "--engine", "a=http://127.0.0.1:2"]
    assert cli.main(argv) == cli.EXIT_USAGE
    assert "duplicate model names: a" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        cli.main(["serve", "--log-format", "xml"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit):
        cli.main(["sleep", "a", "--level", "3"])


# ----------------------------------------------------------------------------- client commands


class LiveSidecar:
    """The real app on 127.0.0.1 (uvicorn in a thread), engines faked."""

    def __init__(
        self,
        fakes: dict[str, FakeVllm],
        token: str | None = None,
        swap: dict[str, object] | None = None,
    ) -> None:
        self.fakes = fakes
        self.settings = Settings(
            models=[
                ModelSettings.model_validate({"name": n, "url": f"http://{n}.test"}) for n in fakes
            ],
            auth={"token": token},
            timeouts=TimeoutSettings(shutdown_s=2.0),
            swap=swap or {},
        )
        registry = CollectorRegistry()

        def factory(m: ModelSettings, timeouts: TimeoutSettings) -> EngineClient:
            return EngineClient(m.url, transport=fakes[m.name].transport(), timeouts=timeouts)

        app = Sidecar(self.settings, registry=registry, engine_factory=factory).app
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="live-sidecar", daemon=True)

    def __enter__(self) -> LiveSidecar:
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started:
            assert self.thread.is_alive(), "the sidecar thread died while starting"
            assert time.monotonic() < deadline, "the sidecar did not start"
            time.sleep(0.01)
        port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=20)
        assert not self.thread.is_alive()

    def hotswap(self, *argv: str, url: bool = True) -> tuple[int, str]:
        out = io.StringIO()
        extra = ["--url", self.url] if url else []
        code = cli.main([*argv, *extra], out=out)
        return code, out.getvalue()

    def state(self, name: str) -> str:
        headers = {}
        if self.settings.auth.token is not None:
            headers["Authorization"] = f"Bearer {self.settings.auth.token.get_secret_value()}"
        state: str = httpx.get(f"{self.url}/models/{name}", headers=headers).json()["state"]
        return state


@pytest.fixture
def live() -> Iterator[LiveSidecar]:
    with LiveSidecar({"a": FakeVllm(name="a"), "b": FakeVllm(name="b")}) as sidecar:
        yield sidecar


def wait_for(sidecar: LiveSidecar, name: str, state: str, limit_s: float = 10) -> None:
    deadline = time.monotonic() + limit_s
    while sidecar.state(name) != state:
        assert time.monotonic() < deadline, f"{name} never reached {state}"
        time.sleep(0.02)


def test_status_sleep_wake(live: LiveSidecar) -> None:
    code, out = live.hotswap("status")
    assert code == 0, out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["MODEL", "STATE", "LEVEL"]
    rows = {line.split()[0]: line.split() for line in lines[1:3]}
    assert rows["a"][1] == "RUNNING"
    assert rows["b"][1] == "RUNNING"
    assert lines[-1] == "sidecar ready: yes"

    code, out = live.hotswap("sleep", "a", "--level", "2", "--drain", "abort")
    assert code == 0, out
    assert out.startswith("a: SUSPENDED: sleep done in ")
    assert "suspend" in out
    assert "ranks=2" in out
    assert "ranks=0" not in out, "an engine step (/pause) reports no ranks: none is shown"
    assert live.fakes["a"].level == 2
    assert "/pause?abort" in live.fakes["a"].calls

    code, out = live.hotswap("status")
    row = next(line.split() for line in out.splitlines() if line.startswith("a "))
    assert row[1:5] == ["SUSPENDED", "2", "no", "no"]
    assert "sleep done in" in out
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", row[5]), "SINCE reads as UTC"
    assert out.splitlines()[-1] == "sidecar ready: no"

    code, out = live.hotswap("wake", "a", "--no-wait")
    assert code == 0, out
    assert out.startswith("a: accepted")
    assert f"poll {live.url}/models/a" in out
    wait_for(live, "a", "RUNNING")
    code, out = live.hotswap("wake", "a")
    assert (code, out.strip()) == (0, "a: RUNNING: nothing to do")


def test_wake_shows_the_eviction_it_caused_and_no_evict_refuses(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """One awake model at a time: a wake of b puts a to sleep, and says so (the policy's
    decision, what it evicted); --no-evict is refused with the reason; --keep-prefix-cache
    reaches the sleep."""
    fakes = {"a": FakeVllm(name="a"), "b": FakeVllm(name="b")}
    with LiveSidecar(fakes, swap={"max_awake": 1, "min_awake_s": 0}) as live:
        code, out = live.hotswap("sleep", "b", "--level", "1", "--keep-prefix-cache")
        assert code == 0, out
        assert fakes["b"].suspended["kv_cache"] == "offloaded", "the sleep kept the KV cache"
        code, out = live.hotswap("wake", "b", "--no-evict")
        assert code == cli.EXIT_HTTP_ERROR
        assert "HTTP 409: WakeRefused" in capsys.readouterr().err
        assert live.state("b") == "SUSPENDED"
        code, out = live.hotswap("wake", "b")
        assert code == 0, out
        lines = out.splitlines()
        assert lines[0].startswith("b: RUNNING: wake done in "), out
        assert lines[1].startswith("  policy: evict: "), out
        assert lines[2].startswith("  evicted a in "), out
        assert live.state("a") == "SUSPENDED"


def test_outcome_lines_name_the_action_and_the_ranks() -> None:
    phases = [
        {"name": "pause", "duration_s": 0.01, "ok": True, "ranks": []},
        {"name": "wake", "duration_s": 0.5, "ok": True, "ranks": [{"rank": 0}, {"rank": 1}]},
    ]
    t = {"kind": "wake", "result": "ok", "duration_s": 0.51, "phases": phases}
    body = {"model": "m", "state": "RUNNING", "action": "join", "transition": t}
    text = client.format_outcome(body)
    assert text.splitlines()[0] == "m: RUNNING: joined the wake done in 0.510 s"
    assert "  pause " in text
    assert "ranks=2" in text
    assert "ranks=0" not in text


def test_sleep_drain_timeout_flag_and_no_wait(
    live: LiveSidecar, capsys: pytest.CaptureFixture[str]
) -> None:
    live.fakes["b"].fail["/pause"] = "timeout"
    code, out = live.hotswap("sleep", "b", "--drain-timeout", "0.05")
    assert (code, out) == (cli.EXIT_HTTP_ERROR, "")
    err = capsys.readouterr().err
    assert "HTTP 504" in err
    assert "DrainTimeout" in err
    assert "within 0.05 s" in err, "the flag's timeout reached the manager"
    assert live.state("b") == "RUNNING"
    del live.fakes["b"].fail["/pause"]
    code, out = live.hotswap("sleep", "b", "--no-wait")
    assert code == 0
    assert out.startswith("b: accepted")
    wait_for(live, "b", "SUSPENDED")


def test_http_errors_exit_non_zero_with_reason(
    live: LiveSidecar, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _ = live.hotswap("sleep", "nope")
    assert code == cli.EXIT_HTTP_ERROR
    err = capsys.readouterr().err
    assert "HTTP 404" in err
    assert "ModelNotFound" in err
    assert "nope" in err

    live.fakes["a"].fail["hotswap_suspend"] = "rank"
    code, _ = live.hotswap("sleep", "a")
    assert code == cli.EXIT_HTTP_ERROR
    err = capsys.readouterr().err
    assert "HTTP 502" in err
    assert "fake hotswap_sleep failed" in err  # the fused sleep's suspend part failed
    code, _ = live.hotswap("wake", "a")
    assert code == cli.EXIT_HTTP_ERROR
    assert "HTTP 409" in capsys.readouterr().err


def test_token_flag_and_env(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    with LiveSidecar({"a": FakeVllm(name="a")}, token="t0k") as live:
        code, _ = live.hotswap("status")
        assert code == cli.EXIT_HTTP_ERROR
        assert "HTTP 401" in capsys.readouterr().err
        code, _ = live.hotswap("status", "--token", "wrong")
        assert code == cli.EXIT_HTTP_ERROR
        code, out = live.hotswap("status", "--token", "t0k")
        assert code == 0, out
        monkeypatch.setenv("HOTSWAP_TOKEN", "t0k")
        monkeypatch.setenv("HOTSWAP_URL", live.url)
        code, out = live.hotswap("status", url=False)
        assert code == 0, out
        assert "RUNNING" in out


def test_unreachable_sidecar(capsys: pytest.CaptureFixture[str]) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    assert cli.main(["status", "--url", url, "--timeout", "5"]) == cli.EXIT_UNREACHABLE
    assert "no answer from the sidecar" in capsys.readouterr().err


# ----------------------------------------------------------------------------- serve, for real


def test_serve_process_answers_and_stops_on_sigterm(tmp_path: Path) -> None:
    """`python -m controller serve`: JSON logs, the API up, SIGTERM -> graceful exit 143."""
    port, engine_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("HOTSWAP_")}
    env["HOTSWAP_AUTH__TOKEN"] = "env-token"
    env["PYTHONPATH"] = str(REPO)
    argv = [
        *(sys.executable, "-m", "controller", "serve", "--port", str(port)),
        *("--engine", f"gone=http://127.0.0.1:{engine_port}", "--log-format", "json"),
    ]
    log_path = tmp_path / "serve.log"
    with log_path.open("w") as log_file:
        proc = subprocess.Popen(argv, env=env, stdout=log_file, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert proc.poll() is None, log_path.read_text()
            assert time.monotonic() < deadline, log_path.read_text()
            try:
                r = httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.1)
        # The engine's port is closed: probed FAILED, so not ready.
        assert r.status_code == 503
        assert r.json()["models"]["gone"]["state"] == "FAILED"
        r = httpx.get(f"http://127.0.0.1:{port}/models")
        assert r.status_code == 401  # the token came from the environment twin
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    lines = [json.loads(line) for line in log_path.read_text().splitlines() if line.strip()]
    messages = [entry["msg"] for entry in lines]
    assert any("manager stopped" in m for m in messages), messages
    failed: list[dict[str, Any]] = [e for e in lines if e.get("model") == "gone"]
    assert failed, "the manager's lines carry the model"


def test_a_full_collection_in_the_serving_process_skips_its_start_up_objects() -> None:
    """`hotswap serve` settles its heap before serving (server.settle_heap): what is alive
    then stays for good, so the cyclic collector's full passes no longer walk it. Each pass
    walked the whole heap, holding the event loop tens of milliseconds of CPU (72 ms in the
    soak's loop profile); here 200,000 long-lived objects cost a full pass its time before,
    and next to nothing after."""
    kept: list[dict[str, object]] = [{"n": i} for i in range(200_000)]
    for entry in kept:
        entry["self"] = entry  # containers the collector tracks, as a process's are

    def full_pass() -> float:
        t0 = time.thread_time()
        gc.collect()
        return time.thread_time() - t0

    try:
        before = full_pass()
        frozen = server.settle_heap()
        after = full_pass()
    finally:
        gc.unfreeze()
    assert frozen >= len(kept)
    assert after < before / 4, f"a full pass: {before * 1000:.1f} ms, then {after * 1000:.1f} ms"


def test_demo_without_its_module_is_a_clear_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "controller.demo", None)  # import now fails
    assert cli.main(["serve", "--demo", "--port", "0"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "--demo needs controller.demo" in err
    assert "Traceback" not in err


def test_demo_models_replace_configured_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    """--demo serves the embedded default's tiny models under managed mode behind the
    gateway, with a budget of one awake model and swappable gates."""
    from controller import demo as demo_module

    seen: dict[str, Any] = {}
    demo = [
        ModelSettings.model_validate({"name": n, "command": ["engine", n]})
        for n in ("tiny-a", "tiny-b")
    ]

    async def fake_demo(workdir: Path) -> list[ModelSettings]:
        seen["workdir"] = workdir
        return demo

    async def fake_run(settings: Settings) -> int:
        seen["models"] = [m.name for m in settings.models]
        seen["gates"] = {m.gate.value for m in settings.models}
        seen["gateway"] = settings.gateway_enabled
        seen["max_awake"] = settings.swap.max_awake
        seen["log_dir"] = settings.supervisor.log_dir
        return 0

    monkeypatch.setattr(demo_module, "demo_models", fake_demo)
    monkeypatch.setattr(server, "run_server", fake_run)
    settings = serve_settings("--engine", "mine=http://127.0.0.1:8001")
    assert asyncio.run(server.serve(settings, True, Path("demo-dir"))) == 0
    assert seen == {
        "workdir": Path("demo-dir"),
        "models": ["tiny-a", "tiny-b"],
        "gates": {"swappable"},
        "gateway": True,
        "max_awake": 1,
        "log_dir": Path("demo-dir") / "logs",
    }


def test_demo_engine_start_failure_is_reported(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:

    from controller import demo

    async def broken_demo(workdir: Path) -> list[ModelSettings]:
        raise EngineStartError("tiny-a exited with 1: no extension")

    monkeypatch.setattr(demo, "demo_models", broken_demo)
    assert cli.main(["serve", "--demo"]) == cli.EXIT_STARTUP
    err = capsys.readouterr().err
    assert "EngineStartError: tiny-a exited with 1" in err
    assert "Traceback" not in err


# ----------------------------------------------------------------------------- config errors


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("models:\n  - name: a\n    url: [http://x\n", ":4:1:"),  # an unclosed flow sequence
        ("models:\n\t- name: a\n", ":2:1:"),  # a tab where YAML wants spaces
        ("models: {name: a\n", ":2:1:"),
    ],
)
def test_a_malformed_models_file_is_one_line_with_its_position_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, where: str
) -> None:
    """The issue: a models file that is not YAML printed a 65-line traceback and exited 1."""
    path = tmp_path / "models.yaml"
    path.write_text(text)
    assert cli.main(["serve", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"{path}{where}" in err
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "url",
    ["ftp://engine:8000", "file:///tmp/x", "unix:/tmp/engine.sock", "localhost:8000", "http://"],
)
def test_an_engine_url_that_is_not_http_is_refused_at_load(tmp_path: Path, url: str) -> None:
    """The issue: any scheme loaded, and failed only at the first request to the engine."""
    path = tmp_path / "models.yaml"
    path.write_text(json.dumps({"models": [{"name": "a", "url": url}]}))
    with pytest.raises(cli.CliError) as refused:
        serve_settings("--config", str(path))
    assert "\n" not in str(refused.value)
    assert "models.0.url" in str(refused.value)
    assert "http://HOST" in str(refused.value)
    for ok in ("http://127.0.0.1:8000", "https://engine.example", "http://[::1]:8000/"):
        assert ModelSettings(name="a", url=ok).url == ok.rstrip("/")
