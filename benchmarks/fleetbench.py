"""What the deep-sleep and density benchmarks share: engines launched on Unix sockets (each
in its own process group, under its keeper, booted at once) and attached to one sidecar by
socket, so the sidecar reaches their processes (the deep sleep's driver calls); the host
memory of an engine's processes by role (PSS: shared pages counted once); the device bytes
of each process as NVML (nvidia-smi) shows them.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from controller.engines.checkpoint import group_pids, peer_group
from controller.engines.enginespec import EngineSpec
from controller.engines.launcher import EngineProcess


def strip_address(argv: Sequence[str]) -> list[str]:
    """An engine's argv without --host/--port (the socket is chosen here)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in ("--host", "--port"):
            skip = True
            continue
        out.append(a)
    return out


def launch_on_socket(
    name: str, argv: Sequence[str], sock: Path, env: Mapping[str, str], logs: Path
) -> EngineProcess:
    spec = EngineSpec.from_command(name, strip_address(argv), sock, dict(env))
    proc = EngineProcess(spec, logs / f"{name}.log")
    proc.start()
    return proc


def uds_client(sock: Path, timeout_s: float = 300.0) -> httpx.Client:
    return httpx.Client(
        transport=httpx.HTTPTransport(uds=str(sock)), base_url="http://engine", timeout=timeout_s
    )


def sidecar_on(
    port: int, models: list[dict[str, Any]], extra: Mapping[str, Any] | None = None
) -> EngineSpec:
    """`hotswap serve --config FILE` on 127.0.0.1:`port`, the models attached as given."""
    cfg = Path(tempfile.mkdtemp(prefix="bench-fleet-")) / "sidecar.yaml"
    cfg.write_text(yaml.safe_dump({"models": models, **(extra or {})}))
    argv = [sys.executable, "-m", "controller", "serve", "--config", str(cfg)]
    return EngineSpec.from_command("sidecar", argv, port, {})


PORT_TAKEN = "address already in use"


def start_sidecar(
    models: list[dict[str, Any]],
    log_path: Path,
    extra: Mapping[str, Any] | None = None,
    *,
    gateway: Mapping[str, Any] | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 180.0,
    tries: int = 3,
) -> tuple[EngineProcess, int | None]:
    """`hotswap serve` on loopback ports picked free just before it starts, ready, and its
    gateway's port (None without `gateway`, the gateway's settings but its port). A port is
    picked before the process binds it, and the machine's other processes (vLLM's engines
    among them) open ports of their own meanwhile: a start whose log says a port was taken
    is tried again on new ports, up to `tries` times; any other failure is raised at once."""
    from benchmarks.common import free_port

    for attempt in range(1, tries + 1):
        more = dict(extra or {})
        gw = None
        if gateway is not None:
            gw = free_port()
            more["gateway"] = {**gateway, "enabled": True, "port": gw}
        spec = sidecar_on(free_port(), models, more)
        spec.extra_env.update(env or {})
        side = EngineProcess(spec, log_path)
        side.start()
        try:
            side.wait_ready(timeout_s=timeout_s)
        except Exception:
            side.stop(20.0)
            if attempt == tries or PORT_TAKEN not in side.log_tail(200).lower():
                raise
            continue
        return side, gw
    raise AssertionError("unreachable")  # the last try returns or raises


def role(pid: int) -> str:
    """What a process of an engine is, from its command line and name."""
    try:
        cmd = (
            Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return "gone"
    if "controller.engines.reaper" in cmd:
        return "keeper"
    if "compile_worker" in cmd:
        return "compile_worker"
    if "EngineCore" in comm or "EngineCore" in cmd:
        return "engine_core"
    if "Worker" in comm:
        return "worker"
    if "api_server" in cmd or "APIServer" in comm:
        return "api_server"
    return f"other:{comm}"


def pss(pid: int) -> int:
    """Proportional set size in bytes (0 when it cannot be read)."""
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def pss_parts(pid: int) -> dict[str, int]:
    """PSS split by kind in bytes: anonymous (heap, pinned host buffers), file-backed
    (libraries, mapped files), shared memory; {} when it cannot be read."""
    out: dict[str, int] = {}
    try:
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            key = line.split(":", 1)[0]
            if key in ("Pss_Anon", "Pss_File", "Pss_Shmem"):
                out[key[4:].lower()] = int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return {}
    return out


def pss_by_process(pids: Sequence[int]) -> list[dict[str, Any]]:
    """One row per process: pid, role, PSS and its kinds (bytes), the largest first."""
    rows = [{"pid": p, "role": role(p), "pss": pss(p), **pss_parts(p)} for p in pids]
    return sorted(rows, key=lambda r: -int(r["pss"]))


def pss_by_mapping(pid: int, top: int = 12) -> list[tuple[str, int]]:
    """The process's PSS by what is mapped (a file's path, [heap], [anon] for anonymous
    mappings, [anon:NAME] where named), the `top` largest in bytes: what holds it."""
    by: dict[str, int] = {}
    name = "?"
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(None, 5)
                if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                    name = head[5].strip() if len(head) > 5 else "[anon]"
                elif line.startswith("Pss:"):
                    by[name] = by.get(name, 0) + int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return []
    return sorted(by.items(), key=lambda kv: -kv[1])[:top]


def engine_pids(sock: Path) -> tuple[int, ...]:
    return group_pids(peer_group(sock))


def host_pss(pids: Sequence[int]) -> dict[str, Any]:
    """PSS by role over `pids`, with how many processes of each role, the total, and the
    total by kind (anon, file, shmem: what a cut would have to go after)."""
    by: dict[str, int] = {}
    count: dict[str, int] = {}
    kind: dict[str, int] = {}
    for p in pids:
        r = role(p)
        by[r] = by.get(r, 0) + pss(p)
        count[r] = count.get(r, 0) + 1
        for k, v in pss_parts(p).items():
            kind[f"{r}:{k}"] = kind.get(f"{r}:{k}", 0) + v
    return {"total": sum(by.values()), "by_role": by, "count": count, "by_kind": kind}


def gpu_bytes_by_pid() -> dict[int, int]:
    """Device bytes per process, as nvidia-smi shows them."""
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
    except FileNotFoundError:  # no GPU here (the CPU run)
        return {}
    held: dict[int, int] = {}
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            held[int(parts[0])] = held.get(int(parts[0]), 0) + int(parts[1]) * (1 << 20)
    return held


def gpu_bytes(pids: Sequence[int]) -> int:
    held = gpu_bytes_by_pid()
    return sum(held.get(p, 0) for p in pids)


def wait_all(procs: Mapping[str, EngineProcess], timeout_s: float) -> dict[str, float]:
    """Seconds until each answers /health 200 (booted at once); raises on the first failure."""
    t0 = time.monotonic()
    up: dict[str, float] = {}
    while len(up) < len(procs):
        for name, p in procs.items():
            if name in up:
                continue
            if not p.is_alive():
                raise RuntimeError(f"{name} exited {p.returncode}:\n{p.log_tail()}")
            if p.ping(1.0):
                up[name] = time.monotonic() - t0
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"not up after {timeout_s:g} s: {sorted(set(procs) - set(up))}")
        time.sleep(0.5)
    return up


def env_with(**kw: str) -> dict[str, str]:
    return {**{k: v for k, v in os.environ.items() if k.startswith("HOTSWAP_")}, **kw}
