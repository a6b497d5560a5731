"""Settings: the YAML models file, environment overrides and managed-command checks."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from controller.config.modelsettings import ModelSettings, flag_value
from controller.config.settings import Settings, load_settings
from controller.state import Gate


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text)
    return path


def test_yaml_models_file_and_env_override(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(
        tmp_path,
        "server: {port: 9000}\n"
        "models:\n"
        "  - {name: a, url: 'http://127.0.0.1:8001/'}\n"
        "  - {name: b, url: 'http://127.0.0.1:8002', gate: swappable, default_level: 2}\n",
    )
    monkeypatch.setenv("HOTSWAP_SERVER__PORT", "9100")
    settings = load_settings(config_file=path)
    assert settings.server.port == 9100  # env beats the file
    assert [m.name for m in settings.models] == ["a", "b"]
    assert settings.models[0].url == "http://127.0.0.1:8001"  # trailing slash dropped
    assert settings.models[1].gate is Gate.SWAPPABLE
    assert settings.models[1].default_level == 2
    # CLI values (init kwargs) beat the environment.
    assert load_settings(config_file=path, server={"port": 9200}).server.port == 9200


def test_duplicate_names_and_bad_file_are_refused(tmp_path: Path) -> None:
    dup = _write(
        tmp_path, "models:\n  - {name: a, url: 'http://x'}\n  - {name: a, url: 'http://y'}\n"
    )
    with pytest.raises(ValidationError, match="duplicate model names: a"):
        load_settings(config_file=dup)
    (tmp_path / "list.yaml").write_text("- a\n- b\n")
    with pytest.raises(ValueError, match="must be a mapping"):
        Settings(config_file=tmp_path / "list.yaml")


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--host", "127.0.0.1"], "127.0.0.1"),
        (["--host=0.0.0.0"], "0.0.0.0"),
        (["--port", "8001", "--host"], ""),
        (["--hostname", "x"], None),
        ([], None),
    ],
)
def test_flag_value_reads_both_spellings(argv: list[str], expected: str | None) -> None:
    assert flag_value(argv, "--host") == expected


@pytest.mark.parametrize(
    ("model", "why"),
    [
        ({"command": ["vllm", "--host", "127.0.0.1"]}, "must not set --host"),
        ({"command": ["vllm", "--port=9999"]}, "must not set --port"),
        ({"command": ["vllm", "--uds", "/x.sock"]}, "must not set --uds"),
        ({"command": ["vllm"], "port": 8001}, "not on a port"),
        ({"command": ["vllm"], "url": "http://127.0.0.1:8001"}, "has no url"),
    ],
)
def test_a_managed_engine_gets_no_address_but_its_socket(
    model: dict[str, object], why: str
) -> None:
    with pytest.raises(ValidationError, match=why):
        ModelSettings.model_validate({"name": "m", **model})


def test_a_managed_or_socket_engine_is_named_by_its_url_host() -> None:
    m = ModelSettings.model_validate({"name": "m", "command": ["vllm", "--model=x"]})
    assert m.managed
    assert (m.url, m.uds) == ("http://m", None)  # the supervisor places the socket
    a = ModelSettings.model_validate({"name": "a", "uds": "/run/hotswap/a.sock"})
    assert (a.managed, a.url, a.uds) == (False, "http://a", "/run/hotswap/a.sock")
