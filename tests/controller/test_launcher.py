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
