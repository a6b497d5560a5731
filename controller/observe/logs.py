"""Logging set-up: one handler on the root logger, JSON or text as the settings say.

Code logs with the standard library and passes the context as `extra`, e.g.
`log.info("suspended %d bytes", n, extra={"model": name, "phase": "suspend", "rank": 0})`;
both formats show `model`, `phase` and `rank` whenever a record carries them.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import IO, Any

from controller.config.settings import LogFormat, LogSettings

CONTEXT_FIELDS = ("model", "phase", "rank")

# Marks the handler this module installed, so a second call replaces it instead of doubling.
_OURS = "_hotswap_handler"


def _timestamp(record: logging.LogRecord) -> str:
    return datetime.fromtimestamp(record.created, tz=UTC).isoformat(timespec="milliseconds")


def _context(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k in CONTEXT_FIELDS if (v := getattr(record, k, None)) is not None}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, logger, msg, then model/phase/rank when present."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": _timestamp(record),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        out.update(_context(record))
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        # default=str: an odd extra value must never make a log line raise.
        return json.dumps(out, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    """`<ts> <LEVEL> <logger> [model=.. phase=.. rank=..] <msg>` for humans."""

    def format(self, record: logging.LogRecord) -> str:
        ctx = _context(record)
        tags = " [" + " ".join(f"{k}={v}" for k, v in ctx.items()) + "]" if ctx else ""
        line = (
            f"{_timestamp(record)} {record.levelname:<7} {record.name}{tags} {record.getMessage()}"
        )
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        if record.stack_info:
            line += "\n" + self.formatStack(record.stack_info)
        return line


def make_formatter(fmt: LogFormat) -> logging.Formatter:
    return JsonFormatter() if fmt is LogFormat.JSON else TextFormatter()


class RateLimit(logging.Filter):
    """At most `per_minute` records of one message (its format string) per minute; the
    rest are dropped, and the next one let through says how many were."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.per_minute = per_minute
        self.clock = clock
        self._windows: dict[str, tuple[float, int, int]] = {}  # msg -> (start, kept, dropped)

    def filter(self, record: logging.LogRecord) -> bool:
        now = self.clock()
        key = str(record.msg)
        start, kept, dropped = self._windows.get(key, (now, 0, 0))
        if now - start >= 60.0:
            start, kept = now, 0
        if kept >= self.per_minute:
            self._windows[key] = (start, kept, dropped + 1)
            return False
        if dropped:
            record.msg = f"{record.msg} ({dropped} more like it dropped)"
        self._windows[key] = (start, kept + 1, 0)
        if len(self._windows) > 1024:  # messages are format strings: few; stay bounded
            self._windows.pop(next(iter(self._windows)))
        return True


# The loggers whose lines a flood of connections multiplies: the accept loop's
# ("socket.accept() out of system resource", once per try) and uvicorn's.
RATE_LIMITED = ("asyncio", "uvicorn.error")


def rate_limit(per_minute: int) -> None:
    """(Re)install one RateLimit on each of RATE_LIMITED."""
    for name in RATE_LIMITED:
        logger = logging.getLogger(name)
        for old in [f for f in logger.filters if isinstance(f, RateLimit)]:
            logger.removeFilter(old)
        logger.addFilter(RateLimit(per_minute))


# The open routes that the kubelet and Prometheus call every few seconds (docs/contracts.md).
PROBE_PATHS = frozenset(("/livez", "/health", "/metrics"))


def is_probe_path(path: str) -> bool:
    """/livez, /health, /metrics, or /models/{name}/health (a query string aside)."""
    path = path.partition("?")[0]
    if path in PROBE_PATHS:
        return True
    name, sep, rest = path.removeprefix("/models/").partition("/")
    return path.startswith("/models/") and bool(name) and sep == "/" and rest == "health"


class QuietProbes(logging.Filter):
    """Drops uvicorn's access lines of probes that succeeded (a GET or HEAD of a probe path
    answered below 400). uvicorn logs `'%s - "%s %s HTTP/%s" %d'` with the args (client,
    method, path with query, HTTP version, status); a record of another shape passes."""

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if not isinstance(args, tuple) or len(args) != 5:
            return True
        _client, method, path, _version, status = args
        return not (
            method in ("GET", "HEAD")
            and isinstance(status, int)
            and status < 400
            and isinstance(path, str)
            and is_probe_path(path)
        )


ACCESS_LOGGER = "uvicorn.access"


def quiet_probes(on: bool) -> None:
    """(Re)install or remove the QuietProbes filter on uvicorn's access logger."""
    logger = logging.getLogger(ACCESS_LOGGER)
    for old in [f for f in logger.filters if isinstance(f, QuietProbes)]:
        logger.removeFilter(old)
    if on:
        logger.addFilter(QuietProbes())


def configure_logging(settings: LogSettings, stream: IO[str] | None = None) -> logging.Handler:
    """Install (or replace) the sidecar's handler on the root logger; returns it.

    Other loggers (uvicorn's included, when it is run with `log_config=None`) propagate here,
    so every line of the process has the same shape.
    """
    level = settings.level.upper()
    if not isinstance(logging.getLevelName(level), int):
        raise ValueError(f"unknown log level {settings.level!r}")
    root = logging.getLogger()
    for old in [h for h in root.handlers if getattr(h, _OURS, False)]:
        root.removeHandler(old)
        old.close()
    handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    handler.setFormatter(make_formatter(settings.format))
    setattr(handler, _OURS, True)
    root.addHandler(handler)
    root.setLevel(level)
    rate_limit(settings.max_repeats_per_minute)
    quiet_probes(not settings.probe_access)
    return handler
