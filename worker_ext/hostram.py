"""Host RAM this rank may still take, in a container too: MemAvailable and the machine's
total, each lowered by the memory cgroups above this process (v2 `memory.max` less
`memory.current`, v1 `memory.limit_in_bytes` less `memory.usage_in_bytes`, the page cache's
`inactive_file` not counted, as the kubelet counts a working set). In a pod the OOM killer
acts at the container's limit, long before the node's MemAvailable runs out. Standard
library only (the controller reads the same for its host budget, in its own package:
the two never import each other). `root` makes a fake tree testable."""

from __future__ import annotations

from pathlib import Path

_FILES = {
    "v2": ("memory.max", "memory.current", "inactive_file"),
    "v1": ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),
}


ROOT = Path("/")  # where /proc and /sys/fs/cgroup are read (a test points it elsewhere)


def read(root: Path | None = None) -> tuple[int | None, int | None]:
    """(available, total) in bytes; None where nothing says."""
    root = ROOT if root is None else root
    available, total = _meminfo(root, "MemAvailable"), _meminfo(root, "MemTotal")
    for limit, used in _limits(root):
        if total is not None and limit >= total:
            continue  # no tighter than the machine (v1 writes "unlimited" as a huge number)
        total = limit
        room = max(0, limit - used)
        available = room if available is None else min(available, room)
    return available, total


def _meminfo(root: Path, key: str) -> int | None:
    try:
        for line in (root / "proc/meminfo").read_text(encoding="ascii").splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def _limits(root: Path) -> list[tuple[int, int]]:
    try:
        lines = (root / "proc/self/cgroup").read_text(encoding="ascii").splitlines()
    except OSError:
        return []
    out: list[tuple[int, int]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[1] == "":
            out += _walk(root / "sys/fs/cgroup", parts[2], "v2")
        elif "memory" in parts[1].split(","):
            out += _walk(root / "sys/fs/cgroup/memory", parts[2], "v1")
    return out


def _walk(mount: Path, path: str, version: str) -> list[tuple[int, int]]:
    """From the process's cgroup up to the mount's root (the mount's root itself when /proc
    names a path the container's mount does not show)."""
    limit_file, usage_file, inactive_key = _FILES[version]
    here = mount / path.strip("/")
    if not here.is_dir():
        here = mount
    out: list[tuple[int, int]] = []
    while True:
        limit = _number(here / limit_file)
        if limit is not None:
            used = (_number(here / usage_file) or 0) - _stat(here / "memory.stat", inactive_key)
            out.append((limit, max(0, used)))
        if here == mount or mount not in here.parents:
            return out
        here = here.parent


def _number(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    try:
        for line in path.read_text(encoding="ascii").splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        return 0
    return 0
