"""Process trees from /proc: a sidecar's keepers and engines, their memory, whether any
outlived it (Linux only, stdlib only); and a benchmark run as a process, within a bound.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------------------- processes


def _stat(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].decode().split()


def children(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (st := _stat(int(entry))) is not None and int(st[1]) == pid:
            out.append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    out = []
    for child in children(pid):
        out += [child, *descendants(child)]
    return out


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def listening_socket(path: Path) -> str | None:
    """The inode of the Unix socket listening at `path` (/proc/net/unix), if any."""
    with open("/proc/net/unix") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            # Num RefCount Protocol Flags Type St Inode Path; flags 00010000: listening
            if len(fields) == 8 and fields[7] == str(path) and fields[3] == "00010000":
                return fields[6]
    return None


def holds_socket(pid: int, inode: str) -> bool:
    """Whether process `pid` has socket `inode` open."""
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            if os.readlink(f"/proc/{pid}/fd/{fd}") == f"socket:[{inode}]":
                return True
        except OSError:
            continue
    return False


def rss_bytes(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def engine_pid(sidecar_pid: int, name: str) -> int | None:
    """The engine (API server) under the keeper a sidecar started for model `name`."""
    for keeper in children(sidecar_pid):
        argv = cmdline(keeper)
        if "controller.engines.reaper" in argv and name in argv:
            kids = children(keeper)
            return kids[0] if kids else None
    return None


# ----------------------------------------------------------------------------- a module run


def run_module(args: Sequence[str], timeout_s: float, grace_s: float = 30.0) -> tuple[int, str]:
    """`python -m ARGS` from the repository's root, as a user runs a benchmark: its exit code
    and the tail of its output. Past `timeout_s` it gets SIGTERM (a benchmark stops its
    engines on it), then SIGKILL after `grace_s`; a run that timed out answers -1."""
    proc = subprocess.Popen(
        [sys.executable, "-m", *args],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
        return proc.returncode, out[-6000:]
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            out, _ = proc.communicate()
        return -1, f"timed out after {timeout_s:g} s\n" + out[-6000:]
