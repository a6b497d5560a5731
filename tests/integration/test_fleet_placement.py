"""Many devices in one pod, on real CPU vLLM servers: three managed models placed on two
fake device ids (`swap.devices`), one awake per device. The placement reaches each engine's
own environment as CUDA_VISIBLE_DEVICES (CPU vLLM ignores it; the process still carries it),
/models and the metrics show it, and a wake that needs room evicts only on its own device.
The last model also has idle sleep on: it sleeps by itself and the gateway wakes it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.engines import forked_core
from support.sidecarthread import Api, SidecarThread, attached

from controller.config.settings import ModelSettings
from controller.engines.enginespec import EngineSpec, managed_argv
from controller.engines.launcher import EngineProcess

pytestmark = pytest.mark.vllm

A, B, C = "dev-a", "dev-b", "dev-c"  # placed on 0, 1, 0 (the least loaded first)
DEVICES = ["0", "1"]
IDLE_S = 20.0  # C only (managed idle sleep); longer than the tests before it need C awake


def _managed(name: str, path: Path) -> ModelSettings:
    spec = EngineSpec(model=path, uds=Path(), served_model_name=name, uni=True)
    return ModelSettings.model_validate(
        {
            "name": name,
            "command": forked_core(managed_argv(spec)),
            "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"},
        }
    )


@pytest.fixture(scope="module")
def sidecar(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[SidecarThread]:
    models = [_managed(n, tiny_model("llama", i, True)) for i, n in enumerate((A, B, C))]
    models[2] = models[2].model_copy(update={"idle_sleep_s": IDLE_S})
    side = SidecarThread(
        attached(models),
        swap={"max_awake": 1, "min_awake_s": 0.0, "devices": DEVICES},
        supervisor={"log_dir": tmp_path_factory.mktemp("engine-logs"), "boot_timeout_s": 300.0},
    )
    side.start(booted=True)
    try:
        yield side
    finally:
        side.stop()


def _engine_env(side: SidecarThread, name: str) -> dict[str, str]:
    """The environment of the model's engine process (the keeper's child), from /proc."""
    assert side.ctx is not None
    engine = side.ctx.fleet[name].process.engine
    assert isinstance(engine, EngineProcess)
    keeper = engine.pid
    children = Path(f"/proc/{keeper}/task/{keeper}/children").read_text().split()
    assert children, f"{name}: the keeper {keeper} has no child"
    raw = Path(f"/proc/{children[0]}/environ").read_bytes()
    return dict(kv.split("=", 1) for kv in raw.decode(errors="replace").split("\0") if "=" in kv)


def test_each_engine_runs_with_its_devices_visible(sidecar: SidecarThread) -> None:
    expected = {A: "0", B: "1", C: "0"}
    for name, device in expected.items():
        assert _engine_env(sidecar, name).get("CUDA_VISIBLE_DEVICES") == device, name


def test_models_and_metrics_show_the_placement(sidecar: SidecarThread) -> None:
    api = Api(sidecar.base_url)
    body = api.get("/models").json()
    placed = {m["name"]: m["devices"] for m in body["models"]}
    assert placed == {A: ["0"], B: ["1"], C: ["0"]}
    one = api.get(f"/models/{B}").json()
    assert one["fleet"]["visible_devices"] == "1"
    assert api.metric("hotswap_model_device_info", model=A, device="0") == 1.0
    assert api.metric("hotswap_model_device_info", model=B, device="1") == 1.0
    assert api.metric("hotswap_model_device_info", model=C, device="0") == 1.0


def test_a_wake_evicts_only_on_its_own_device(sidecar: SidecarThread) -> None:
    api = Api(sidecar.base_url)
    for name in (A, B):  # one per device: both fit, nothing evicted
        r = api.wake(name)
        assert r.status_code == 200, r.text
    assert sidecar.state(A) == "RUNNING"
    assert sidecar.state(B) == "RUNNING"
    r = api.wake(C)
    assert r.status_code == 200, r.text
    policy = r.json()["policy"]["policy"]
    assert r.json()["policy"]["evicted"] == [A]
    assert policy["decision"] == "evict", policy
    assert policy["evict"] == [A], policy
    assert policy["devices"] == ["0"], policy
    assert sidecar.state(C) == "RUNNING"
    assert sidecar.state(A) == "SUSPENDED"
    assert sidecar.state(B) == "RUNNING"  # the other device was not touched
    # The gateway's request for B is served at once (no swap: it is awake on device 1).
    assert sidecar.gateway_url is not None
    resp = httpx.post(
        f"{sidecar.gateway_url}/v1/completions",
        json={"model": B, "prompt": "hello", "max_tokens": 2, "temperature": 0.0},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert sidecar.state(C) == "RUNNING"


def test_managed_idle_sleep_and_the_gateway_wakes_it(sidecar: SidecarThread) -> None:
    api = Api(sidecar.base_url)
    assert sidecar.state(C) == "RUNNING"
    sidecar.wait_state(C, "SUSPENDED", timeout_s=IDLE_S + 60)
    assert api.metric("hotswap_sleeps_total", model=C, reason="idle") == 1
    assert api.metric("hotswap_sleeps_total", model=B, reason="idle") == 0
    assert sidecar.state(B) == "RUNNING"  # no idle sleep of its own
    assert sidecar.gateway_url is not None
    resp = httpx.post(
        f"{sidecar.gateway_url}/v1/completions",
        json={"model": C, "prompt": "hello", "max_tokens": 2, "temperature": 0.0},
        timeout=120,
    )
    assert resp.status_code == 200, resp.text
    assert sidecar.state(C) == "RUNNING"
