"""Real vLLM OpenAI servers for tests, each on a Unix socket in a private folder, always
stopped (the `engines` fixture of tests/conftest.py owns one launcher per module)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from controller.engines.enginespec import EngineSpec
from controller.engines.launcher import EngineProcess
from controller.engines.sockets import socket_path

REPO = Path(__file__).resolve().parents[2]
# The test extension: the real one plus hotswap_test_* seams (hold a wake open, delay one
# rank's barrier, poison a pool); vLLM's processes import it by name from tests/worker_ext.
TEST_EXTENSION = "hsext.HotSwapTestExtension"


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

    def start_with_seams(self, model: Path, name: str, **spec: Any) -> EngineProcess:
        """`start` with the test extension (TEST_EXTENSION) in place of the real one."""
        path = os.pathsep.join([str(REPO), str(REPO / "tests" / "worker_ext")])
        env = {"PYTHONPATH": path, **spec.pop("extra_env", {})}
        return self.start(model, name, worker_extension_cls=TEST_EXTENSION, extra_env=env, **spec)

    def stop_all(self) -> None:
        while self.started:
            self.started.pop().stop()
