"""The CUDA pool backend on vLLM's CuMemAllocator (worker_ext/cumem/backend.py)."""

from worker_ext.cumem.backend import CuMemBackend

__all__ = ["CuMemBackend"]
