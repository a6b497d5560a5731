"""Structured logging: JSON lines and readable text, both carrying model/phase/rank."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest

from controller.config.settings import LogFormat, LogSettings
from controller.observe.logs import configure_logging


@pytest.fixture
def restore_root() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for h in list(root.handlers):
        if h not in handlers:
            root.removeHandler(h)
    root.setLevel(level)


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
