"""What the control API asks of a coordinator, and the one a sidecar without hot swap uses.

Every sidecar has a coordinator, so the routes never branch on the mode: with hot swap it
is the `SwapCoordinator` (controller.fleet.swap: wakes through the policy, sleeps that drain
the gateway's traffic first); without, `DirectCoordinator` runs sleeps and wakes straight
through the model's manager, as they were asked (no policy, no budget, no gateway).
"""

from __future__ import annotations

from typing import Protocol

from controller.fleet.swap import SwapResult
from controller.models.modelmanager import ModelManager, Outcome
from controller.models.steps import DrainMode


class Coordinator(Protocol):
    """Sleeps and wakes of the control API, each of one model (its manager)."""

    async def sleep(
        self,
        mm: ModelManager,
        level: int | None = None,
        drain: DrainMode = "wait",
        drain_timeout_s: float | None = None,
        *,
        keep_prefix_cache: bool | None = None,
        deep: bool | None = None,
    ) -> Outcome: ...

    def begin_sleep(
        self,
        mm: ModelManager,
        level: int | None = None,
        drain: DrainMode = "wait",
        drain_timeout_s: float | None = None,
        *,
        keep_prefix_cache: bool | None = None,
        deep: bool | None = None,
    ) -> Outcome:
        """?wait=false: start it and say what will happen (409 now when it cannot)."""
        ...

    async def wake(self, mm: ModelManager, *, evict: bool = True) -> SwapResult: ...

    def begin_wake(self, mm: ModelManager, *, evict: bool = True) -> Outcome:
        """?wait=false: start it and say what will happen (409 now when it cannot)."""
        ...

    def host_budget_bytes(self) -> int | None:
        """The host budget resolved to bytes (None: none)."""
        ...


class DirectCoordinator:
    """No hot swap: a sleep or a wake is the model manager's own (`evict` means nothing)."""

    async def sleep(
        self,
        mm: ModelManager,
        level: int | None = None,
        drain: DrainMode = "wait",
        drain_timeout_s: float | None = None,
        *,
        keep_prefix_cache: bool | None = None,
        deep: bool | None = None,
    ) -> Outcome:
        kept = keep_prefix_cache
        return await mm.sleep(level, drain, drain_timeout_s, keep_prefix_cache=kept, deep=deep)

    def begin_sleep(
        self,
        mm: ModelManager,
        level: int | None = None,
        drain: DrainMode = "wait",
        drain_timeout_s: float | None = None,
        *,
        keep_prefix_cache: bool | None = None,
        deep: bool | None = None,
    ) -> Outcome:
        kept = keep_prefix_cache
        return mm.begin_sleep(
            level, drain, drain_timeout_s, keep_prefix_cache=kept, deep=bool(deep)
        )

    async def wake(self, mm: ModelManager, *, evict: bool = True) -> SwapResult:
        return SwapResult(None, await mm.wake())

    def begin_wake(self, mm: ModelManager, *, evict: bool = True) -> Outcome:
        return mm.begin_wake()

    def host_budget_bytes(self) -> int | None:
        return None
