"""The launcher's argv for a managed engine: loopback and the model's port, never twice."""

from __future__ import annotations

from controller.launcher import LOOPBACK, EngineSpec


def test_from_command_adds_host_and_port_only_when_absent() -> None:
    spec = EngineSpec.from_command("m", ["python", "-m", "vllm.x"], 8001, {"A": "1"})
    assert spec.command is not None
    argv = list(spec.command)
    assert argv[argv.index("--host") + 1] == LOOPBACK
    assert argv[argv.index("--port") + 1] == "8001"
    given = EngineSpec.from_command("m", ["vllm.x", "--host=127.0.0.1", "--port=8001"], 8001, {})
    assert given.command == ("vllm.x", "--host=127.0.0.1", "--port=8001")


def test_engines_inherit_no_sidecar_secret() -> None:
    """Managed mode: the sidecar's environment (its token above all) never reaches vLLM; the
    worker extension's own settings and the model's explicit env do."""
    sidecar_env = {
        "PATH": "/usr/bin",
        "HOTSWAP_AUTH__TOKEN": "s3cret",
        "HOTSWAP_AUTH__TOKEN_FILE": "/run/secrets/token",
        "HOTSWAP_TOKEN": "s3cret",
        "HOTSWAP_SERVER__HOST": "0.0.0.0",
        "HOTSWAP_CONFIG_FILE": "/etc/hotswap/models.yaml",
        "HOTSWAP_PIN_THREADS": "8",
        "HOTSWAP_MAP_IMPL": "vllm",
    }
    spec = EngineSpec.from_command("m", ["vllm.x"], 8001, {"HOTSWAP_VERIFY_KERNEL": "off"})
    env = spec.env(sidecar_env)
    assert "s3cret" not in env.values()
    hotswap = {k: v for k, v in env.items() if k.startswith("HOTSWAP_")}
    assert hotswap == {
        "HOTSWAP_PIN_THREADS": "8",
        "HOTSWAP_MAP_IMPL": "vllm",
        "HOTSWAP_VERIFY_KERNEL": "off",
    }
    assert env["PATH"] == "/usr/bin"
