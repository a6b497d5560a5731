"""vLLM's `vllm.general_plugins` entry point: registers the `hotswap` sleep-mode backend.

vLLM runs every installed general plugin in each of its processes (the API server, the
engine core, every worker) before it builds anything. Registering is all this does: it
selects nothing, so an installed package changes no engine that does not ask for it
(docs/contracts.md §1.5), and it never raises, so a vLLM this package does not support
still starts (its worker refuses, with the reason, only where `HotSwapWorker` is asked for).
"""

from __future__ import annotations

import logging

from worker_ext import vllmcompat

log = logging.getLogger("worker_ext.plugin")


def register() -> None:
    try:
        if not vllmcompat.register_backend():
            log.info("hotswap: this vLLM has no pluggable sleep-mode backend; not registered")
    except Exception as exc:  # a plugin that raises would stop every vLLM on this machine
        log.warning("hotswap: the sleep-mode backend was not registered: %s", exc)
