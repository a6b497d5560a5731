"""`HotSwapWorker`: vLLM's worker with the `hotswap` sleep-mode backend bound to it.

`--worker-cls worker_ext.HotSwapWorker` is the one flag an operator adds (docs/contracts.md
§1.5): vLLM 0.26 to 0.32 cannot select a sleep-mode backend by name from the CLI or
`LLM(...)`, and a backend the factory makes has no worker to protect. The class is made per
platform on first use (`worker_ext.HotSwapWorker`), from vLLM's own worker for it:

- CUDA: `gpu_worker.Worker`, whose `sleep()`/`wake_up()` call the bound backend around
  vLLM's own steps (level-2 buffers, `post_kv_cache_wake_up`);
- CPU: `cpu_worker.CPUWorker`, whose `sleep()`/`wake_up()` do nothing; here they call the
  backend, so vLLM's endpoints reach the host backend as the sidecar's RPCs do.

Each refuses to start on a vLLM version not tested here (`vllmcompat.require`).
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from worker_ext import vllmcompat

log = logging.getLogger("worker_ext.sleepworker")


def _init(self: Any, *args: Any, **kwargs: Any) -> None:
    vllmcompat.require()  # before the model loads: the engine does not start
    from worker_ext.extension import HotSwapExtension

    cls = type(self)
    if not isinstance(self, HotSwapExtension):  # no --worker-extension-cls: mix it in as vLLM does
        cls.__bases__ = (*cls.__bases__, HotSwapExtension)
    super(cls, self).__init__(*args, **kwargs)
    backend = vllmcompat.backend_class()(self)
    vllmcompat.bind_backend(self, backend)
    log.info("hotswap: sleep-mode backend bound (vLLM %s)", vllmcompat.vllm_version())


def _cpu_sleep(self: Any, level: int = 1) -> None:
    getattr(self, vllmcompat.WORKER_BACKEND_ATTR).suspend(level)


def _cpu_wake_up(self: Any, tags: list[str] | None = None) -> None:
    getattr(self, vllmcompat.WORKER_BACKEND_ATTR).resume(tags)


@functools.cache
def worker_class(plat: str) -> type[Any]:
    """`HotSwapWorker` for the platform, made once per process."""
    base = vllmcompat.worker_base(plat)
    body: dict[str, Any] = {"__init__": _init, "__module__": __name__}
    if plat == "cpu":
        body.update(sleep=_cpu_sleep, wake_up=_cpu_wake_up)
    return type("HotSwapWorker", (base,), body)


def __getattr__(name: str) -> Any:
    if name == "HotSwapWorker":
        return worker_class(vllmcompat.platform())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
