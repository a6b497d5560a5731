"""vLLM's own sleep and wake, driven by the sidecar (a model's `sleep_driver: vllm`,
docs/contracts.md §2.3).

The sleep is the sidecar's drain, then vLLM's `POST /sleep?level=N`, then the ranks read
back (`hotswap_info`) and judged (`vllm_check`): every rank `suspended` with `vllm_sleep`
(the `hotswap` sleep-mode backend: its wake will be verified inside the engine), or every
rank still `awake_verified` (a plain engine: vLLM's `cumem`, or CPU, where vLLM's worker
sleep does nothing), which only a model with `accept_unverified_wake` may be.

The wake is vLLM's `POST /wake_up` (at level 2, or an unknown level, of a plain sleep:
`?tags=weights`, `reload_weights`, `?tags=kv_cache`), then the ranks read back and judged
again: awake, nothing asleep in vLLM's allocator, and, after the backend's sleep, verified
(`verified_transition` = `transitions`). Then `/resume` and the warm-up, as every wake.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from controller import protocol
from controller.errors import EngineError
from controller.models.runner import AnyStep, EngineStep, Runner
from controller.models.steps import RESUME_ENGINE, WARMUP, DrainMode, drain
from controller.reports import RankReport, RankView, ranks_from_info

HOTSWAP = "hotswap"  # vLLM's sleep through the hotswap backend: the ranks moved
PLAIN = "plain"  # vLLM's sleep the ranks did not see: nothing verifies its wake

NOT_THE_BACKEND = (
    "the ranks did not move: this engine's sleep is not the hotswap backend's, so its wake "
    "would not be verified; start it with --worker-cls worker_ext.HotSwapWorker, or set "
    "the model's accept_unverified_wake (docs/contracts.md §2.3)"
)


def _ranks(r: Runner) -> tuple[RankView, ...]:
    run = r.current
    if run is None:
        raise EngineError("vllm_check runs inside a transition")
    return ranks_from_info([rep.raw for rep in run.reports.get(protocol.INFO.phase, ())])


def _vllm_sleep(level: int) -> EngineStep:
    async def call(r: Runner) -> Mapping[str, Any]:
        await r.engine.sleep(level, timeout_s=r.timeouts.rpc_s)
        if not await r.engine.is_sleeping():
            raise EngineError("vLLM answered /sleep but /is_sleeping says false")
        return {"level": level}

    return EngineStep("vllm_sleep", "/sleep", call)


def _check_asleep(level: int) -> EngineStep:
    async def call(r: Runner) -> Mapping[str, Any]:
        ranks = _ranks(r)
        if ranks and all(
            x.phase.value == "suspended" and x.vllm_sleep and x.level == level for x in ranks
        ):
            r.record.facts.slept_through_vllm(HOTSWAP)
            return {"vllm_backend": HOTSWAP}
        if ranks and all(x.phase.value == "awake_verified" for x in ranks):
            if not r.record.settings.accept_unverified_wake:
                raise EngineError(NOT_THE_BACKEND)
            r.record.facts.slept_through_vllm(PLAIN)
            return {"vllm_backend": PLAIN, "verified": False}
        said = ", ".join(f"rank {x.rank} {x.phase.value} L{x.level}" for x in ranks)
        raise EngineError(f"after vLLM's sleep at level {level} the ranks say: {said}")

    return EngineStep("vllm_check", "-", call)


def _vllm_wake(split: bool) -> EngineStep:
    async def call(r: Runner) -> Mapping[str, Any]:
        t = r.timeouts
        if split:  # vLLM's documented level-2 order: the weights refilled in between
            await r.engine.wake_up(["weights"], timeout_s=t.rpc_s)
            await r.engine.reload_weights(timeout_s=t.reload_s)
            await r.engine.wake_up(["kv_cache"], timeout_s=t.rpc_s)
        else:
            await r.engine.wake_up(timeout_s=t.reload_s)  # the backend may reload (level 2)
        if await r.engine.is_sleeping():
            raise EngineError("vLLM answered /wake_up but /is_sleeping still says true")
        return {"split": split}

    return EngineStep("vllm_wake", "/wake_up", call)


def _check_awake(kind: str) -> EngineStep:
    async def call(r: Runner) -> Mapping[str, Any]:
        ranks = _ranks(r)
        wrong = [
            x
            for x in ranks
            if x.phase.value != "awake_verified" or x.vllm_sleep or x.allocator_asleep
        ]
        if not ranks or wrong:
            said = ", ".join(
                f"rank {x.rank} {x.phase.value} vllm_sleep={x.vllm_sleep} "
                f"allocator_asleep={list(x.allocator_asleep)}"
                for x in wrong
            )
            raise EngineError(f"after vLLM's wake the ranks are not all awake: {said}")
        if kind == HOTSWAP and any(x.verified_transition != x.transitions for x in ranks):
            raise EngineError("after vLLM's wake through the backend a rank is not verified")
        r.record.facts.slept_through_vllm(None)
        return {"vllm_backend": kind, "verified": kind == HOTSWAP}

    return EngineStep("vllm_check", "-", call)


def _drop_backup() -> EngineStep:
    """The extension's kept host copy (left by a wake of the extension's own sleep) goes
    before vLLM's sleep, which keeps a host copy of its own: never two at once."""

    async def call(r: Runner) -> Mapping[str, Any]:
        ranks = await r.engine.rpc(protocol.DROP_BACKUP.method, timeout_s=r.timeouts.rpc_s)
        r.record.holdings.release_host()
        freed = sum(
            sum(v for v in (x.get("freed_host_bytes") or {}).values() if isinstance(v, int))
            for x in ranks
        )
        return {"freed_host_bytes": freed}

    return EngineStep("drop_backup", protocol.DROP_BACKUP.method, call)


def sleep_sequence(level: int, mode: DrainMode, grace_s: float) -> tuple[AnyStep, ...]:
    return (
        drain(mode, grace_s),
        _drop_backup(),
        _vllm_sleep(level),
        protocol.INFO,
        _check_asleep(level),
    )


def wake_sequence(level: int | None, kind: str) -> tuple[AnyStep, ...]:
    """`kind`: the sleep in force, HOTSWAP or PLAIN; `level` None: not known (a sleep a
    restarted sidecar found), woken in the level-2 order where the engine would not reload."""
    split = kind == PLAIN and level != 1
    return (_vllm_wake(split), protocol.INFO, _check_awake(kind), RESUME_ENGINE, WARMUP)


def resident(reports: Iterable[RankReport]) -> int | None:
    """What the ranks hold on their devices asleep (`hotswap_info`'s `resident.bytes`,
    summed); None when a rank does not say."""
    held = [RankView.from_info(rep.raw).resident_bytes for rep in reports]
    if not held or any(h is None for h in held):
        return None
    return sum(h or 0 for h in held)
