"""The `hotswap` command line: `serve` runs the sidecar (controller.server); `status`,
`sleep`, `wake` talk to one (controller.client).

Every flag has an environment twin. `serve` flags map onto Settings fields, so their twins
are the settings' own variables (HOTSWAP_SERVER__PORT, ...); the client commands' twins are
controller.client.ClientSettings (HOTSWAP_URL, HOTSWAP_TOKEN, HOTSWAP_CLIENT_TIMEOUT). A
flag given on the command line always wins over its twin.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import httpx
from pydantic import ValidationError

from controller.client import (
    DEFAULT_CLIENT_TIMEOUT_S,
    DEFAULT_URL,
    HttpFailure,
    cmd_status,
    cmd_transition,
)
from controller.config.modelsettings import ModelSettings
from controller.config.settings import LogFormat, Settings, load_settings
from controller.errors import (
    EXIT_HTTP_ERROR,
    EXIT_OK,
    EXIT_STARTUP,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CliError,
    HotswapError,
)
from controller.observe.logs import configure_logging
from controller.server import serve

__all__ = ["EXIT_OK", "CliError", "build_parser", "main", "parse_engine", "settings_from_args"]

log = logging.getLogger("hotswap.cli")

# A token given as a flag is in the process's argv: `ps` shows it to every local user.
TOKEN_IN_ARGV = (
    "%s on the command line shows in `ps` to every user of this machine: use %s "
    "(a file, or the environment) instead"
)


# ----------------------------------------------------------------------------- parsing


def parse_engine(spec: str) -> ModelSettings:
    """`NAME=URL` or `NAME=unix:PATH` (one attached engine, on TCP or on vLLM's `--uds`
    socket) -> ModelSettings; CliError with the reason otherwise."""
    name, sep, url = spec.partition("=")
    name, url = name.strip(), url.strip()
    if not sep or not name or not url:
        raise CliError(f"--engine {spec!r}: expected NAME=URL, e.g. chat=http://127.0.0.1:8001")
    where: dict[str, str] = {"url": url}
    if url.startswith("unix:"):
        path = url.removeprefix("unix:")
        if not path.startswith("/"):
            raise CliError(f"--engine {spec!r}: unix: needs an absolute socket path")
        where = {"uds": path}
    elif not url.startswith(("http://", "https://")):
        raise CliError(f"--engine {spec!r}: the URL must start with http://, https:// or unix:")
    try:
        return ModelSettings.model_validate({"name": name, **where})
    except ValidationError as exc:
        reasons = "; ".join(str(e["msg"]) for e in exc.errors())
        raise CliError(f"--engine {spec!r}: {reasons}") from None


def _env_engines() -> list[str]:
    """HOTSWAP_ENGINES, the twin of repeated --engine: NAME=URL entries, comma-separated."""
    raw = os.environ.get("HOTSWAP_ENGINES", "")
    return [part.strip() for part in raw.split(",") if part.strip()]


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hotswap", description="Sidecar that sleeps and wakes vLLM servers, verified."
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add_serve(sub)
    _add_client(sub.add_parser("status", help="one line per model"))
    _add_sleep(sub)
    _add_wake(sub)
    return parser


def _add_serve(sub: Any) -> None:
    serve = sub.add_parser("serve", help="run the sidecar")
    serve.add_argument(
        "--config", type=Path, help="YAML models file (env: HOTSWAP_CONFIG_FILE)", metavar="PATH"
    )
    serve.add_argument(
        "--engine",
        action="append",
        default=None,
        metavar="NAME=URL|NAME=unix:PATH",
        help="attach an engine started elsewhere; repeatable; replaces the file's models "
        "(env: HOTSWAP_ENGINES, comma-separated)",
    )
    serve.add_argument("--host", help="bind address (env: HOTSWAP_SERVER__HOST)")
    serve.add_argument(
        "--port", type=int, help="bind port, 0 = any free (env: HOTSWAP_SERVER__PORT)"
    )
    serve.add_argument(
        "--token",
        help="bearer token for control endpoints; prefer --token-file or the environment: a "
        "flag shows in ps (env: HOTSWAP_AUTH__TOKEN)",
    )
    serve.add_argument(
        "--token-file",
        type=Path,
        metavar="PATH",
        help="read the token from a file, e.g. a mounted Secret (env: HOTSWAP_AUTH__TOKEN_FILE)",
    )
    serve.add_argument(
        "--gateway-token-file",
        type=Path,
        metavar="PATH",
        help="the gateway's own tokens, one per line (a mounted Secret): they open /v1 and "
        "never the control API (env: HOTSWAP_AUTH__GATEWAY_TOKEN_FILE)",
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


def _add_client(p: argparse.ArgumentParser) -> None:
    """The options every client subcommand shares."""
    p.add_argument("--url", help=f"sidecar URL (env: HOTSWAP_URL; default {DEFAULT_URL})")
    p.add_argument("--token", help="bearer token; prefer HOTSWAP_TOKEN: a flag shows in ps")
    p.add_argument(
        "--timeout",
        type=float,
        help=f"seconds to wait for an answer (env: HOTSWAP_CLIENT_TIMEOUT; "
        f"default {DEFAULT_CLIENT_TIMEOUT_S:g})",
    )


def _add_sleep(sub: Any) -> None:
    sleep = sub.add_parser("sleep", help="put a model to sleep")
    sleep.add_argument("name")
    sleep.add_argument("--level", type=int, choices=[1, 2], help="default: the model's own")
    sleep.add_argument("--drain", choices=["wait", "abort"], help="default: wait")
    sleep.add_argument(
        "--drain-timeout", type=float, metavar="S", help="seconds; default: the sidecar's"
    )
    sleep.add_argument(
        "--keep-prefix-cache",
        action="store_true",
        help="keep the KV cache, so the prefix cache hits after the wake (level 1 only)",
    )
    sleep.add_argument("--no-wait", action="store_true", help="return at once (202)")
    _add_client(sleep)


def _add_wake(sub: Any) -> None:
    wake = sub.add_parser("wake", help="wake a model (the policy may put others to sleep)")
    wake.add_argument("name")
    wake.add_argument(
        "--no-evict",
        action="store_true",
        help="put nothing else to sleep: refused (409, with the reason) when there is no room",
    )
    wake.add_argument("--no-wait", action="store_true", help="return at once (202)")
    _add_client(wake)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """Settings from env/file with the given `serve` flags on top (None = not given)."""
    overrides: dict[str, Any] = {}
    if args.config is not None:
        overrides["config_file"] = args.config
    given = (("host", args.host), ("port", args.port), ("insecure", args.insecure))
    server = {k: v for k, v in given if v is not None}
    if server:
        overrides["server"] = server
    if args.token:
        log.warning(TOKEN_IN_ARGV, "--token", "--token-file or HOTSWAP_AUTH__TOKEN")
    given_auth = (
        ("token", args.token),
        ("token_file", args.token_file),
        ("gateway_token_file", args.gateway_token_file),
    )
    auth = {k: v for k, v in given_auth if v}
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
        raise CliError(f"invalid settings: {settings_errors(exc)}") from None
    except (OSError, ValueError) as exc:
        raise CliError(f"invalid settings: {exc}") from None


def settings_errors(exc: ValidationError) -> str:
    """Every reason on one line: `where: why`, joined by `; ` (a start refused says why)."""
    parts = []
    for e in exc.errors():
        where = ".".join(str(p) for p in e["loc"]) or "settings"
        parts.append(f"{where}: {e['msg']}")
    return "; ".join(parts)


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
    auth = settings.auth
    if (
        settings.gateway_enabled
        and auth.token
        and auth.gateway_tokens is None
        and auth.guard_gateway
    ):
        log.warning(
            "the control token also opens the gateway: a client that may infer can sleep, "
            "wake and audit models; give the gateway its own (--gateway-token-file, "
            "HOTSWAP_AUTH__GATEWAY_TOKEN_FILE)"
        )
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


def main(argv: Sequence[str] | None = None, out: TextIO | None = None) -> int:
    stream = out if out is not None else sys.stdout
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "serve" and args.token:
        print(f"hotswap: warning: {TOKEN_IN_ARGV % ('--token', 'HOTSWAP_TOKEN')}", file=sys.stderr)
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
