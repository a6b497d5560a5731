"""A rank's host memory in a container (issue 28 item 11): the KV cache's pinned copy is
refused against the cgroup's room, not the node's MemAvailable (in a pod the OOM killer
comes first). Fake /proc and /sys/fs/cgroup trees; no vLLM, no device."""

from __future__ import annotations

from pathlib import Path

import pytest

from worker_ext import hostram
from worker_ext.cumem.hostbuf import keep_refusal

GIB = 1 << 30
NODE = f"MemTotal: {512 * GIB // 1024} kB\nMemAvailable: {400 * GIB // 1024} kB\n"


def tree(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def test_the_node_alone(tmp_path: Path) -> None:
    assert hostram.read(tree(tmp_path, {"proc/meminfo": NODE})) == (400 * GIB, 512 * GIB)


def test_cgroup_v2_and_v1(tmp_path: Path) -> None:
    v2 = tree(
        tmp_path / "v2",
        {
            "proc/meminfo": NODE,
            "proc/self/cgroup": "0::/pod/ctr\n",
            "sys/fs/cgroup/pod/memory.max": f"{16 * GIB}\n",
            "sys/fs/cgroup/pod/memory.current": f"{10 * GIB}\n",
            "sys/fs/cgroup/pod/memory.stat": f"inactive_file {2 * GIB}\n",
            "sys/fs/cgroup/pod/ctr/memory.max": "max\n",
        },
    )
    assert hostram.read(v2) == (8 * GIB, 16 * GIB)
    v1 = tree(
        tmp_path / "v1",
        {
            "proc/meminfo": NODE,
            "proc/self/cgroup": "4:memory:/kubepods/x\n",
            "sys/fs/cgroup/memory/memory.limit_in_bytes": f"{4 * GIB}\n",
            "sys/fs/cgroup/memory/memory.usage_in_bytes": f"{GIB}\n",
        },
    )
    assert hostram.read(v1) == (3 * GIB, 4 * GIB)


def test_the_kv_caches_copy_is_refused_against_the_pods_limit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """8 GiB for the KV cache's copy: the node has 400 GiB available, the pod's cgroup 12."""
    root = tree(
        tmp_path,
        {
            "proc/meminfo": NODE,
            "proc/self/cgroup": "0::/\n",
            "sys/fs/cgroup/memory.max": f"{16 * GIB}\n",
            "sys/fs/cgroup/memory.current": f"{4 * GIB}\n",
        },
    )
    monkeypatch.setattr(hostram, "ROOT", root)
    assert keep_refusal(4 * GIB, 0, making=False) is None  # 12 GiB less the 2 GiB margin
    refusal = keep_refusal(11 * GIB, 0, making=False)
    assert refusal is not None
    assert "host memory" in refusal
