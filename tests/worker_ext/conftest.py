"""Environment for the worker-extension tests, set at import, before vLLM is imported.

The test extension (`hsext`) lives in this folder; vLLM's spawned workers import it by name,
so this folder and the repository root go on PYTHONPATH here, ahead of any spawn.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
_paths = [str(HERE), str(ROOT)]
_old = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p not in _paths]
os.environ["PYTHONPATH"] = os.pathsep.join([*_paths, *_old])
for _p in _paths:
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
# The test extension swaps vLLM-CPU's packed GEMM for F.linear so weights drive the forward.
os.environ.setdefault("HOTSWAP_TEST_PLAIN_LINEAR", "1")

from inproc import generate  # noqa: E402 (this folder goes on sys.path just above)


@pytest.fixture(scope="module")
def baseline(llm: Any) -> tuple[list[int], list[float]]:
    """Greedy tokens and logprobs of the module's engine (its `llm` fixture) before any cycle."""
    return generate(llm)
