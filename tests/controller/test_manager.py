"""ModelManager and Manager against the fake engine world (fakevllm.FakeVllm) played by
httpx.MockTransport.

The world keeps the little state the sequences need (paused, suspended pools, level) and
answers like vLLM 0.32 with the hotswap extension (the pause semantics as measured, see
docs/contracts.md). Each call advances a fake clock by a cost the test chooses, so phase
durations are exact.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from support.fakevllm import FakeVllm
from support.rig import FakeClock, Rig, make_rig

from controller import protocol
from controller.engines.engine import RankError
from controller.errors import (
    BarrierTimeout,
    DrainTimeout,
    EngineError,
    EngineTimeout,
    EngineUnavailable,
    HotswapError,
    ModelNotFound,
    TransitionConflict,
    VerificationFailed,
)
from controller.models import steps
from controller.state import Action, State


async def _refuse(r: httpx.Request) -> httpx.Response:
    raise httpx.ConnectError("connection refused", request=r)


async def _fail_500(r: httpx.Request) -> httpx.Response:
    """What vLLM answers when a collective_rpc raised in a worker."""
    return httpx.Response(500, json={"error": {"message": "Call to collective_rpc failed"}})


def _assert_failed_unverified(rig: Rig, phase: str) -> None:
    """A wake whose verification failed: FAILED, never verified, the phase named, counted."""
    snap = rig.m.snapshot()
    assert snap.state is State.FAILED
    assert not snap.verified
    assert snap.last_transition is not None
    assert snap.last_transition.failed_phase == phase
    assert rig.sample("hotswap_verification_failures_total", model="m") == 1


async def started(**kw: Any) -> Rig:
    rig = make_rig(**kw)
    await rig.manager.start()
    rig.world.calls.clear()
    rig.world.requests.clear()
    return rig


def _rpc_errors(rig: Rig, method: str) -> float:
    """hotswap_engine_rpc_errors_total of model m's `method`, over every reason."""
    reasons = ("rank_failed", "timeout", "error", "unavailable")
    return sum(
        rig.sample("hotswap_engine_rpc_errors_total", model="m", method=method, reason=r)
        for r in reasons
    )


SLEEP_CALLS = [
    "/pause?wait",
    "/is_paused",
    "hotswap_quiesce",
    "hotswap_prepare",
    "hotswap_suspend",
]
WAKE_CALLS_1 = [
    "hotswap_resume",
    "hotswap_resume",
    "hotswap_restore_and_verify",
    "/v1/completions",  # the warm-up, sent before /resume: the paused engine holds it
    "/resume",
    "/is_paused",
]
# The default (fused_sleep): the prepare and the suspend in one hotswap_sleep.
SLEEP_CALLS_FUSED = [*SLEEP_CALLS[:3], "hotswap_sleep"]
# The default (fused_wake): the resumes and the verify in one hotswap_wake.
WAKE_CALLS_FUSED = ["hotswap_wake", *WAKE_CALLS_1[3:]]  # the served name: known from the probe


@pytest.mark.anyio
async def test_start_probes_running_engine() -> None:
    rig = make_rig()
    assert rig.m.snapshot().state is State.UNKNOWN
    await rig.manager.start()
    snap = rig.m.snapshot()
    assert snap.state is State.RUNNING
    assert snap.verified
    assert snap.ready
    # Read back without an RPC first (readiness, pause, the process's start time), then
    # every rank's own truth and the names the API server serves (its identity).
    assert rig.world.calls == [
        "/health",
        "/is_paused",
        "/is_sleeping",
        "/metrics",
        "hotswap_info",
        "/v1/models",
    ]
    assert rig.sample("hotswap_model_state", model="m", state="RUNNING") == 1.0
    assert rig.sample("hotswap_model_ready", model="m") == 1.0
    await rig.manager.stop()


@pytest.mark.anyio
async def test_start_probes_suspended_engine_and_keeps_its_level() -> None:
    rig = make_rig()
    rig.world.suspended = {"weights": "discarded", "kv_cache": "discarded"}
    rig.world.level = 2
    rig.world.paused = True
    rig.world.set_truth(phase="suspended", phase_level=2, phase_tags=["kv_cache", "weights"])
    await rig.manager.start()
    snap = rig.m.snapshot()
    assert snap.state is State.SUSPENDED
    assert snap.level == 2
    assert not snap.verified
    await rig.manager.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("asleep", [False, True])
async def test_start_learns_the_awake_footprint_from_the_pools_its_ranks_list(asleep: bool) -> None:
    """An attached engine found asleep (or awake) at start-up is counted at its pools'
    bytes from then on, not as the largest model known until its first sleep through the
    sidecar (the H200 density run: the 1B models found asleep were counted as 8B ones, 40
    GiB, so its warm-up woke three models and the first swaps evicted for room not needed)."""
    rig = make_rig()
    if asleep:
        rig.world.suspended = {"weights": "offloaded", "kv_cache": "discarded"}
        rig.world.level = 1
        rig.world.paused = True
        rig.world.set_truth(phase="suspended", phase_level=1, phase_tags=["kv_cache", "weights"])
    await rig.manager.start()
    assert rig.m.snapshot().state is (State.SUSPENDED if asleep else State.RUNNING)
    assert rig.manager.fleet["m"].holdings.footprint == 2 * (1000 + 500)  # over both ranks
    await rig.manager.stop()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("paused", "truth", "state", "calls"),
    [
        # A sleep stopped before it suspended anything (its sidecar died): resumed.
        (True, {"snapshot_held": True}, State.RUNNING, ["/resume", "/is_paused"]),
        # ... and a wake of vLLM's own sleep stopped after its verify (its sidecar died):
        # vLLM's executor still holds itself asleep; vLLM's /wake_up ends that first.
        (
            True,
            {"vllm_sleep": True},
            State.RUNNING,
            ["/wake_up", "/is_sleeping", "/resume", "/is_paused"],
        ),
        # A wake stopped before its verify: finished.
        (
            True,
            {"phase": "resumed_unverified", "phase_level": 1, "snapshot_held": True},
            State.RUNNING,
            ["hotswap_restore_and_verify", "/resume", "/is_paused"],
        ),
        # ... but not once the protected copies are gone.
        (True, {"phase": "resumed_unverified", "phase_level": 1}, State.FAILED, []),
        # Pools asleep while the engine serves: never RUNNING.
        (
            False,
            {"phase": "suspended", "phase_level": 1, "phase_tags": ["kv_cache"]},
            State.FAILED,
            [],
        ),
    ],
)
async def test_start_finishes_what_a_dead_sidecar_left_or_fails_with_the_reason(
    paused: bool, truth: dict[str, Any], state: State, calls: list[str]
) -> None:
    """The old start-up probe read only `suspended` and called all of these RUNNING."""
    rig = make_rig()
    rig.world.paused = paused
    rig.world.set_truth(**truth)
    await rig.manager.start()
    snap = rig.m.snapshot()
    assert snap.state is state, snap.last_error
    assert snap.verified is (state is State.RUNNING)
    assert [c for c in rig.world.calls[5:] if c not in ("/v1/models", "/v1/completions")] == calls
    if state is State.FAILED:
        assert snap.last_error
    await rig.manager.stop()


@pytest.mark.anyio
async def test_start_unreachable_engine_is_failed_with_reason() -> None:
    rig = make_rig()

    rig.world.overrides["/health"] = _refuse
    await rig.manager.start()
    snap = rig.m.snapshot()
    assert snap.state is State.FAILED
    assert snap.last_error is not None
    assert "connection refused" in snap.last_error
    assert snap.last_transition is not None
    assert snap.last_transition.failed_phase == "health"
    with pytest.raises(TransitionConflict, match="FAILED"):
        await rig.m.wake()
    await rig.manager.stop()


@pytest.mark.anyio
async def test_sleep_and_wake_level_1_in_sequence_order_with_timed_phases() -> None:
    rig = await started(quiesce_s=3.0, fused=False, fused_sleep=False)
    w = rig.world
    w.costs = {"hotswap_quiesce": 0.01, "hotswap_suspend": 0.5, "hotswap_resume": 0.2}
    out = await rig.m.sleep(1)
    assert out.action is Action.BEGIN
    assert w.calls == SLEEP_CALLS
    quiesce = json.loads(w.requests[2].content)
    assert quiesce == {"method": "hotswap_quiesce", "args": [3.0], "kwargs": {}}
    assert [json.loads(w.requests[i].content)["args"] for i in (3, 4)] == [[1], [1]]
    snap = rig.m.snapshot()
    assert snap.state is State.SUSPENDED
    assert snap.level == 1
    assert not snap.verified
    rec = out.transition
    assert rec is not None
    assert rec is snap.last_transition
    assert rec.result == "ok"
    assert [p.name for p in rec.phases] == ["drain", "quiesce", "prepare", "suspend"]
    assert [p.duration_s for p in rec.phases] == pytest.approx([0.0, 0.01, 0.0, 0.5])
    assert rec.duration_s == pytest.approx(0.51)
    suspend = rec.phases[-1]
    assert [r["rank"] for r in suspend.ranks] == [0, 1]
    assert suspend.detail["freed_bytes"] == {"weights": 2000, "kv_cache": 1000}
    assert rig.sample("hotswap_bytes_released_total", model="m", pool="weights") == 2000
    assert rig.sample("hotswap_model_state", model="m", state="SUSPENDED") == 1.0

    w.calls.clear()
    w.requests.clear()
    out = await rig.m.wake()
    assert out.action is Action.BEGIN
    assert w.calls == WAKE_CALLS_1
    assert [json.loads(w.requests[i].content)["args"] for i in (0, 1)] == [
        [["weights"]],
        [["kv_cache"]],
    ]
    snap = rig.m.snapshot()
    assert snap.state is State.RUNNING
    assert snap.verified
    assert snap.level is None
    assert out.transition is not None
    assert [p.name for p in out.transition.phases] == [
        "resume_weights",
        "resume_kv_cache",
        "restore_and_verify",
        "resume_engine",
        "warmup",
    ]
    assert out.transition.duration_s == pytest.approx(0.4)
    assert rig.sample("hotswap_bytes_restored_total", model="m", pool="kv_cache") == 1000
    labels = {"model": "m", "kind": "sleep", "phase": "suspend"}
    assert rig.sample("hotswap_phase_duration_seconds_count", **labels) == 1
    assert rig.sample("hotswap_phase_duration_seconds_sum", **labels) == pytest.approx(0.5)
    ok = {"model": "m", "kind": "wake", "from_state": "SUSPENDED", "to_state": "RUNNING"}
    assert rig.sample("hotswap_transitions_total", result="ok", **ok) == 1
    assert rig.sample(
        "hotswap_transition_duration_seconds_sum", model="m", kind="wake"
    ) == pytest.approx(0.4)
    await rig.manager.stop()


@pytest.mark.anyio
async def test_level_2_wake_reloads_between_the_resumes_with_the_reload_timeout() -> None:
    rig = await started(reload_s=321.0, fused=False)
    await rig.m.sleep(2)
    assert rig.world.suspended == {"weights": "discarded", "kv_cache": "discarded"}
    rig.world.calls.clear()
    rig.world.requests.clear()
    out = await rig.m.wake()
    assert rig.world.calls[:4] == [
        "hotswap_resume",
        "hotswap_reload",
        "hotswap_resume",
        "hotswap_restore_and_verify",
    ]
    assert rig.world.calls[4:] == WAKE_CALLS_1[3:]
    assert rig.world.requests[1].extensions["timeout"]["read"] == 321.0
    assert out.transition is not None
    assert out.transition.level == 2
    assert rig.m.snapshot().state is State.RUNNING
    await rig.manager.stop()


@pytest.mark.anyio
async def test_a_fused_level_1_wake_is_one_rpc_then_resume_and_warmup() -> None:
    """fused_wake (the default): the resumes and the verify are one hotswap_wake; the
    bytes it brought back are counted and the model is RUNNING, verified, only after it."""
    clock = FakeClock()
    rig = await started(clock=clock)
    w = rig.world
    w.costs.update({"hotswap_resume": 0.3, "hotswap_restore_and_verify": 0.05})
    await rig.m.sleep(1)
    w.calls.clear()
    w.requests.clear()
    out = await rig.m.wake()
    assert w.calls == WAKE_CALLS_FUSED
    assert json.loads(w.requests[0].content) == {"method": "hotswap_wake", "args": [], "kwargs": {}}
    snap = rig.m.snapshot()
    assert (snap.state, snap.verified, snap.level) == (State.RUNNING, True, None)
    assert out.transition is not None
    assert [p.name for p in out.transition.phases] == [
        "resume_and_verify",
        "resume_engine",
        "warmup",
    ]
    fused = out.transition.phases[0]
    assert fused.duration_s == pytest.approx(0.35)
    assert [r["rank"] for r in fused.ranks] == [0, 1]
    assert fused.detail["restored_bytes"] == {"weights": 2000, "kv_cache": 1000}
    assert rig.sample("hotswap_bytes_restored_total", model="m", pool="weights") == 2000
    assert w.suspended == {}
    await rig.manager.stop()


@pytest.mark.anyio
async def test_a_fused_level_2_wake_reloads_before_one_hotswap_wake() -> None:
    rig = await started(reload_s=321.0)
    await rig.m.sleep(2)
    rig.world.calls.clear()
    rig.world.requests.clear()
    await rig.m.wake()
    assert rig.world.rpc_calls() == ["hotswap_resume", "hotswap_reload", "hotswap_wake"]
    assert json.loads(rig.world.requests[0].content)["args"] == [["weights"]]
    assert rig.world.requests[1].extensions["timeout"]["read"] == 321.0
    assert rig.m.snapshot().state is State.RUNNING
    await rig.manager.stop()


@pytest.mark.anyio
async def test_a_wake_that_races_a_demotion_wakes_at_the_level_the_demotion_left() -> None:
    """A wake asked while `hotswap_demote` is in flight waits for the model's lock and only
    then reads the level: the level-2 sequence (the weights reloaded). It read level 1
    before the lock and sent a level-1 wake to a level-2 sleeper (refused: FAILED)."""
    rig = await started()
    await rig.m.sleep(1)
    gate = rig.world.block("hotswap_demote")
    demotion = asyncio.ensure_future(rig.m.demote())
    await asyncio.wait_for(rig.world.entered["hotswap_demote"].wait(), 5)
    wake = asyncio.ensure_future(rig.m.wake())
    await asyncio.sleep(0.05)  # the wake's task is waiting for the lock
    rig.world.calls.clear()
    gate.set()
    assert (await demotion).level == 2
    await asyncio.wait_for(wake, 5)
    assert rig.world.rpc_calls() == ["hotswap_resume", "hotswap_reload", "hotswap_wake"]
    assert rig.m.snapshot().state is State.RUNNING
    assert rig.m.snapshot().verified
    await rig.manager.stop()


@pytest.mark.anyio
async def test_a_fused_wake_whose_verify_mismatches_is_failed_and_never_resumed() -> None:
    """A mismatch inside hotswap_wake fails the wake as the verify's own RPC would: FAILED,
    the tensors named, /resume never sent, the RPC never sent again."""
    rig = await started()
    await rig.m.sleep(1)
    rig.world.calls.clear()
    rig.world.fail["hotswap_wake"] = "mismatch"
    with pytest.raises(VerificationFailed) as info:
        await rig.m.wake()
    assert info.value.tensors == ["model.embed_scale"]
    assert info.value.phase == "resume_and_verify"
    assert "/resume" not in rig.world.calls
    assert rig.world.rpc_calls().count("hotswap_wake") == 1
    _assert_failed_unverified(rig, "resume_and_verify")
    await rig.manager.stop()


@pytest.mark.anyio
async def test_the_fused_sleep_is_quiesce_then_one_hotswap_sleep() -> None:
    """fused_sleep (the default): after the drain, the quiesce and one hotswap_sleep(level)
    (the prepare and the suspend in one RPC); its reports count the bytes freed and what
    the ranks left on the device, as a suspend's do; the wake after it is verified."""
    rig = await started(quiesce_s=3.0)
    w = rig.world
    w.resident_bytes = 7
    out = await rig.m.sleep(1)
    assert out.action is Action.BEGIN
    assert w.calls == SLEEP_CALLS_FUSED
    assert json.loads(w.requests[3].content)["args"] == [1]
    snap = rig.m.snapshot()
    assert snap.state is State.SUSPENDED
    assert snap.level == 1
    t = snap.last_transition
    assert t is not None
    assert [p.name for p in t.phases] == ["drain", "quiesce", "prepare_and_suspend"]
    fused = t.phases[-1]
    assert [r["rank"] for r in fused.ranks] == [0, 1]
    assert all(r["freed_bytes"] == {"weights": 1000, "kv_cache": 500} for r in fused.ranks)
    assert all(r["fingerprinted"] == 2 for r in fused.ranks)  # the prepare's keys too
    assert snap.resident_bytes == 14  # 7 per rank, read from the fused report
    freed = rig.sample(
        "hotswap_bytes_released_total", model="m", pool="weights"
    )  # fmt: skip
    assert freed == 2000
    w.calls.clear()
    await rig.m.wake()
    assert w.calls == WAKE_CALLS_FUSED
    assert rig.m.snapshot().state is State.RUNNING
    await rig.manager.stop()


def test_a_sleep_that_keeps_the_kv_cache_is_split_or_at_level_2_is_never_fused() -> None:
    """The fused sleep is only the plain level-1 one: a sleep that keeps the KV cache needs
    every rank's prepare answer before its suspend, an overlapped swap's sleep suspends the
    KV cache and the weights apart, and a level-2 sleep copies nothing to put the prepare
    under (its fused form is not verified on a GPU); all keep the separate RPCs."""
    plain = steps.sleep_sequence(1, "wait", 1.0, fused=True)
    assert [s.phase for s in plain] == ["drain", "quiesce", "prepare_and_suspend"]
    keep = steps.sleep_sequence(1, "wait", 1.0, keep_kv=True, fused=True)
    assert [s.phase for s in keep] == ["drain", "quiesce", "prepare", "kv", "suspend"]
    split = steps.sleep_sequence(1, "wait", 1.0, kv_released=lambda: None, fused=True)
    assert "prepare_and_suspend" not in [s.phase for s in split]
    assert [s.phase for s in split][-1] == "suspend_weights"
    first = steps.sleep_sequence(
        1, "wait", 1.0, kv_released=steps.KvFirst(lambda: None), fused=True
    )
    assert [s.phase for s in first] == ["drain", "quiesce", "kv_first", "prepare_and_suspend"]
    unfused = steps.sleep_sequence(1, "wait", 1.0, kv_released=steps.KvFirst(lambda: None))
    assert [s.phase for s in unfused][-3:] == ["suspend_kv_cache", "kv_released", "suspend_weights"]
    level2 = steps.sleep_sequence(2, "wait", 1.0, keep_kv=True, fused=True)
    assert [s.phase for s in level2] == ["kv", "drain", "quiesce", "prepare", "suspend"]
    with pytest.raises(ValueError, match="split"):
        protocol.sleep_steps(1, split=True, fused=True)


@pytest.mark.anyio
@pytest.mark.parametrize("failure", ["http500", "timeout", "rank"])
@pytest.mark.parametrize("part", ["hotswap_sleep", "hotswap_prepare", "hotswap_suspend"])
async def test_a_failed_fused_sleep_is_failed_and_never_resent(failure: str, part: str) -> None:
    """A hotswap_sleep that fails (as a whole or in either part, by HTTP or by a rank) is
    a failed transition: never sent again, never followed by a separate prepare or
    suspend, never ready; the ranks' truth read back decides what it left."""
    rig = await started()
    rig.world.fail[part] = failure
    with pytest.raises(HotswapError):
        await rig.m.sleep(1)
    calls = rig.world.rpc_calls()
    assert calls.count("hotswap_sleep") == 1
    assert "hotswap_suspend" not in calls
    assert "hotswap_prepare" not in calls
    snap = rig.m.snapshot()
    assert not snap.ready
    assert snap.state in (State.FAILED, State.RUNNING)  # RUNNING: read back, untouched
    t = snap.last_transition
    assert t is not None
    assert t.result == "failed"
    assert t.failed_phase == "prepare_and_suspend"
    if failure == "rank":  # rank 0 slept, rank 1 did not: never a model in a state unknown
        assert snap.state is State.FAILED
    assert _rpc_errors(rig, "hotswap_sleep") == 1
    await rig.manager.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("failure", ["http500", "timeout", "rank"])
async def test_a_failed_fused_wake_is_failed_and_never_resent(failure: str) -> None:
    rig = await started()
    await rig.m.sleep(1)
    rig.world.calls.clear()
    rig.world.fail["hotswap_wake"] = failure
    with pytest.raises(HotswapError):
        await rig.m.wake()
    assert rig.world.rpc_calls().count("hotswap_wake") == 1
    assert "/resume" not in rig.world.calls
    snap = rig.m.snapshot()
    assert not snap.ready
    assert snap.state in (State.FAILED, State.SUSPENDED)  # SUSPENDED: read back, untouched
    assert _rpc_errors(rig, "hotswap_wake") == 1
    await rig.manager.stop()


def _vllms_own_sleep(world: FakeVllm, level: int = 1) -> None:
    """As vLLM's /sleep through the hotswap backend leaves it: paused, every rank suspended
    and saying vLLM's own sleep is in force (docs/contracts.md §1.5)."""
    world.asleep(level)
    world.set_truth(vllm_sleep=True)


@pytest.mark.anyio
@pytest.mark.parametrize("fused", [True, False])
async def test_the_sidecars_wake_of_vllms_own_sleep_ends_it_through_vllms_wake_up(
    fused: bool,
) -> None:
    """The verify's replies say vLLM's own sleep is in force: after them, vLLM's /wake_up
    (its executor's flag cleared, its scheduler resumed) and /is_sleeping false, then the
    usual /resume. The old wake sent /resume only and left vLLM asleep by its own flag."""
    rig = make_rig(fused=fused)
    _vllms_own_sleep(rig.world)
    await rig.manager.start()
    assert rig.m.snapshot().state is State.SUSPENDED
    rig.world.calls.clear()
    out = await rig.m.wake()
    assert (out.snapshot.state, out.snapshot.verified) == (State.RUNNING, True)
    tail = ["/v1/completions", "/wake_up", "/is_sleeping", "/resume", "/is_paused"]
    assert rig.world.calls[-len(tail) :] == tail
    assert not rig.world.vllm_asleep()
    assert out.transition is not None
    (resumed,) = [p for p in out.transition.phases if p.name == "resume_engine"]
    assert resumed.detail == {"vllm_wake_up": True}
    # the next wake of the sidecar's own sleep sends no /wake_up
    await rig.m.sleep(1)
    rig.world.calls.clear()
    await rig.m.wake()
    assert "/wake_up" not in rig.world.calls
    await rig.manager.stop()


@pytest.mark.anyio
async def test_vllm_still_sleeping_after_its_wake_up_fails_the_wake_with_the_reason() -> None:
    rig = make_rig()
    _vllms_own_sleep(rig.world)
    await rig.manager.start()

    async def ignored(r: httpx.Request) -> httpx.Response:
        return httpx.Response(200)  # answered, but vLLM's flag stays set

    rig.world.overrides["/wake_up"] = ignored
    with pytest.raises(HotswapError, match="is_sleeping still answers true"):
        await rig.m.wake()
    snap = rig.m.snapshot()
    assert snap.state is State.FAILED
    assert snap.last_error is not None
    assert "is_sleeping" in snap.last_error
    assert "/resume" not in rig.world.calls
    await rig.manager.stop()


@pytest.mark.anyio
async def test_the_warm_up_goes_out_before_resume_and_the_model_is_ready_after_its_answer() -> None:
    """The warm-up is sent as /resume is (the paused engine holds it): it reaches the
    engine while it is still paused, and RUNNING comes only after it answered."""
    rig = await started()
    for _ in range(2):  # the second wake knows the served model already
        await rig.m.sleep(1)
        rig.world.calls.clear()
        held = rig.world.held_while_paused
        gate = rig.world.block("/v1/completions")
        wake = asyncio.create_task(rig.m.wake())
        await rig.world.entered["/v1/completions"].wait()
        await asyncio.sleep(0.01)  # /resume and /is_paused answer meanwhile
        assert rig.world.held_while_paused == held + 1
        assert "/resume" in rig.world.calls
        assert rig.m.snapshot().state is State.RESUMING
        gate.set()
        out = await wake
        assert (out.snapshot.state, out.snapshot.verified) == (State.RUNNING, True)
        assert out.transition is not None
        assert [p.name for p in out.transition.phases][-2:] == ["resume_engine", "warmup"]
        del rig.world.gates["/v1/completions"]
    assert rig.world.calls[1:] == ["/v1/completions", "/resume", "/is_paused"]
    await rig.manager.stop()


@pytest.mark.anyio
async def test_a_failed_resume_cancels_the_warm_up_sent_with_it() -> None:
    rig = await started()
    await rig.m.sleep(1)
    rig.world.fail["/resume"] = "http500"
    with pytest.raises(HotswapError):
        await rig.m.wake()
    await asyncio.sleep(0)
    assert rig.world.held_while_paused >= 1  # it went out (and again with each retry)
    pending = [t for t in asyncio.all_tasks() if "warmup" in repr(t.get_coro())]
    assert pending == []  # cancelled, not left waiting on the paused engine
    assert rig.m.snapshot().state is State.FAILED
    await rig.manager.stop()


@pytest.mark.anyio
async def test_noop_requests_answer_the_current_state_without_engine_calls() -> None:
    rig = await started()
    out = await rig.m.wake()
    assert out.action is Action.NOOP
    assert out.transition is None
    assert out.snapshot.state is State.RUNNING
    await rig.m.sleep(1)
    rig.world.calls.clear()
    out = await rig.m.sleep(2)
    assert out.action is Action.NOOP
    assert rig.world.calls == []
    assert rig.m.snapshot().level == 1
    await rig.manager.stop()


@pytest.mark.anyio
async def test_concurrent_wakes_coalesce_into_one_engine_sequence() -> None:
    rig = await started()
    await rig.m.sleep(1)
    rig.world.calls.clear()
    gate = rig.world.block("hotswap_restore_and_verify")
    first = asyncio.create_task(rig.m.wake())
    await asyncio.sleep(0)
    assert rig.m.snapshot().state is State.RESUMING
    others = [asyncio.create_task(rig.m.wake()) for _ in range(3)]
    await asyncio.sleep(0.01)
    gate.set()
    outs = await asyncio.gather(first, *others)
    assert [o.action for o in outs] == [Action.BEGIN] + [Action.JOIN] * 3
    assert len({id(o.transition) for o in outs}) == 1
    assert rig.world.calls == WAKE_CALLS_FUSED
    await rig.manager.stop()


@pytest.mark.anyio
async def test_opposite_requests_in_flight_conflict_and_same_ones_join() -> None:
    rig = await started()
    gate = rig.world.block("hotswap_suspend")
    sleeping = asyncio.create_task(rig.m.sleep(1))
    await asyncio.sleep(0.01)
    assert rig.m.snapshot().state is State.SUSPENDING
    assert not rig.m.snapshot().ready  # admission closed at once
    with pytest.raises(TransitionConflict, match="sleep is in flight") as info:
        await rig.m.wake()
    assert info.value.status == 409
    joined = asyncio.create_task(rig.m.sleep(2))
    await asyncio.sleep(0)
    gate.set()
    a, b = await asyncio.gather(sleeping, joined)
    assert (a.action, b.action) == (Action.BEGIN, Action.JOIN)
    assert rig.world.rpc_calls().count("hotswap_sleep") == 1  # its suspend part was held

    gate = rig.world.block("hotswap_restore_and_verify")
    waking = asyncio.create_task(rig.m.wake())
    await asyncio.sleep(0.01)
    with pytest.raises(TransitionConflict, match="wake is in flight"):
        await rig.m.sleep(1)
    gate.set()
    await waking
    assert rig.m.snapshot().state is State.RUNNING
    await rig.manager.stop()


@pytest.mark.anyio
async def test_drain_wait_gives_up_resumes_and_stays_running() -> None:
    rig = await started()
    rig.world.in_flight_s = 10.0
    with pytest.raises(DrainTimeout) as info:
        await rig.m.sleep(1, drain="wait", drain_timeout_s=2.0)
    assert info.value.status == 504
    assert rig.world.calls == ["/pause?wait", "/resume", "/is_paused"]
    assert not rig.world.paused
    snap = rig.m.snapshot()
    assert snap.state is State.RUNNING
    assert snap.verified
    assert snap.ready
    assert snap.last_transition is not None
    assert snap.last_transition.result == "gave_up"
    assert snap.last_transition.duration_s == pytest.approx(2.0)
    gave_up = {"model": "m", "kind": "sleep", "from_state": "RUNNING", "to_state": "RUNNING"}
    assert rig.sample("hotswap_transitions_total", result="gave_up", **gave_up) == 1
    # The model can sleep again once the requests are gone.
    rig.world.in_flight_s = 0.0
    assert (await rig.m.sleep(1)).snapshot.state is State.SUSPENDED
    await rig.manager.stop()


@pytest.mark.anyio
async def test_drain_wait_that_cannot_resume_is_failed() -> None:
    rig = await started()
    rig.world.in_flight_s = 10.0

    async def stuck(r: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "resumed"})  # ...but nothing resumes

    rig.world.overrides["/resume"] = stuck
    with pytest.raises(EngineError, match="still paused"):
        await rig.m.sleep(1, drain_timeout_s=1.0)
    assert rig.m.snapshot().state is State.FAILED
    await rig.manager.stop()


@pytest.mark.anyio
async def test_drain_abort_without_grace_aborts_at_once() -> None:
    rig = await started()
    rig.world.in_flight_s = 10.0
    out = await rig.m.sleep(1, drain="abort")
    assert rig.world.calls[:2] == ["/pause?abort", "/is_paused"]
    assert out.transition is not None
    assert out.transition.phases[0].duration_s == 0.0
    assert rig.m.snapshot().state is State.SUSPENDED
    await rig.manager.stop()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("in_flight_s", "calls"), [(0.5, ["/pause?wait"]), (5.0, ["/pause?wait", "/pause?abort"])]
)
async def test_drain_abort_grace_lets_requests_finish_then_aborts(
    in_flight_s: float, calls: list[str]
) -> None:
    rig = await started()
    rig.world.in_flight_s = in_flight_s
    out = await rig.m.sleep(1, drain="abort", drain_timeout_s=1.0)
    assert rig.world.calls[: len(calls) + 1] == [*calls, "/is_paused"]
    assert out.transition is not None
    assert out.transition.phases[0].duration_s == pytest.approx(min(in_flight_s, 1.0))
    assert rig.m.snapshot().state is State.SUSPENDED
    await rig.manager.stop()


@pytest.mark.anyio
async def test_pause_that_does_not_hold_fails_before_memory_is_touched() -> None:
    rig = await started()

    async def resumed_meanwhile(r: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"status": "paused"})  # measured: not proof of a pause

    rig.world.overrides["/pause?wait"] = resumed_meanwhile
    with pytest.raises(EngineError, match="not paused"):
        await rig.m.sleep(1)
    # Reconciled after the failed step: every rank awake and verified, the engine unpaused.
    assert rig.world.rpc_calls() == ["hotswap_info"]
    snap = rig.m.snapshot()
    assert snap.state is State.RUNNING
    assert snap.verified
    assert snap.last_error is not None
    assert "not paused" in snap.last_error
    await rig.manager.stop()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("fused_sleep", "method", "phase"),
    [(True, "hotswap_sleep", "prepare_and_suspend"), (False, "hotswap_suspend", "suspend")],
)
async def test_slow_engine_rpc_timeout_is_failed_and_never_resent(
    fused_sleep: bool, method: str, phase: str
) -> None:
    rig = await started(rpc_s=7.0, fused_sleep=fused_sleep)

    async def slow(r: httpx.Request) -> httpx.Response:
        raise httpx.ReadTimeout("timed out", request=r)

    rig.world.overrides["hotswap_suspend"] = slow  # the fused sleep's suspend part too
    with pytest.raises(EngineTimeout) as info:
        await rig.m.sleep(1)
    assert info.value.status == 504
    assert info.value.model == "m"
    assert info.value.phase == phase
    assert rig.world.rpc_calls().count(method) == 1
    assert "hotswap_suspend" not in rig.world.rpc_calls()[: -1 if not fused_sleep else None]
    snap = rig.m.snapshot()
    assert snap.state is State.FAILED
    assert not snap.ready
    assert snap.last_transition is not None
    assert snap.last_transition.result == "failed"
    assert snap.last_transition.failed_phase == phase
    assert snap.last_error is not None
    assert "within 7 s" in snap.last_error
    err = {"model": "m", "method": method, "reason": "timeout"}
    assert rig.sample("hotswap_engine_rpc_errors_total", **err) == 1
    failed = {"model": "m", "kind": "sleep", "from_state": "RUNNING", "to_state": "FAILED"}
    assert rig.sample("hotswap_transitions_total", result="failed", **failed) == 1
    # FAILED refuses both directions: restart the engine.
    for call in (rig.m.sleep, rig.m.wake):
        with pytest.raises(TransitionConflict, match="restart"):
            await call()
    assert rig.world.rpc_calls().count(method) == 1
    await rig.manager.stop()


@pytest.mark.anyio
async def test_failing_engine_500_is_failed_502() -> None:
    rig = await started()

    rig.world.overrides["hotswap_prepare"] = _fail_500
    with pytest.raises(EngineError) as info:
        await rig.m.sleep(1)
    assert type(info.value) is EngineError
    assert info.value.status == 502
    assert rig.m.snapshot().state is State.FAILED
    assert rig.m.engine.connections_dropped == 1
    assert "hotswap_suspend" not in rig.world.calls
    await rig.manager.stop()


@pytest.mark.anyio
async def test_unreachable_engine_during_wake_is_failed() -> None:
    rig = await started(fused=False)
    await rig.m.sleep(1)

    async def gone(r: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=r)

    rig.world.overrides["hotswap_resume"] = gone
    with pytest.raises(EngineUnavailable) as info:
        await rig.m.wake()
    assert info.value.may_desync is False  # never connected: nothing was delivered
    snap = rig.m.snapshot()
    # Reconciled after the failed step: the ranks are still asleep, the engine paused.
    assert snap.state is State.SUSPENDED
    assert snap.last_transition is not None
    assert snap.last_transition.kind == "reconcile"
    assert snap.last_error is not None
    assert snap.last_error.startswith("resume_weights: ")
    err = {"model": "m", "method": "hotswap_resume", "reason": "unavailable"}
    assert rig.sample("hotswap_engine_rpc_errors_total", **err) == 1
    await rig.manager.stop()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("fused_sleep", "method"), [(True, "hotswap_sleep"), (False, "hotswap_prepare")]
)
async def test_rank_not_ok_is_failed_with_every_rank_report_kept(
    fused_sleep: bool, method: str
) -> None:
    rig = await started(fused_sleep=fused_sleep)

    async def rank1_fails(r: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            json={
                "results": [
                    {"ok": True, "rank": 0, "protected": 0},
                    {"ok": False, "rank": 1, "error": "RuntimeError: host copy failed"},
                ]
            },
        )

    rig.world.overrides["hotswap_prepare"] = rank1_fails
    with pytest.raises(RankError, match="rank 1: RuntimeError: host copy failed") as info:
        await rig.m.sleep(1)
    assert [(r["rank"], r["ok"]) for r in info.value.ranks] == [(0, True), (1, False)]
    # Nothing was suspended (every rank awake and verified, the engine paused by the drain):
    # reconciliation resumes the engine.
    snap = rig.m.snapshot()
    assert snap.state is State.RUNNING
    assert snap.verified
    assert rig.world.calls[-4:-2] == ["/resume", "/is_paused"] or "/resume" in rig.world.calls
    assert not rig.world.paused
    assert snap.last_error is not None
    assert "rank 1" in snap.last_error
    err = {"model": "m", "method": method, "reason": "rank_failed"}
    assert "hotswap_suspend" not in rig.world.rpc_calls()  # never a separate suspend after it
    assert rig.sample("hotswap_engine_rpc_errors_total", **err) == 1
    await rig.manager.stop()


@pytest.mark.anyio
async def test_late_ranks_are_named() -> None:
    rig = await started(ranks=4)

    async def late(r: httpx.Request) -> httpx.Response:
        rig.world.set_truth(poisoned=True)  # as the extension reports a failed barrier
        reports = [
            {"ok": rank not in (2, 3), "rank": rank, "barrier_s": 10.0, "late_ranks": [2, 3]}
            for rank in range(4)
        ]
        for rep in reports:
            if not rep["ok"]:
                rep["error"] = "barrier timed out"
        return httpx.Response(200, json={"results": reports})

    rig.world.overrides["hotswap_quiesce"] = late
    with pytest.raises(BarrierTimeout, match=r"ranks \[2, 3\]") as info:
        await rig.m.sleep(1)
    assert info.value.late_ranks == [2, 3]
    assert info.value.status == 504
    assert info.value.to_dict()["late_ranks"] == [2, 3]
    snap = rig.m.snapshot()
    assert snap.state is State.FAILED
    assert snap.last_error is not None
    assert "[2, 3]" in snap.last_error
    assert snap.last_error.startswith("quiesce: ranks")  # the phase named once, not twice
    assert snap.last_transition is not None
    assert len(snap.last_transition.phases[-1].ranks) == 4
    assert "hotswap_prepare" not in rig.world.calls
    err = {"model": "m", "method": "hotswap_quiesce", "reason": "barrier_timeout"}
    assert rig.sample("hotswap_engine_rpc_errors_total", **err) == 1
    await rig.manager.stop()


class HangQuiesce(httpx.AsyncBaseTransport):
    """The world for every call but hotswap_quiesce, which goes to a socket that never answers."""

    def __init__(self, world: httpx.AsyncBaseTransport, port: int) -> None:
        self.world = world
        self.real = httpx.AsyncHTTPTransport()
        self.port = port

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/collective_rpc" and b"hotswap_quiesce" in request.content:
            moved = httpx.Request(
                request.method,
                request.url.copy_with(host="127.0.0.1", port=self.port),
                headers=request.headers,
                content=request.content,
                extensions=request.extensions,
            )
            return await self.real.handle_async_request(moved)
        return await self.world.handle_async_request(request)

    async def aclose(self) -> None:
        await self.real.aclose()


@pytest.mark.anyio
async def test_hanging_engine_times_out_over_a_real_socket() -> None:
    """The HTTP client timeout, not the fake, ends a call to an engine that never answers."""
    accepted: list[asyncio.StreamWriter] = []

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)

    server = await asyncio.start_server(never_answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    rig = make_rig(wrap=lambda t: HangQuiesce(t, port), rpc_s=0.2, quiesce_s=0.05, control_s=0.05)
    await rig.manager.start()
    loop = asyncio.get_running_loop()
    started_at = loop.time()
    with pytest.raises(EngineTimeout, match="ranks unknown"):
        await rig.m.sleep(1, drain="abort")
    elapsed = loop.time() - started_at
    assert 0.2 <= elapsed < 5.0
    assert rig.m.snapshot().state is State.FAILED
    assert len(accepted) == 1  # sent once, never resent
    assert "hotswap_prepare" not in rig.world.calls
    await rig.manager.stop()
    for writer in accepted:
        writer.close()
    server.close()
    await server.wait_closed()


@pytest.mark.anyio
async def test_verification_mismatch_names_the_tensors_and_stays_out_of_rotation() -> None:
    rig = await started(fused=False)
    await rig.m.sleep(1)

    async def mismatch(r: httpx.Request) -> httpx.Response:
        return httpx.Response(
            200,
            json={
                "results": [
                    {
                        "ok": False,
                        "rank": 0,
                        "error": "2 mismatched",
                        "mismatched": ["a.scale", "b"],
                    },
                    {"ok": False, "rank": 1, "error": "1 mismatched", "mismatched": ["a.scale"]},
                ]
            },
        )

    rig.world.overrides["hotswap_restore_and_verify"] = mismatch
    with pytest.raises(VerificationFailed) as info:
        await rig.m.wake()
    assert info.value.tensors == ["a.scale", "b"]
    assert info.value.phase == "restore_and_verify"
    assert "/resume" not in rig.world.calls[-3:]  # never re-enters scheduling
    _assert_failed_unverified(rig, "restore_and_verify")
    await rig.manager.stop()


@pytest.mark.anyio
async def test_cancelled_caller_does_not_cancel_the_sequence() -> None:
    rig = await started()
    gate = rig.world.block("hotswap_suspend")
    caller = asyncio.create_task(rig.m.sleep(1))
    await asyncio.sleep(0.01)
    caller.cancel()
    with pytest.raises(asyncio.CancelledError):
        await caller
    gate.set()
    task = rig.m.task
    assert task is not None
    assert task.get_name() == "hotswap-sleep-m"
    await task
    assert rig.m.snapshot().state is State.SUSPENDED
    await rig.manager.stop()


@pytest.mark.anyio
async def test_begin_returns_at_once_and_the_outcome_lands_in_the_snapshot() -> None:
    rig = await started()
    gate = rig.world.block("hotswap_suspend")
    out = rig.m.begin_sleep(1)
    assert out.action is Action.BEGIN
    assert out.snapshot.state is State.SUSPENDING
    assert rig.world.calls == []
    gate.set()
    task = rig.m.task
    assert task is not None
    await task
    assert rig.m.snapshot().state is State.SUSPENDED
    assert rig.m.begin_sleep().action is Action.NOOP
    out = rig.m.begin_wake()
    assert out.snapshot.state is State.RESUMING
    task = rig.m.task
    assert task is not None
    await task
    assert rig.m.snapshot().state is State.RUNNING
    await rig.manager.stop()


@pytest.mark.anyio
async def test_begin_sleep_failure_is_kept_in_the_snapshot() -> None:
    rig = await started()

    rig.world.overrides["hotswap_suspend"] = _fail_500  # the fused sleep's suspend part
    rig.m.begin_sleep(1)
    task = rig.m.task
    assert task is not None
    await asyncio.wait([task])
    snap = rig.m.snapshot()
    assert snap.state is State.FAILED
    assert snap.last_transition is not None
    assert snap.last_transition.failed_phase == "prepare_and_suspend"
    await rig.manager.stop()


@pytest.mark.anyio
async def test_stop_cancels_transitions_that_outlast_the_shutdown_timeout() -> None:
    rig = await started(shutdown_s=0.05)
    rig.world.block("hotswap_suspend")  # never released (the fused sleep's suspend part)
    rig.m.begin_sleep(1)
    await asyncio.sleep(0.01)
    await rig.manager.stop()
    snap = rig.m.snapshot()
    assert snap.state is State.FAILED
    assert snap.last_error is not None
    assert "cancelled" in snap.last_error
    assert snap.last_transition is not None
    assert snap.last_transition.failed_phase == "prepare_and_suspend"


@pytest.mark.anyio
async def test_audit_and_info_pass_through_per_rank_lists() -> None:
    rig = await started()
    ranks = await rig.m.audit(2)
    assert [r["rank"] for r in ranks] == [0, 1]
    body = json.loads(rig.world.requests[-1].content)
    assert body == {"method": "hotswap_audit", "args": [2, True], "kwargs": {}}
    assert len(await rig.m.info()) == 2
    assert rig.m.snapshot().state is State.RUNNING

    rig.world.overrides["hotswap_audit"] = _fail_500
    with pytest.raises(EngineError):
        await rig.m.audit(1)
    assert rig.m.snapshot().state is State.FAILED
    with pytest.raises(TransitionConflict):
        await rig.m.info()
    await rig.manager.stop()


@pytest.mark.anyio
async def test_manager_get_unknown_model_and_snapshots() -> None:
    rig = await started()
    with pytest.raises(ModelNotFound) as info:
        rig.manager.get("nope")
    assert info.value.status == 404
    assert set(rig.manager.snapshots()) == {"m"}
    assert rig.sample("hotswap_model_state_since_seconds", model="m") == rig.m.snapshot().since
    await rig.manager.stop()


@pytest.mark.anyio
async def test_bad_request_values_are_refused_before_anything_changes() -> None:
    rig = await started()
    with pytest.raises(ValueError, match="level"):
        await rig.m.sleep(3)
    with pytest.raises(ValueError, match="drain"):
        await rig.m.sleep(1, drain="later")  # type: ignore[arg-type]
    assert rig.m.snapshot().state is State.RUNNING
    assert rig.world.calls == []
    await rig.manager.stop()


@pytest.mark.anyio
async def test_engine_unreachable_at_start_is_probed_once_it_answers() -> None:
    rig = make_rig()
    rig.world.overrides["/health"] = _refuse
    await rig.manager.start()
    assert rig.m.snapshot().state is State.FAILED
    assert not await rig.m.check_recovered()  # still down
    del rig.world.overrides["/health"]
    assert await rig.m.check_recovered()
    assert rig.m.snapshot().state is State.RUNNING
    assert rig.m.snapshot().ready
    await rig.manager.stop()


@pytest.mark.anyio
async def test_engine_failed_mid_transition_is_never_called_again_until_it_restarts() -> None:
    """A failed RPC may leave vLLM's reply queues out of step: no new RPC to the same process;
    only after the engine was seen down (restarted) is it probed afresh."""
    rig = await started()

    rig.world.overrides["hotswap_prepare"] = _fail_500
    with pytest.raises(EngineError):
        await rig.m.sleep(1)
    assert rig.m.snapshot().state is State.FAILED
    assert "prepare" in str(rig.m.snapshot().last_error)  # the failed step's own reason kept
    rig.world.calls.clear()
    assert not await rig.m.check_recovered()  # up, but the same process: hands off
    assert rig.world.calls == ["/health", "/is_paused", "/is_sleeping", "/metrics"]
    rig.world.overrides["/health"] = _refuse  # down for a while...
    assert not await rig.m.check_recovered()
    del rig.world.overrides["/health"]  # ...and back, but the same process (same start time)
    assert not await rig.m.check_recovered()
    assert rig.world.rpc_calls() == []
    with pytest.raises(TransitionConflict, match="out of step"):
        await rig.m.info()
    del rig.world.overrides["hotswap_prepare"]
    rig.world.fresh()  # the operator restarts it: a new process
    assert await rig.m.check_recovered()
    assert rig.m.snapshot().state is State.RUNNING
    await rig.m.sleep(1)  # and it serves transitions again
    assert rig.m.snapshot().state is State.SUSPENDED
    await rig.manager.stop()


@pytest.mark.anyio
async def test_the_watcher_task_recovers_a_failed_engine_in_the_background() -> None:
    rig = make_rig(reprobe_interval_s=0.01)
    rig.world.overrides["/health"] = _refuse
    await rig.manager.start()
    assert rig.m.snapshot().state is State.FAILED
    del rig.world.overrides["/health"]
    for _ in range(200):  # bounded: 2 s at most
        if rig.m.snapshot().state is State.RUNNING:
            break
        await asyncio.sleep(0.01)
    assert rig.m.snapshot().state is State.RUNNING
    await rig.manager.stop()


@pytest.mark.anyio
async def test_an_engine_restarted_behind_the_sidecars_back_while_suspended_is_running() -> None:
    """The old sidecar kept it SUSPENDED; its next wake failed ("pools not suspended") and
    left it FAILED for good. The periodic pass sees the new process and reads it back."""
    rig = await started()
    await rig.m.sleep(1)
    assert rig.m.snapshot().state is State.SUSPENDED
    rig.world.calls.clear()
    assert not await rig.m.check_recovered()  # as probed: no RPC at all
    assert rig.world.rpc_calls() == []
    rig.world.fresh()
    assert await rig.m.check_recovered()
    snap = rig.m.snapshot()
    assert snap.state is State.RUNNING
    assert snap.verified
    assert rig.world.rpc_calls() == ["hotswap_info"]
    assert (await rig.m.wake()).action is Action.NOOP
    await rig.manager.stop()


@pytest.mark.anyio
async def test_a_running_engine_someone_paused_is_not_ready_until_resumed() -> None:
    rig = await started()
    rig.world.paused = True  # e.g. an operator's /pause
    assert await rig.m.check_recovered()
    snap = rig.m.snapshot()
    assert snap.state is State.RUNNING  # reconciled: resumed, warmed up, verified
    assert not rig.world.paused
    await rig.manager.stop()


@pytest.mark.anyio
async def test_a_sleep_through_vllms_own_cumem_behind_the_sidecars_back_is_failed() -> None:
    """vLLM's /sleep with its own cumem backend pauses the engine and releases the pools
    without the extension: the ranks still say awake and verified, but their allocator
    holds pools asleep. The reconciliation fails the model instead of resuming an engine
    with freed memory (the old code resumed it and called it RUNNING)."""
    rig = await started()
    rig.world.paused = True  # vLLM's own sleep pauses its scheduler first
    rig.world.set_truth(allocator_asleep=["kv_cache", "weights"])
    await rig.m.check_recovered()
    snap = rig.m.snapshot()
    assert snap.state is State.FAILED
    assert "asleep in vLLM's allocator" in (snap.last_error or "")
    assert rig.world.paused  # never resumed
    await rig.manager.stop()


@pytest.mark.anyio
async def test_an_audit_is_refused_while_a_transition_is_in_flight() -> None:
    rig = await started()
    gate = rig.world.block("hotswap_prepare")
    task = asyncio.create_task(rig.m.sleep(1))
    for _ in range(1000):  # bounded: the fake answers at once
        if "hotswap_prepare" in rig.world.calls:
            break
        await asyncio.sleep(0)
    with pytest.raises(TransitionConflict, match="in flight"):
        await rig.m.audit(1)
    assert rig.world.rpc_calls().count("hotswap_audit") == 0
    gate.set()
    await task
    await rig.manager.stop()


@pytest.mark.anyio
async def test_an_audit_waits_for_a_reconciliation_of_the_sidecars_own() -> None:
    """The periodic reprobe holds the model's lock with no transition in flight: an audit
    then waits for it and answers, instead of a 409 for a check nobody asked for."""
    rig = await started()
    lock = rig.m.passthrough._lock
    await lock.acquire()  # as check_recovered does around its reconciliation
    audit = asyncio.create_task(rig.m.audit(1))
    for _ in range(50):  # bounded: the audit must be waiting, not refused
        await asyncio.sleep(0)
    assert not audit.done()
    lock.release()
    reports = await asyncio.wait_for(audit, 10.0)
    assert reports
    assert rig.world.rpc_calls().count("hotswap_audit") == 1
    await rig.manager.stop()


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("raised", "state", "out_of_step"),
    [
        (httpx.ConnectError, State.RUNNING, False),  # never delivered: nothing changes
        (httpx.ReadTimeout, State.FAILED, True),  # a reply may still come: out of step
    ],
)
async def test_a_failed_audit_changes_the_state_only_when_the_queues_may_be_out_of_step(
    raised: type[httpx.TransportError], state: State, out_of_step: bool
) -> None:
    rig = await started()

    async def fail(r: httpx.Request) -> httpx.Response:
        raise raised("nope", request=r)

    rig.world.overrides["hotswap_audit"] = fail
    with pytest.raises(EngineError) as info:
        await rig.m.audit(1)
    assert info.value.to_dict()["queues_may_be_out_of_step"] is out_of_step
    assert rig.m.snapshot().state is state
    await rig.manager.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("level", [1, 2])
async def test_a_half_done_wake_read_back_resumes_only_what_is_still_asleep(level: int) -> None:
    """A sidecar died after the weights came back: the next wake must not resume them again
    (the extension refuses: "pools not suspended"), but reloads them at level 2."""
    rig = make_rig(fused=False)
    rig.world.paused = True
    rig.world.level = level
    rig.world.suspended = {"kv_cache": "discarded"}
    rig.world.set_truth(phase="suspended", phase_level=level, phase_tags=["kv_cache"])
    rig.world.set_truth(snapshot_held=True)
    await rig.manager.start()
    assert rig.m.snapshot().state is State.SUSPENDED
    rig.world.calls.clear()
    out = await rig.m.wake()
    assert out.snapshot.state is State.RUNNING
    rpcs = rig.world.rpc_calls()
    assert rpcs == ["hotswap_reload"] * (level == 2) + [
        "hotswap_resume",
        "hotswap_restore_and_verify",
    ]
    resume = next(
        json.loads(r.content) for r in rig.world.requests if b"hotswap_resume" in r.content
    )
    assert resume["args"] == [["kv_cache"]]
    await rig.manager.stop()


@pytest.mark.anyio
@pytest.mark.parametrize("level", [1, 2])
async def test_a_half_done_fused_wake_read_back_reloads_at_level_2_then_one_hotswap_wake(
    level: int,
) -> None:
    """The same half-done wake with the fused RPC: hotswap_wake maps back what is still
    asleep (the KV cache) and verifies; level 2 reloads first (the dead wake may have died
    before its reload)."""
    rig = make_rig()
    rig.world.paused = True
    rig.world.level = level
    rig.world.suspended = {"kv_cache": "discarded"}
    rig.world.set_truth(phase="suspended", phase_level=level, phase_tags=["kv_cache"])
    rig.world.set_truth(snapshot_held=True)
    await rig.manager.start()
    rig.world.calls.clear()
    out = await rig.m.wake()
    assert out.snapshot.state is State.RUNNING
    assert rig.world.rpc_calls() == ["hotswap_reload"] * (level == 2) + ["hotswap_wake"]
    assert rig.world.suspended == {}
    await rig.manager.stop()


@pytest.mark.anyio
async def test_a_periodic_pass_in_suspended_does_not_shorten_the_next_wake() -> None:
    """Seen on real servers: a pass that found the cache right forgot which pools were
    asleep, and the wake went straight to the verify of still-suspended pools."""
    rig = await started()
    await rig.m.sleep(1)
    assert not await rig.m.check_recovered()
    rig.world.calls.clear()
    await rig.m.wake()
    assert rig.world.rpc_calls() == ["hotswap_wake"]  # it maps back both pools, then verifies
    assert rig.world.suspended == {}
    await rig.manager.stop()
