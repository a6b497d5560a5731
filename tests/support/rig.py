"""One model's manager over a fake engine (support.fakevllm.FakeVllm on an
httpx.MockTransport) and a fake clock that each call advances by a cost the test chooses,
so phase durations are exact: `make_rig`, and the `Rig` it returns (the world, the manager,
model "m", its metrics)."""

from __future__ import annotations

from collections.abc import Callable

import httpx
from prometheus_client import CollectorRegistry

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings, TimeoutSettings
from controller.engines.engine import EngineClient
from controller.models.manager import Manager
from controller.models.modelmanager import ModelManager
from controller.observe.metrics import Metrics
from support.fakevllm import FakeVllm


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def mono(self) -> float:
        return self.t

    def wall(self) -> float:
        return 1_700_000_000.0 + self.t


class Rig:
    def __init__(self, world: FakeVllm, manager: Manager, registry: CollectorRegistry) -> None:
        self.world = world
        self.manager = manager
        self.registry = registry
        self.m: ModelManager = manager.get("m")

    def sample(self, name: str, **labels: str) -> float:
        value = self.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


def make_rig(
    clock: FakeClock | None = None,
    ranks: int = 2,
    wrap: Callable[[httpx.AsyncBaseTransport], httpx.AsyncBaseTransport] | None = None,
    fused: bool = True,
    fused_sleep: bool = True,
    **timeouts: float,
) -> Rig:
    clock = clock or FakeClock()
    # 1000 + 500 bytes per rank: the sums over ranks below are easy to read.
    world = FakeVllm(
        name="tiny", world_size=ranks, pool_bytes={"weights": 1000, "kv_cache": 500}, clock=clock
    )
    settings = Settings(
        # fused=False: the wake as three RPCs (an extension without hotswap_wake)
        # fused_sleep=False: the sleep's prepare and suspend as two RPCs
        models=[
            ModelSettings(name="m", url="http://m:8000", fused_wake=fused, fused_sleep=fused_sleep)  # type: ignore[call-arg]
        ],
        timeouts=TimeoutSettings(**timeouts),  # type: ignore[arg-type]
    )
    registry = CollectorRegistry()
    metrics = Metrics(registry)

    def factory(m: ModelSettings, t: TimeoutSettings) -> EngineClient:
        transport: httpx.AsyncBaseTransport = httpx.MockTransport(world)
        if wrap is not None:
            transport = wrap(transport)
        return EngineClient(m.url, transport=transport, timeouts=t)

    manager = Manager(settings, metrics, factory, clock.wall, monotonic=clock.mono)
    return Rig(world, manager, registry)
