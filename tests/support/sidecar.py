"""The real sidecar as a process of its own: `python -m controller serve`, as a pod runs it,
so a test can SIGKILL it, SIGTERM it, and start it again. Its control API and gateway bind
ports of their own choosing (port 0: a port chosen free beforehand can be taken before it is
bound), read back from its log at each start. The in-process form (the same `Sidecar` in a
thread, for tests that read its records) is support.sidecarthread.SidecarThread.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import httpx
import yaml

from support import oneshot
from support.metrics import metric_sum

ENDED = ("RUNNING", "SUSPENDED", "FAILED")
_LISTENING = re.compile(r"Uvicorn running on http://127\.0\.0\.1:(\d+)")


class SidecarProcess:
    """`python -m controller serve` on loopback: over a models file (`config`, which sets
    the gateway itself) or attached to `engines` (name -> `unix:PATH` or URL; the gateway
    on). `env`: more of its environment; the test process's own HOTSWAP_* variables never
    reach it. `own_session`: started in a session of its own, as a container's process has
    a CPU cgroup of its own (where the kernel shares the CPU out by session, autogroup, it
    would otherwise share one with the test process and whatever load that drives)."""

    def __init__(
        self,
        log_path: Path,
        *,
        config: Path | None = None,
        engines: Mapping[str, str] | None = None,
        env: Mapping[str, str] | None = None,
        own_session: bool = False,
    ) -> None:
        if (config is None) == (engines is None):
            raise ValueError("a models file or engines, one of the two")
        self.log_path = log_path
        self.config = config
        self.engines = dict(engines or {})
        self.env = dict(env or {})
        self.own_session = own_session
        self.proc: subprocess.Popen[bytes] | None = None
        self.url = ""  # the control API, once started
        self.gateway_url = ""
        self.starts = 0

    @classmethod
    def over(cls, config: Mapping[str, Any], folder: Path, **kw: Any) -> SidecarProcess:
        """Over `config` (a models file's content), written to FOLDER/models.yaml; its log
        is FOLDER/sidecar.log."""
        path = folder / "models.yaml"
        path.write_text(yaml.safe_dump(dict(config)))
        return cls(folder / "sidecar.log", config=path, **kw)

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    # ---- the process --------------------------------------------------------------------

    def start(self, timeout_s: float = 120.0) -> SidecarProcess:
        """Start it and wait until both ports answer."""
        argv = [sys.executable, "-m", "controller", "serve", "--host", "127.0.0.1"]
        env = {k: v for k, v in os.environ.items() if not k.startswith("HOTSWAP_")}
        if self.config is not None:
            argv += ["--config", str(self.config)]
        else:
            argv += ["--port", "0"]
            for name, url in self.engines.items():
                argv += ["--engine", f"{name}={url}"]
            env |= {
                "HOTSWAP_GATEWAY__ENABLED": "true",
                "HOTSWAP_GATEWAY__HOST": "127.0.0.1",
                "HOTSWAP_GATEWAY__PORT": "0",
                "HOTSWAP_LOG__LEVEL": "INFO",
            }
        env |= self.env
        self.starts += 1
        self.url = self.gateway_url = ""
        with self.log_path.open("ab") as log:
            log.write(f"\n==== start #{self.starts}\n".encode())
            offset = log.tell()
            self.proc = subprocess.Popen(
                argv,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=self.own_session,
            )
        self._wait_up(offset, time.monotonic() + timeout_s)
        return self

    def _wait_up(self, offset: int, deadline: float) -> None:
        assert self.proc is not None
        while time.monotonic() < deadline:
            self._check_alive()
            with self.log_path.open("rb") as f:
                f.seek(offset)
                ports = _LISTENING.findall(f.read().decode(errors="replace"))
            if len(ports) == 2:
                for port in ports:
                    url = f"http://127.0.0.1:{port}"
                    with contextlib.suppress(httpx.HTTPError):
                        control = oneshot.get(f"{url}/livez", timeout=5).status_code == 200
                        if control:
                            self.url = url
                        else:
                            self.gateway_url = url
                if self.url and self.gateway_url:
                    return
            time.sleep(0.1)
        raise TimeoutError(f"hotswap serve did not come up:\n{self.log_tail()}")

    def _check_alive(self) -> None:
        if self.proc is not None and (rc := self.proc.poll()) is not None:
            raise RuntimeError(f"hotswap serve exited {rc}:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL: no shutdown of any kind runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)
        self.url = self.gateway_url = ""

    def stop(self, timeout_s: float = 60.0) -> None:
        """SIGTERM, then SIGKILL after `timeout_s`."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(30)
        self.url = self.gateway_url = ""

    def log_tail(self, chars: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # ---- the control API ----------------------------------------------------------------

    def get(self, path: str, **kw: Any) -> httpx.Response:
        return oneshot.get(f"{self.url}{path}", timeout=kw.pop("timeout", 60.0), **kw)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        return oneshot.post(f"{self.url}{path}", timeout=kw.pop("timeout", 300.0), **kw)

    def model(self, name: str) -> dict[str, Any]:
        r = self.get(f"/models/{name}")
        r.raise_for_status()
        body: dict[str, Any] = r.json()
        return body

    def models(self) -> dict[str, dict[str, Any]]:
        r = self.get("/models", timeout=10)
        r.raise_for_status()
        return {m["name"]: m for m in r.json()["models"]}

    def metric(self, name: str, **labels: str) -> float:
        return metric_sum(self.get("/metrics", timeout=10).text, name, **labels)

    def wait_for(
        self,
        name: str,
        pred: Callable[[dict[str, Any]], bool],
        timeout_s: float = 120.0,
        what: str = "",
    ) -> dict[str, Any]:
        """`name`'s /models body once `pred` holds for it."""
        deadline = time.monotonic() + timeout_s
        body: dict[str, Any] = {}
        while time.monotonic() < deadline:
            self._check_alive()
            with contextlib.suppress(httpx.HTTPError):
                body = self.model(name)
                if pred(body):
                    return body
            time.sleep(0.05)
        raise TimeoutError(f"{name}: not {what} after {timeout_s:.0f} s: {body}\n{self.log_tail()}")

    def wait_phase(self, name: str, phase: str, timeout_s: float = 60.0) -> dict[str, Any]:
        return self.wait_for(name, lambda b: phase_of(b) == phase, timeout_s, f"in phase {phase}")

    def wait_settled(self, name: str, timeout_s: float = 120.0) -> dict[str, Any]:
        """The model in an end state (RUNNING, SUSPENDED or FAILED) with nothing in flight."""
        return self.wait_for(
            name, lambda b: b["state"] in ENDED and phase_of(b) is None, timeout_s, "settled"
        )


def phase_of(body: Mapping[str, Any]) -> str | None:
    phase = body.get("phase")
    if phase is None:
        phase = (body.get("extra") or {}).get("phase")
    return str(phase) if phase is not None else None
