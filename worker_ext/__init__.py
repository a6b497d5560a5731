"""vLLM worker extension for verified hot swap.

`HotSwapExtension` and `HotSwapWorker` are exported lazily: `python -m worker_ext.devmodels`
(and anything else that only needs a submodule) must not pay for importing torch and vLLM.
"""

from __future__ import annotations

from typing import Any

__all__ = ["HotSwapExtension", "HotSwapWorker"]


def __getattr__(name: str) -> Any:
    if name == "HotSwapExtension":
        from worker_ext.extension import HotSwapExtension

        return HotSwapExtension
    if name == "HotSwapWorker":  # `--worker-cls worker_ext.HotSwapWorker` (docs/contracts.md §1.5)
        from worker_ext import sleepworker

        return sleepworker.HotSwapWorker
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
