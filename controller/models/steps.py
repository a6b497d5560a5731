"""The controller's own steps around the extension's RPCs, and the full sequences.

A sleep is `drain` followed by `protocol.sleep_steps(level)` (fused: quiesce, then one
`hotswap_sleep`); a wake is
`protocol.wake_steps(level)` followed by `/resume` (after vLLM's own `/wake_up` where a rank
says vLLM's own sleep is in force) and a warm-up; the start-up probe is
`/health` then `hotswap_info`. Each engine-level step returns its phase's detail.

An overlapped swap (controller.fleet.swap) runs the evicted model's sleep split by pool, with a
`kv_released` step between its two suspends that tells the coordinator the KV cache is
gone, and the woken model's wake with a `wait_room` step before its KV cache is mapped:
it waits there until the evicted model's weights are off the device. Where both earlier
starts fit, the `kv_released` callable is a `KvFirst`: the evicted model's sleep stays one
fused `hotswap_sleep` (its KV cache released first inside it) and a `kv_first` step before
it tells the coordinator the release is about to start.

Drain, as measured on vLLM 0.32 (docs/contracts.md, "Measured: pause semantics"):
a `/pause?mode=wait` whose HTTP call times out leaves the engine paused, a `/resume`
unpauses it at once even with the wait pending, and a second `/pause?mode=abort` while a
wait is pending aborts what is left and ends both pauses. A "paused" answer is not proof
(a concurrent /resume wins), so every drain ends by asking `/is_paused`.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any, Literal

from controller import protocol
from controller.errors import DrainTimeout, EngineError, EngineTimeout, HotswapError
from controller.models.runner import AnyStep, EngineStep, Runner
from controller.reports import RankReport, kv_decision

DrainMode = Literal["wait", "abort"]


async def _ensure_paused(r: Runner) -> None:
    # A "paused" answer is not proof: a /resume sent meanwhile unpauses at once (measured).
    if not await r.engine.is_paused():
        raise EngineError("the engine answered /pause but is not paused (resumed by someone else?)")


def drain(mode: DrainMode, grace_s: float, clear_cache: bool = True) -> EngineStep:
    """wait: pause once in-flight requests finished; if they outlast `grace_s`, give up with
    the engine resumed (DrainTimeout, still RUNNING). abort: give them `grace_s`, then
    abort the rest. `clear_cache` false: vLLM's prefix cache is kept (a sleep that keeps
    the KV cache; the kv step clears it if the ranks cannot keep it)."""

    async def wait(r: Runner) -> Mapping[str, Any]:
        try:
            await r.engine.pause("wait", clear_cache=clear_cache, timeout_s=grace_s)
        except EngineTimeout:
            # Measured: the engine stays paused after the HTTP timeout; undo that and check.
            await r.engine.resume()
            if await r.engine.is_paused():
                raise EngineError(
                    "drain gave up, but the engine is still paused after /resume"
                ) from None
            raise DrainTimeout(
                f"drain=wait: in-flight requests did not finish within {grace_s:g} s; "
                "engine resumed",
                model=r.name,
                phase="drain",
            ) from None
        await _ensure_paused(r)
        return {"mode": "wait"}

    async def abort(r: Runner) -> Mapping[str, Any]:
        waited = False
        if grace_s > 0:
            try:
                # New requests queue from now on; those in flight may finish within the grace.
                await r.engine.pause("wait", clear_cache=clear_cache, timeout_s=grace_s)
                waited = True
            except EngineTimeout:
                pass  # measured: a second /pause?mode=abort ends the pending wait
        if not waited:
            await r.engine.pause("abort", clear_cache=clear_cache)
        await _ensure_paused(r)
        return {"mode": "abort", "aborted": not waited}

    return EngineStep("drain", "/pause", wait if mode == "wait" else abort)


async def _resume_engine(r: Runner) -> Mapping[str, Any]:
    # The warm-up goes out now, beside /resume: the paused engine holds it until then
    # (measured), so its HTTP and preprocessing overlap this step. The verify has passed.
    detail: dict[str, Any] = {}
    if r.current is not None:
        served = await _served_model(r)
        r.current.send_ahead(WARMUP.phase, lambda: r.engine.warmup(served))
        await asyncio.sleep(0)  # let it go out first
        vllm_driven = r.record.settings.sleep_driver == "vllm"
        if _vllm_sleep(r.current.reports) or (vllm_driven and await r.engine.is_sleeping()):
            # a vLLM sleep the ranks cannot show (CPU, plain vLLM) is ended too (§2.3)
            await _end_vllm_sleep(r)
            detail["vllm_wake_up"] = True
    await r.engine.resume()
    if await r.engine.is_paused():
        raise EngineError("the engine is still paused after /resume")
    return detail


def _vllm_sleep(reports: Mapping[str, Iterable[RankReport]]) -> bool:
    """Whether a rank of this transition said vLLM's own sleep is in force (its verify's
    reply, or the probe before a reconciliation's resume; docs/contracts.md §1.1)."""
    return any(rep.raw.get("vllm_sleep") is True for reps in reports.values() for rep in reps)


async def _end_vllm_sleep(r: Runner) -> None:
    """vLLM's executor still holds itself asleep after our verified wake: end it through
    vLLM's own /wake_up (its workers' backends find nothing asleep), so that vLLM's sleep
    state agrees (docs/contracts.md §1.5)."""
    await r.engine.wake_up()
    if await r.engine.is_sleeping():
        raise EngineError(
            "vLLM's /is_sleeping still answers true after its /wake_up ended the sleep "
            "vLLM made (the verified wake is done; vLLM's own sleep state disagrees)"
        )


async def _served_model(r: Runner) -> str:
    facts = r.record.facts
    if facts.served_model is None:
        facts.learn_served_model(await r.engine.served_model())
    return facts.served_model or ""


async def _warmup(r: Runner) -> Mapping[str, Any]:
    sent = r.current.taken(WARMUP.phase) if r.current is not None else None
    if sent is None:  # a sequence without resume_engine before it
        return {"warmup_s": await r.engine.warmup(await _served_model(r))}
    return {"warmup_s": await sent}


async def _health(r: Runner) -> Mapping[str, Any]:
    if not await r.engine.health(timeout_s=r.timeouts.probe_s):
        raise EngineError("/health answered 503: the engine is dead")
    return {}


@dataclasses.dataclass(frozen=True)
class KvFirst:
    """A sleep's `kv_released` that asks for the fused sleep where it can be one: `notify`
    is called once the engine is drained and quiesced, just before its `hotswap_sleep`
    (which releases the KV records holding only the KV cache first); a sleep that cannot be
    fused calls it between its two suspends, as any `kv_released`."""

    notify: Callable[[], None]

    def __call__(self) -> None:
        self.notify()


def signal(phase: str, notify: Callable[[], None]) -> EngineStep:
    """A step that only tells someone the steps before it have ended (no engine call)."""

    async def call(r: Runner) -> Mapping[str, Any]:
        notify()
        return {}

    return EngineStep(phase, "-", call)


def wait_room(room: Callable[[], Awaitable[None]]) -> EngineStep:
    """A step that waits until `room()` says the device has room for what comes next; its
    error (a HotswapError) fails the transition before anything more is mapped."""

    async def call(r: Runner) -> Mapping[str, Any]:
        try:
            await room()
        except HotswapError:
            raise
        except Exception as exc:  # not ours to pass on raw: the step fails with a reason
            raise EngineError(f"waiting for room failed: {type(exc).__name__}: {exc}") from exc
        return {}

    return EngineStep("wait_room", "-", call)


async def _kv_decide(r: Runner) -> Mapping[str, Any]:
    """After the prepare of a sleep that asked to keep the KV cache: keep it only if every
    rank can; else clear vLLM's prefix cache now, before any block is released, and
    suspend as usual (docs/contracts.md §1.3). The reason goes into the phase's detail."""
    run = r.current
    if run is None or run.params is None:
        raise EngineError("the kv step runs inside a sleep's run")
    keep, why = kv_decision(run.reports.get(protocol.PREPARE.phase, ()))
    if keep:
        return {"kv": "keep"}
    run.params = dataclasses.replace(run.params, keep_kv=False)
    if not await r.engine.reset_prefix_cache():
        raise EngineError(
            "the ranks cannot keep the KV cache and vLLM refused to reset its prefix cache "
            f"(blocks still held); nothing was released ({why})"
        )
    return {"kv": "discard", "reason": why}


def _kv_not_kept(reason: str) -> EngineStep:
    async def say(r: Runner) -> Mapping[str, Any]:
        return {"kv": "discard", "reason": reason}

    return EngineStep("kv", "none", say)


KV_DECIDE = EngineStep("kv", "/reset_prefix_cache", _kv_decide)
LEVEL2_KV = "level 2 discards the weights; the KV cache is kept at level 1 only"
RESUME_ENGINE = EngineStep("resume_engine", "/resume", _resume_engine)
WARMUP = EngineStep("warmup", "/v1/completions", _warmup)
HEALTH = EngineStep("health", "/health", _health)


def sleep_sequence(
    level: int,
    mode: DrainMode,
    grace_s: float,
    kv_released: Callable[[], None] | None = None,
    keep_kv: bool = False,
    fused: bool = False,
) -> tuple[AnyStep, ...]:
    """`kv_released`: split the suspend by pool and call it between the two (the KV cache
    is off the device, the weights not yet). `keep_kv`: the prefix cache is kept across
    the sleep where every rank can keep the KV cache (level 1): the drain does not clear
    it, the kv step decides after the prepare (and clears it if not). At level 2 the kv
    step only says why it was not kept. `fused`: the prepare and the suspend are one
    `hotswap_sleep` where the sleep is at level 1, neither split nor keeping the KV cache
    (the others keep the separate RPCs: a level-2 sleep copies nothing for the prepare to
    run under, and its fused form has not been verified on a GPU)."""
    head: tuple[AnyStep, ...] = ()
    if keep_kv and level != 1:
        head, keep_kv = (_kv_not_kept(LEVEL2_KV),), False
    first: tuple[AnyStep, ...] = (drain(mode, grace_s, clear_cache=not keep_kv),)
    if fused and level == 1 and not keep_kv and isinstance(kv_released, KvFirst):
        quiesce, sleep = protocol.sleep_steps(level, fused=True)
        return (*head, *first, quiesce, signal("kv_first", kv_released), sleep)
    if fused and level == 1 and kv_released is None and not keep_kv:
        return (*head, *first, *protocol.sleep_steps(level, fused=True))
    if kv_released is None:
        quiesce, prepare, suspend = protocol.sleep_steps(level)
        rest: tuple[AnyStep, ...] = (suspend,)
    else:
        quiesce, prepare, kv, weights = protocol.sleep_steps(level, split=True)
        rest = (kv, signal("kv_released", kv_released), weights)
    decide: tuple[AnyStep, ...] = (KV_DECIDE,) if keep_kv else ()
    return (*head, *first, quiesce, prepare, *decide, *rest)


def wake_sequence(
    level: int,
    suspended: Iterable[str] | None = None,
    room: Callable[[], Awaitable[None]] | None = None,
    fused: bool = False,
) -> tuple[AnyStep, ...]:
    """`suspended`: the pools asleep when only some are (a wake a dead sidecar left half
    done, read back by reconciliation); None: as the level's sleep leaves them. At level 2
    with the weights already mapped, they are reloaded anyway: the dead wake may have died
    before its reload (a second reload refills the same checkpoint; verify checks it).
    `room`: awaited before the KV cache is mapped (an overlapped swap: the evicted model's
    weights leave the device while these come in). `fused`: the KV cache's resume and the
    verify are one `hotswap_wake` (protocol.wake_steps); the room is then awaited before it."""
    asleep = None if suspended is None else tuple(suspended)
    rpcs: tuple[AnyStep, ...] = protocol.wake_steps(
        level, asleep, fused=fused, split=room is not None
    )
    if level == 2 and asleep is not None and "weights" not in set(asleep):
        rpcs = (protocol.RELOAD, *rpcs)
    if room is not None and (asleep is None or "kv_cache" in asleep):
        kv = (protocol.RESUME_KV, protocol.RESUME_VERIFY)
        i = next((i for i, s in enumerate(rpcs) if s in kv), None)
        if i is not None:
            rpcs = (*rpcs[:i], wait_room(room), *rpcs[i:])
    return (*rpcs, RESUME_ENGINE, WARMUP)


PROBE: tuple[AnyStep, ...] = (HEALTH, protocol.INFO)
