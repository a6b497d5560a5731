"""scripts/bootstrap.sh resolves every pin and says where the wheels come from: with pip's
configuration as this machine has it (CI's: a local mirror, or an index), and with that
configuration hidden, from the default index plus the PyTorch CPU index, where a fresh
machine's torch==X+cpu comes from. A resolve only (--dry-run): nothing is installed."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TORCH_INDEX = "wheels from pip's index plus the CPU index"
CONFIG_ONLY = "wheels from pip's own configuration only"

pytestmark = pytest.mark.slow


def dry_run(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["scripts/bootstrap.sh", "--dry-run"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,  # a resolve beside other CPU-heavy work takes minutes
    )


def test_every_pin_resolves_with_this_machines_pip_configuration() -> None:
    out = dry_run(dict(os.environ))
    assert out.returncode == 0, out.stderr[-3000:]
    assert (TORCH_INDEX in out.stderr) != (CONFIG_ONLY in out.stderr), out.stderr
    assert "every pin of requirements-dev.txt resolves" in out.stderr


def test_a_fresh_machine_resolves_through_the_pytorch_index_or_is_told_why_not() -> None:
    # No pip configuration at all: no local wheels, no mirror; pip's default index.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    out = dry_run(env)
    if TORCH_INDEX in out.stderr:
        assert out.returncode == 0, out.stderr[-3000:]
    else:
        # The CPU index did not answer here: the default index alone lacks the CPU torch,
        # and bootstrap says so, with what to do.
        assert CONFIG_ONLY in out.stderr, out.stderr
        assert out.returncode != 0, out.stderr[-3000:]
        assert "No matching distribution found for torch==" in out.stderr, out.stderr
        assert "only on the PyTorch CPU index" in out.stderr, out.stderr
