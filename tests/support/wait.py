"""The one wait helper: until a predicate holds, woken by the fleet's (or a record's)
changes, bounded by asyncio.wait_for. A predicate that no record change announces (a
metric counted after its sequence returned) is looked at again at most every `recheck_s`."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from controller.models.changes import Changes


async def until(
    predicate: Callable[[], bool],
    changes: Changes | None = None,
    *,
    timeout_s: float = 5.0,
    recheck_s: float = 0.05,
) -> None:
    """Return once `predicate()` holds; AssertionError when `timeout_s` ran out first."""

    async def wait() -> None:
        while not predicate():
            if changes is None:
                await asyncio.sleep(recheck_s)
                continue
            fut = changes.next()
            try:
                await asyncio.wait({fut}, timeout=recheck_s)
            finally:
                fut.cancel()

    try:
        await asyncio.wait_for(wait(), timeout_s)
    except TimeoutError:
        raise AssertionError(f"not true within {timeout_s:g} s") from None
