"""The host RAM this process may use: the machine's, or its cgroup's limit where lower.

In a pod the OOM killer acts at the container's cgroup limit, long before the node's RAM
(`SC_PHYS_PAGES`) or the node-wide `MemAvailable` run out: a host budget that is a fraction
of the node's RAM would let the models hold more than the container may. This reads the
memory controller of the process's own cgroup and of every ancestor visible (the tightest
limit counts): cgroup v2 (`memory.max`, `memory.current`) and v1 (`memory.limit_in_bytes`,
`memory.usage_in_bytes`). Usage counts the working set as the kubelet does (usage less the
reclaimable `inactive_file` of `memory.stat`). `root` makes a fake tree testable.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class HostRam:
    """`total`: what this process may use at most (bytes); `available`: what it may still
    take now (None: unknown); `source`: where `total` comes from ("machine", "cgroup v2",
    "cgroup v1")."""

    total: int
    available: int | None
    source: str


def physical_ram() -> int:
    """The machine's RAM in bytes (0 where the platform does not say)."""
    try:
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (OSError, ValueError):
        return 0


ROOT = Path("/")  # where /proc and /sys/fs/cgroup are read (a test points it at a fake tree)


def read(root: Path | None = None, physical: int | None = None) -> HostRam:
    """The machine's RAM and MemAvailable, lowered by every cgroup limit above this process."""
    root = ROOT if root is None else root
    total = physical_ram() if physical is None else physical
    available = _meminfo(root, "MemAvailable")
    source = "machine"
    for version, limit, used in _cgroup_limits(root):
        if total and limit >= total:
            continue  # "unlimited" (v1 writes a huge number), or no tighter than the machine
        room = max(0, limit - used)
        available = room if available is None else min(available, room)
        if not total or limit < total:
            total, source = limit, f"cgroup {version}"
    return HostRam(total=total, available=available, source=source)


def _meminfo(root: Path, key: str) -> int | None:
    try:
        text = (root / "proc/meminfo").read_text(encoding="ascii")
    except OSError:
        return None
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name == key:
            parts = rest.split()
            try:
                return int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
            except (IndexError, ValueError):
                return None
    return None


def _cgroup_limits(root: Path) -> list[tuple[str, int, int]]:
    """(version, limit, working set) for each limited memory cgroup from ours up."""
    try:
        lines = (root / "proc/self/cgroup").read_text(encoding="ascii").splitlines()
    except OSError:
        return []
    found: list[tuple[str, int, int]] = []
    for line in lines:
        _, controllers, path = line.split(":", 2) if line.count(":") >= 2 else ("", "", "")
        if controllers == "" and path:
            found += _walk(root / "sys/fs/cgroup", path, "v2", "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            mount = root / "sys/fs/cgroup/memory"
            found += _walk(mount, path, "v1", "memory.limit_in_bytes", "memory.usage_in_bytes")
    return found


def _walk(
    mount: Path, path: str, version: str, limit_file: str, usage_file: str
) -> list[tuple[str, int, int]]:
    """From the process's cgroup up to the mount's root. Inside a container the mount is often
    the container's own cgroup while /proc names the host's path: then the mount's root is
    the process's cgroup."""
    here = mount / path.strip("/")
    if not here.is_dir():
        here = mount
    out: list[tuple[str, int, int]] = []
    while True:
        limit = _number(here / limit_file)
        if limit is not None:
            used = _number(here / usage_file) or 0
            inactive = _stat(
                here / "memory.stat", "inactive_file" if version == "v2" else "total_inactive_file"
            )
            out.append((version, limit, max(0, used - inactive)))
        if here == mount or mount not in here.parents:
            return out
        here = here.parent


def _number(path: Path) -> int | None:
    """A cgroup file's number; None for "max", a missing file or anything else."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        text = path.read_text(encoding="ascii")
    except OSError:
        return 0
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0
