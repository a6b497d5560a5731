"""The quarantine of an engine whose reply queues may be out of step outlives a restart of
the sidecar (issue 28 item 9): a new sidecar over the same attached engine sends it no RPC
(no `hotswap_info` either) and holds the model FAILED until a new process answers."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from support.fakevllm import FakeVllm

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings, TimeoutSettings
from controller.engines.engine import EngineClient
from controller.errors import HotswapError
from controller.models.manager import Manager
from controller.observe.metrics import Metrics
from controller.state import State


def sidecar(fake: FakeVllm, folder: Path, **settings: object) -> Manager:
    """One sidecar's manager over the fake engine, attached on a socket in `folder`."""
    model = ModelSettings(name="m", uds=str(folder / "m.sock"))  # type: ignore[call-arg]
    s = Settings(
        models=[model],
        timeouts=TimeoutSettings(shutdown_s=1.0),
        **settings,  # type: ignore[arg-type]
    )

    def factory(m: ModelSettings, t: TimeoutSettings) -> EngineClient:
        return EngineClient(m.url, transport=httpx.MockTransport(fake), timeouts=t)

    return Manager(s, Metrics(CollectorRegistry()), factory)


@pytest.mark.anyio
@pytest.mark.parametrize("where", ["socket folder", "state_dir"])
async def test_a_restarted_sidecar_keeps_the_quarantine(tmp_path: Path, where: str) -> None:
    fake = FakeVllm(name="m", world_size=2)
    extra = {"state_dir": tmp_path / "state"} if where == "state_dir" else {}
    if extra:
        (tmp_path / "state").mkdir()
    first = sidecar(fake, tmp_path, **extra)
    await first.start()
    fake.fail["hotswap_audit"] = "timeout"  # the call may have left the queues out of step
    with pytest.raises(HotswapError):
        await first.get("m").audit(1)
    assert first.get("m").snapshot().state is State.FAILED
    await first.stop()  # the sidecar goes (a SIGKILL keeps nothing more in its process)

    fake.calls.clear()
    second = sidecar(fake, tmp_path, **extra)
    await second.start()
    snap = second.get("m").snapshot()
    assert snap.state is State.FAILED, snap
    assert fake.rpc_calls() == []  # not even hotswap_info
    assert "out of step" in str(snap.last_error)

    fake.started_at += 100.0  # the engine restarted: a new process answers
    fake.fresh()
    fake.fail.clear()
    assert await second.get("m").check_recovered()
    assert second.get("m").snapshot().state is State.RUNNING
    await second.stop()
    third = sidecar(fake, tmp_path, **extra)  # the quarantine was lifted
    await third.start()
    assert third.get("m").snapshot().state is State.RUNNING
    await third.stop()
