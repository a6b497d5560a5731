"""Start, probe and stop one real vLLM OpenAI server as a subprocess (`EngineProcess`).

The engine (argv and env from `controller.engines.enginespec`) runs under a keeper
(`controller.engines.reaper`) that leads its own process group and ends that group when the
sidecar dies (SIGKILL included) or the engine exits. `wait_ready` accepts an answer only
from a process of that group (the socket peer's credentials, `controller.engines.sockets`), so an
orphan or another server can never pass for the engine. `EngineProcess` is what tests, the
benchmarks and a managed-mode supervisor use.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx

from controller.engines.enginespec import EngineSpec
from controller.engines.reaper import members
from controller.engines.sockets import http_status_over, process_group, socket_peer_pid
from controller.errors import EngineStartError

log = logging.getLogger(__name__)


class EngineProcess:
    """One vLLM server under its keeper: start, wait_ready (a real /health ping, answered by a
    process of this engine's own group), stop, kill. Start it from a thread that lives as long
    as the engine should: the keeper's parent-death signal follows that thread."""

    def __init__(
        self, spec: EngineSpec, log_path: Path, *, stop_grace_s: float = 15.0, nice: int = 0
    ) -> None:
        self.spec = spec
        self.log_path = log_path
        self.stop_grace_s = stop_grace_s
        self.nice = nice  # added to the sidecar's nice value by the keeper, for the engine
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
        keeper = [
            sys.executable,
            "-m",
            "controller.engines.reaper",
            f"{self.stop_grace_s:g}",
            str(os.getpid()),  # the keeper checks it is still this process's child
            *([f"--nice={self.nice}"] if self.nice else []),
            "--",
        ]
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
            # Its own process group (a stop reaches EngineCore and workers), in the sidecar's
            # session: where the kernel shares the CPU out by session (autogroup), a session
            # of its own would weigh as much as the sidecar's whole, whatever the nice value.
            process_group=0,
        )

    def is_alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    async def exited(self) -> int | None:
        """Return once the keeper (it ends the engine's group first) has exited: its return code.

        The kernel says so: a pidfd of the keeper becomes readable when it ends, and the
        event loop watches that descriptor, so nothing polls. Where there is no pidfd
        (not Linux), a thread waits for the process instead.
        """
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return self.returncode
        try:
            fd = os.pidfd_open(proc.pid)
        except (AttributeError, OSError):
            return await asyncio.to_thread(proc.wait)
        loop = asyncio.get_running_loop()
        ended: asyncio.Future[None] = loop.create_future()
        loop.add_reader(fd, _resolve, ended)
        try:
            await ended
        finally:
            loop.remove_reader(fd)
            os.close(fd)
        # A zombie now: reaped at once (in a thread: a stop may hold Popen's wait lock).
        return await asyncio.to_thread(proc.wait)

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
        """Whether a live process of the group is left (zombies are not: nothing to end)."""
        return self._proc is not None and bool(members(self._proc.pid))

    def group_left(self) -> list[int]:
        """The live processes of this engine's group: after the keeper was killed outright
        (SIGKILL, the OOM killer), the engine's children (EngineCore, workers) live on in
        it, holding their memory, until someone ends the group."""
        return members(self._proc.pid) if self._proc is not None else []

    def stop(self, grace_s: float | None = None) -> int | None:
        """SIGTERM the group, wait up to `grace_s` for it to empty, then SIGKILL what is left;
        a keeper already gone included (its orphans are ended the same way)."""
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


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
