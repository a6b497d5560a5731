"""The host RAM a pod may use (issue 28 item 11): over fake /proc and /sys/fs/cgroup trees,
the cgroup's limit (v2 and v1, the tightest over the ancestors) lowers the machine's RAM,
and what is used there lowers MemAvailable; a fractional host budget is a fraction of it."""

from __future__ import annotations

from pathlib import Path

import pytest
from support.gatewayworld import run, world

from controller.observe import hostmem

GIB = 1 << 30
MACHINE = 512 * GIB


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


MEMINFO = f"MemTotal: {MACHINE // 1024} kB\nMemAvailable: {400 * GIB // 1024} kB\n"


def test_no_cgroup_is_the_machine(tmp_path: Path) -> None:
    root = tree(tmp_path, {"proc/meminfo": MEMINFO})
    ram = hostmem.read(root, physical=MACHINE)
    assert (ram.total, ram.available, ram.source) == (MACHINE, 400 * GIB, "machine")


def test_cgroup_v2_limit_and_working_set(tmp_path: Path) -> None:
    """The pod's limit is on the parent (the container's own cgroup says "max"): the
    tightest limit over the ancestors counts; usage less inactive_file is what is used."""
    root = tree(
        tmp_path,
        {
            "proc/meminfo": MEMINFO,
            "proc/self/cgroup": "0::/kubepods/pod1/ctr\n",
            "sys/fs/cgroup/kubepods/pod1/memory.max": f"{16 * GIB}\n",
            "sys/fs/cgroup/kubepods/pod1/memory.current": f"{6 * GIB}\n",
            "sys/fs/cgroup/kubepods/pod1/memory.stat": f"anon 1\ninactive_file {GIB}\n",
            "sys/fs/cgroup/kubepods/pod1/ctr/memory.max": "max\n",
            "sys/fs/cgroup/kubepods/pod1/ctr/memory.current": f"{5 * GIB}\n",
        },
    )
    ram = hostmem.read(root, physical=MACHINE)
    assert (ram.total, ram.available, ram.source) == (16 * GIB, 11 * GIB, "cgroup v2")


def test_cgroup_v2_namespaced_container_reads_its_mount_root(tmp_path: Path) -> None:
    """With a cgroup namespace /proc says "/" and the mount is the container's cgroup."""
    root = tree(
        tmp_path,
        {
            "proc/meminfo": MEMINFO,
            "proc/self/cgroup": "0::/\n",
            "sys/fs/cgroup/memory.max": f"{8 * GIB}\n",
            "sys/fs/cgroup/memory.current": f"{2 * GIB}\n",
        },
    )
    ram = hostmem.read(root, physical=MACHINE)
    assert (ram.total, ram.available) == (8 * GIB, 6 * GIB)


def test_cgroup_v1_limit_and_unlimited(tmp_path: Path) -> None:
    files = {
        "proc/meminfo": MEMINFO,
        "proc/self/cgroup": "12:cpu,cpuacct:/x\n11:memory:/docker/abc\n",
        "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{4 * GIB}\n",  # the mount's root
        "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{3 * GIB}\n",
        "sys/fs/cgroup/memory/memory.stat": f"total_inactive_file {GIB}\n",
    }
    ram = hostmem.read(tree(tmp_path / "a", files), physical=MACHINE)
    assert (ram.total, ram.available, ram.source) == (4 * GIB, 2 * GIB, "cgroup v1")
    # v1 writes "unlimited" as a huge number: the machine counts
    files["sys/fs/cgroup/memory/memory.limit_in_bytes"] = "9223372036854771712\n"
    ram = hostmem.read(tree(tmp_path / "b", files), physical=MACHINE)
    assert (ram.total, ram.source) == (MACHINE, "machine")


def test_a_fractional_host_budget_is_a_fraction_of_the_pods_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """It was a fraction of the node's RAM (SC_PHYS_PAGES): in a pod the OOM killer comes
    first."""
    root = tree(
        tmp_path,
        {
            "proc/meminfo": MEMINFO,
            "proc/self/cgroup": "0::/\n",
            "sys/fs/cgroup/memory.max": f"{2 * GIB}\n",
            "sys/fs/cgroup/memory.current": "0\n",
        },
    )
    monkeypatch.setattr(hostmem, "ROOT", root)

    async def body() -> None:
        async with world(("a",), swap={"host_budget": 0.5}) as w:
            assert w.coordinator.host.budget().bytes == GIB

    run(body)
