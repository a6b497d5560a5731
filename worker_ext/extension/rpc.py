"""The RPC wrapper every `hotswap_*` method runs in: timed, never raising, plain values."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar, cast

import torch

log = logging.getLogger("worker_ext")

F = TypeVar("F", bound=Callable[..., dict[str, Any]])


def plain(value: Any) -> Any:
    """JSON/msgpack-native copy: dict (str keys), list, str, int, float, bool, None."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [plain(v) for v in value]
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    return str(value)


def rank_of(worker: Any) -> int:
    try:
        return int(worker.rank)
    except Exception:
        return -1


def rpc(fn: F) -> F:
    """Run an RPC body: time it, catch everything, always return a plain dict."""

    @functools.wraps(fn)
    def wrapper(self: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        t0 = time.monotonic()
        try:
            out = dict(fn(self, *args, **kwargs))
            out.setdefault("ok", True)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            log.exception("hotswap: %s failed on rank %s", fn.__name__, rank_of(self))
            out = {"ok": False, "error": f"{type(e).__name__}: {e}"}
        out["rank"] = rank_of(self)
        out["elapsed_s"] = time.monotonic() - t0
        if not out["ok"]:
            out.setdefault("error", "failed")
        try:
            return cast(dict[str, Any], plain(out))
        except BaseException as e:  # a result that cannot be made plain is still an answer
            return {
                "ok": False,
                "rank": out["rank"],
                "elapsed_s": out["elapsed_s"],
                "error": f"result not serialisable: {type(e).__name__}",
            }

    return cast(F, wrapper)
