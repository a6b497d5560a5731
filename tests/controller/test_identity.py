"""An attached engine's identity (issue 28 item 9): the names it serves (its ranks'
`served_model_name`, the API server's /v1/models) and its ranks' model class must be the
model's: its configured `served_model_name`, else what the first verified probe read. An
engine that is another model is FAILED with the reason; it used to be taken for the
model (RUNNING, the gateway's requests forwarded to it)."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client import CollectorRegistry
from support.fakevllm import FakeVllm

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings, TimeoutSettings
from controller.engines.engine import EngineClient
from controller.models.manager import Manager
from controller.observe.metrics import Metrics
from controller.state import State


def manager(fake: FakeVllm, **model: object) -> Manager:
    settings = Settings(
        models=[ModelSettings(name="m", url="http://m:8000", **model)],  # type: ignore[arg-type]
        timeouts=TimeoutSettings(shutdown_s=1.0),
    )

    def factory(m: ModelSettings, t: TimeoutSettings) -> EngineClient:
        return EngineClient(m.url, transport=httpx.MockTransport(fake), timeouts=t)

    return Manager(settings, Metrics(CollectorRegistry()), factory)


@pytest.mark.anyio
async def test_an_engine_serving_another_name_than_configured_is_failed() -> None:
    fake = FakeVllm(name="other", world_size=2)
    mgr = manager(fake, served_model_name="tiny")
    await mgr.start()
    snap = mgr.get("m").snapshot()
    assert snap.state is State.FAILED
    assert "'tiny'" in str(snap.last_error)
    assert "other" in str(snap.last_error)
    await mgr.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("change", ["name", "class"])
async def test_a_restarted_engine_that_is_another_model_is_failed(change: str) -> None:
    """No served name configured: the first verified probe's name and class are the model's;
    the engine restarted behind the sidecar's back as another model is not."""
    fake = FakeVllm(name="tiny", world_size=2)
    mgr = manager(fake)
    await mgr.start()
    assert mgr.get("m").snapshot().state is State.RUNNING
    if change == "name":
        fake.name = "other"
    else:
        fake.model_class = "OtherForCausalLM"
    fake.started_at += 100.0  # a new process answers
    fake.fresh()
    await mgr.get("m").check_recovered()
    snap = mgr.get("m").snapshot()
    assert snap.state is State.FAILED, snap
    assert "other" in str(snap.last_error).lower()
    await mgr.stop()
