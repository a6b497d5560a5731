"""The `hotswap` command: `serve` runs the sidecar; `status`, `sleep`, `wake` talk to one.

Every flag has an environment twin. `serve` flags map onto Settings fields, so their twins
are the settings' own variables (HOTSWAP_SERVER__PORT, ...); the client commands read
HOTSWAP_URL, HOTSWAP_TOKEN and HOTSWAP_CLIENT_TIMEOUT. A flag given on the command line
always wins over its twin.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any, TextIO

import httpx
import uvicorn
from pydantic import ValidationError

from controller.errors import HotswapError
from controller.logs import configure_logging
from controller.settings import LogFormat, ModelSettings, Settings, load_settings
from controller.sidecar import Sidecar

log = logging.getLogger("hotswap.cli")

DEFAULT_URL = "http://127.0.0.1:8800"
# A wait=true sleep or wake can legitimately take minutes (a level-2 reload reads a checkpoint).
DEFAULT_CLIENT_TIMEOUT_S = 900.0

EXIT_OK = 0
EXIT_HTTP_ERROR = 1  # the sidecar answered with an error status
EXIT_USAGE = 2  # bad arguments or configuration (argparse uses 2 as well)
EXIT_UNREACHABLE = 3  # no answer from the sidecar
EXIT_STARTUP = 4  # serve: the app did not start (port taken, lifespan failed)


class CliError(Exception):
    """A problem with the command line or configuration, reported without a traceback."""


# ----------------------------------------------------------------------------- parsing


def parse_engine(spec: str) -> ModelSettings:
    """`NAME=URL` (one attached engine) -> ModelSettings; CliError with the reason otherwise."""
    name, sep, url = spec.partition("=")
    name, url = name.strip(), url.strip()
    if not sep or not name or not url:
        raise CliError(f"--engine {spec!r}: expected NAME=URL, e.g. chat=http://127.0.0.1:8001")
    if not url.startswith(("http://", "https://")):
        raise CliError(f"--engine {spec!r}: the URL must start with http:// or https://")
    try:
        return ModelSettings.model_validate({"name": name, "url": url})
    except ValidationError as exc:
        reasons = "; ".join(str(e["msg"]) for e in exc.errors())
        raise CliError(f"--engine {spec!r}: {reasons}") from None


def _env_engines() -> list[str]:
    """HOTSWAP_ENGINES, the twin of repeated --engine: NAME=URL entries, comma-separated."""
    raw = os.environ.get("HOTSWAP_ENGINES", "")
    return [part.strip() for part in raw.split(",") if part.strip()]


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError:
        raise CliError(f"{name}={raw!r} is not a number") from None


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hotswap", description="Sidecar that sleeps and wakes vLLM servers, verified."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the sidecar")
    serve.add_argument(
        "--config", type=Path, help="YAML models file (env: HOTSWAP_CONFIG_FILE)", metavar="PATH"
    )
    serve.add_argument(
        "--engine",
        action="append",
        default=None,
        metavar="NAME=URL",
        help="attach an engine started elsewhere; repeatable; replaces the file's models "
        "(env: HOTSWAP_ENGINES, comma-separated)",
    )
    serve.add_argument("--host", help="bind address (env: HOTSWAP_SERVER__HOST)")
    serve.add_argument(
        "--port", type=int, help="bind port, 0 = any free (env: HOTSWAP_SERVER__PORT)"
    )
    serve.add_argument(
        "--token", help="bearer token for control endpoints (env: HOTSWAP_AUTH__TOKEN)"
    )
    serve.add_argument(
        "--token-file",
        type=Path,
        metavar="PATH",
        help="read the token from a file, e.g. a mounted Secret (env: HOTSWAP_AUTH__TOKEN_FILE)",
    )
    serve.add_argument(
        "--insecure",
        action="store_true",
        default=None,
        help="allow a non-loopback bind without a token: anyone can sleep and wake models "
        "(env: HOTSWAP_SERVER__INSECURE=1)",
    )
    serve.add_argument(
        "--log-format",
        choices=[f.value for f in LogFormat],
        help="text or json (env: HOTSWAP_LOG__FORMAT)",
    )
    serve.add_argument("--log-level", help="root log level, e.g. DEBUG (env: HOTSWAP_LOG__LEVEL)")
    serve.add_argument(
        "--demo",
        action="store_true",
        default=None,
        help="start tiny models on CPU vLLM servers and manage them (env: HOTSWAP_DEMO=1)",
    )
    serve.add_argument(
        "--demo-dir", type=Path, metavar="PATH", help="work dir of --demo (env: HOTSWAP_DEMO_DIR)"
    )

    def client(p: argparse.ArgumentParser) -> None:
        p.add_argument("--url", help=f"sidecar URL (env: HOTSWAP_URL; default {DEFAULT_URL})")
        p.add_argument("--token", help="bearer token (env: HOTSWAP_TOKEN)")
        p.add_argument(
            "--timeout",
            type=float,
            help=f"seconds to wait for an answer (env: HOTSWAP_CLIENT_TIMEOUT; "
            f"default {DEFAULT_CLIENT_TIMEOUT_S:g})",
        )

    status = sub.add_parser("status", help="one line per model")
    client(status)

    sleep = sub.add_parser("sleep", help="put a model to sleep")
    sleep.add_argument("name")
    sleep.add_argument("--level", type=int, choices=[1, 2], help="default: the model's own")
    sleep.add_argument("--drain", choices=["wait", "abort"], help="default: wait")
    sleep.add_argument(
        "--drain-timeout", type=float, metavar="S", help="seconds; default: the sidecar's"
    )
    sleep.add_argument("--no-wait", action="store_true", help="return at once (202)")
    client(sleep)

    wake = sub.add_parser("wake", help="wake a model")
    wake.add_argument("name")
    wake.add_argument("--no-wait", action="store_true", help="return at once (202)")
    client(wake)
    return parser


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from env/file with the given `serve` flags on top (None = not given)."""
    overrides: dict[str, Any] = {}
    if args.config is not None:
        overrides["config_file"] = args.config
    given = (("host", args.host), ("port", args.port), ("insecure", args.insecure))
    server = {k: v for k, v in given if v is not None}
    if server:
        overrides["server"] = server
    auth = {k: v for k, v in (("token", args.token), ("token_file", args.token_file)) if v}
    if auth:
        overrides["auth"] = auth
    log_cfg = {k: v for k, v in (("format", args.log_format), ("level", args.log_level)) if v}
    if log_cfg:
        overrides["log"] = log_cfg
    specs = args.engine if args.engine is not None else _env_engines()
    if specs:
        engines = [parse_engine(s) for s in specs]
        overrides["models"] = [m.model_dump() for m in engines]
    try:
        return load_settings(**overrides)
    except ValidationError as exc:
        raise CliError(f"invalid settings:\n{exc}") from None
    except (OSError, ValueError) as exc:
        raise CliError(f"invalid settings: {exc}") from None


# ----------------------------------------------------------------------------- serve


class _Server(uvicorn.Server):
    """uvicorn's server, except that a signal only sets the exit flag.

    uvicorn re-raises a captured SIGTERM after serving, which would kill the process before
    the demo engines are stopped; here the caller shuts everything down and picks the code.
    """

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.signals: list[int] = []

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield  # signals can only be handled on the main thread
            return
        handled = (signal.SIGINT, signal.SIGTERM)
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in handled}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        self.signals.append(sig)
        super().handle_exit(sig, frame)


class _GatewayServer(uvicorn.Server):
    """The gateway's server: it follows the control API's, which alone handles signals."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def run_server(settings: Settings) -> int:
    """Serve until a signal; the app's lifespan starts and stops the manager (and, in
    managed mode, the engines). With the gateway on, it is served next to it, on its port."""
    side = Sidecar(settings)
    app = side.app
    gateway: _GatewayServer | None = None
    if side.gateway_app is not None:
        gw_app = side.gateway_app
        gateway = _GatewayServer(
            uvicorn.Config(
                gw_app,
                host=settings.gateway.host,
                port=settings.gateway.port,
                log_config=None,
                lifespan="on",
                timeout_graceful_shutdown=math.ceil(settings.timeouts.shutdown_s),
            )
        )
    config = uvicorn.Config(
        app,
        host=settings.server.host,
        port=settings.server.port,
        log_config=None,  # our root handler formats uvicorn's lines too
        lifespan="on",
        timeout_graceful_shutdown=math.ceil(settings.timeouts.shutdown_s),
    )
    server = _Server(config)
    if gateway is None:
        await server.serve()
    else:
        gw_task = asyncio.create_task(_serve_gateway(gateway, server), name="hotswap-gateway")
        try:
            await server.serve()
        finally:
            gateway.should_exit = True
            await gw_task
        if not gateway.started:
            return EXIT_STARTUP
    if server.signals:
        return 128 + server.signals[0]  # the shell's convention for "ended by signal N"
    return EXIT_OK if server.started else EXIT_STARTUP


async def _serve_gateway(gateway: uvicorn.Server, control: uvicorn.Server) -> None:
    """Run the gateway; if it cannot start (port taken), stop the control API too."""
    try:
        await gateway.serve()
    except (SystemExit, OSError) as exc:  # uvicorn exits when it cannot bind
        log.error("the gateway did not start: %s", exc)
    if not gateway.started:
        control.should_exit = True


def demo_settings(settings: Settings, models: list[ModelSettings], workdir: Path) -> Settings:
    """The embedded default: managed engines behind the gateway, a budget of one awake
    model (unless one is configured), engine logs in the demo's work dir."""
    data = settings.model_dump()
    data["models"] = [m.model_dump(exclude_unset=True) for m in models]
    if settings.swap.budget_bytes is None and settings.swap.max_awake is None:
        data["swap"]["max_awake"] = 1
    if settings.supervisor.log_dir is None:
        data["supervisor"]["log_dir"] = workdir / "logs"
    return Settings.model_validate(data)


async def serve(settings: Settings, demo: bool, demo_dir: Path | None) -> int:
    if not demo:
        return await run_server(settings)
    try:
        from controller.launcher import demo_models  # only for --demo
    except ImportError as exc:
        raise CliError(f"--demo needs controller.launcher, which is not available: {exc}") from exc
    own = demo_dir is None
    workdir = Path(tempfile.mkdtemp(prefix="hotswap-demo-")) if demo_dir is None else demo_dir
    try:
        models = await demo_models(workdir)
        return await run_server(demo_settings(settings, models, workdir))
    finally:
        if own:
            shutil.rmtree(workdir, ignore_errors=True)


def refuse_open_binds(settings: Settings) -> None:
    """No open door by default: a non-loopback bind without a token needs --insecure."""
    binds = settings.open_binds()
    if binds:
        raise CliError(
            f"refusing to serve {' and '.join(binds)} without a token (anyone could sleep "
            "and wake models): set --token-file/--token (HOTSWAP_AUTH__TOKEN_FILE, "
            "HOTSWAP_AUTH__TOKEN), bind 127.0.0.1, or pass --insecure (HOTSWAP_SERVER__INSECURE=1)"
        )


def cmd_serve(args: argparse.Namespace) -> int:
    settings = settings_from_args(args)
    refuse_open_binds(settings)
    configure_logging(settings.log)
    demo = args.demo if args.demo is not None else _env_flag("HOTSWAP_DEMO")
    demo_dir = args.demo_dir
    if demo_dir is None and os.environ.get("HOTSWAP_DEMO_DIR"):
        demo_dir = Path(os.environ["HOTSWAP_DEMO_DIR"])
    if demo and settings.models:
        log.warning("--demo: ignoring the %d configured model(s)", len(settings.models))
    if not demo and not settings.models:
        log.warning("no models configured: give --config, --engine or --demo")
    try:
        return asyncio.run(serve(settings, demo, demo_dir))
    except KeyboardInterrupt:
        return 128 + signal.SIGINT


# ----------------------------------------------------------------------------- client


class ClientOptions:
    def __init__(self, args: argparse.Namespace) -> None:
        self.url = (args.url or os.environ.get("HOTSWAP_URL") or DEFAULT_URL).rstrip("/")
        self.token = args.token if args.token is not None else os.environ.get("HOTSWAP_TOKEN")
        if args.timeout is not None:
            self.timeout = args.timeout
        else:
            self.timeout = _env_float("HOTSWAP_CLIENT_TIMEOUT", DEFAULT_CLIENT_TIMEOUT_S)

    def client(self) -> httpx.Client:
        headers = {"Authorization": f"Bearer {self.token}"} if self.token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=self.timeout)


class HttpFailure(Exception):
    def __init__(self, status: int, reason: str) -> None:
        super().__init__(f"HTTP {status}: {reason}")
        self.status = status
        self.reason = reason


def _check(resp: httpx.Response, ok: tuple[int, ...] = (200, 202)) -> dict[str, Any]:
    try:
        body = resp.json()
    except ValueError:
        body = None
    if resp.status_code not in ok:
        if isinstance(body, dict) and "message" in body:
            extra = {k: v for k, v in body.items() if k not in ("error", "message", "details")}
            reason = f"{body.get('error', 'error')}: {body['message']}"
            if extra:
                reason += " (" + ", ".join(f"{k}={v}" for k, v in extra.items()) + ")"
        else:
            reason = resp.text.strip()[:500] or resp.reason_phrase
        raise HttpFailure(resp.status_code, reason)
    if not isinstance(body, dict):
        raise HttpFailure(resp.status_code, "the answer is not a JSON object")
    return body


def _fmt_time(ts: Any) -> str:
    if not isinstance(ts, int | float):
        return "-"
    return datetime.fromtimestamp(ts, tz=UTC).strftime("%Y-%m-%d %H:%M:%SZ")


def _fmt_transition(t: Any) -> str:
    if not isinstance(t, dict):
        return "-"
    text = f"{t.get('kind')} {t.get('result')} in {t.get('duration_s', 0.0):.3f}s"
    if t.get("error"):
        text += f" ({t.get('failed_phase') or '?'}: {t['error']})"
    return text


def format_status(models: list[dict[str, Any]], health: dict[str, Any] | None) -> str:
    header = ("MODEL", "STATE", "LEVEL", "VERIFIED", "READY", "SINCE", "LAST TRANSITION")
    rows = [header]
    for m in models:
        level = m.get("level")
        rows.append(
            (
                str(m.get("name")),
                str(m.get("state")),
                str(level) if level is not None else "-",
                "yes" if m.get("verified") else "no",
                "yes" if m.get("ready") else "no",
                _fmt_time(m.get("since")),
                _fmt_transition(m.get("last_transition")),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(header) - 1)]
    lines = [
        "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        for r in rows
    ]
    if health is not None:
        lines.append(f"sidecar ready: {'yes' if health.get('ready') else 'no'}")
    return "\n".join(lines)


def format_outcome(body: dict[str, Any]) -> str:
    lines = [
        f"{body.get('model')}: {body.get('state')} (action {body.get('action')})",
    ]
    t = body.get("transition")
    if isinstance(t, dict):
        lines[0] += f", {_fmt_transition(t)}"
        for p in t.get("phases") or []:
            mark = "ok" if p.get("ok") else "FAILED"
            ranks = len(p.get("ranks") or [])
            lines.append(
                f"  {p.get('name'):<20} {p.get('duration_s', 0.0):8.3f}s  {mark}  ranks={ranks}"
            )
    return "\n".join(lines)


def cmd_status(args: argparse.Namespace, out: TextIO) -> int:
    opts = ClientOptions(args)
    with opts.client() as client:
        models = _check(client.get("/models"), ok=(200,))
        health = _check(client.get("/health"), ok=(200, 503))
    out.write(format_status(list(models.get("models") or []), health) + "\n")
    return EXIT_OK


def cmd_transition(args: argparse.Namespace, out: TextIO) -> int:
    opts = ClientOptions(args)
    params = {"wait": "false" if args.no_wait else "true"}
    body: dict[str, Any] | None = None
    if args.command == "sleep":
        body = {}
        if args.level is not None:
            body["level"] = args.level
        if args.drain is not None:
            body["drain"] = args.drain
        if args.drain_timeout is not None:
            body["drain_timeout_s"] = args.drain_timeout
    with opts.client() as client:
        resp = client.post(f"/models/{args.name}/{args.command}", params=params, json=body)
    answer = _check(resp)
    if resp.status_code == 202:
        where = resp.headers.get("location", f"/models/{args.name}")
        out.write(f"{args.name}: accepted ({answer.get('state')}); poll {opts.url}{where}\n")
    else:
        out.write(format_outcome(answer) + "\n")
    return EXIT_OK


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    stream = out if out is not None else sys.stdout
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "serve":
            return cmd_serve(args)
        if args.command == "status":
            return cmd_status(args, stream)
        return cmd_transition(args, stream)
    except CliError as exc:
        print(f"hotswap: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except HotswapError as exc:  # serve: e.g. a demo engine that would not start
        print(f"hotswap: {type(exc).__name__}: {exc.message}", file=sys.stderr)
        return EXIT_STARTUP
    except HttpFailure as exc:
        print(f"hotswap: {exc}", file=sys.stderr)
        return EXIT_HTTP_ERROR
    except httpx.HTTPError as exc:
        print(f"hotswap: no answer from the sidecar: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE


if __name__ == "__main__":
    sys.exit(main())
