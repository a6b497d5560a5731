"""Managed mode over fake engine processes: staggered boot, pinning, crash -> FAILED ->
restart with bounded exponential backoff. Each fake process fronts a fresh FakeVllm; while
it is not alive, every HTTP call to it is refused, like a dead server's port."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator, Coroutine
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from support.fakevllm import POOL_BYTES, FakeVllm, wire
from support.wait import until

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings, TimeoutSettings
from controller.errors import EngineStartError, WakeRefused
from controller.fleet.supervisor import Supervisor, with_demotable_engines
from controller.fleet.swap import SwapCoordinator
from controller.models.manager import Manager
from controller.state import Gate, State


@dataclass
class Fleet:
    """The fake machine: processes by model, the order things happened in."""

    events: list[tuple[str, str]] = field(default_factory=list)
    vllm: dict[str, FakeVllm] = field(default_factory=dict)
    procs: dict[str, FakeProcess] = field(default_factory=dict)
    start_failures: dict[str, int] = field(default_factory=dict)  # model -> starts that fail
    # model -> an engine already there (an orphan of a dead sidecar) that answers instead
    orphans: dict[str, FakeVllm] = field(default_factory=dict)
    # model -> event its next boot's wait_ready waits for (a slow boot); one boot only
    slow_boots: dict[str, threading.Event] = field(default_factory=dict)


class FakeProcess:
    """Its exit is told, as a real process's pidfd tells it: `exited()` returns once it ends
    (killed by a test, stopped by the supervisor in a thread, or failed at boot)."""

    def __init__(self, model: ModelSettings, fleet: Fleet) -> None:
        self.name = model.name
        self.fleet = fleet
        self.alive = False
        self.rc: int | None = None
        self.orphans = False  # the keeper was SIGKILLed: the engine's children live on
        self._loop: asyncio.AbstractEventLoop | None = None
        self._gone: asyncio.Event | None = None

    @property
    def returncode(self) -> int | None:
        return self.rc

    def start(self) -> None:
        self.fleet.events.append(("start", self.name))
        orphan = self.fleet.orphans.pop(self.name, None)
        self.fleet.vllm[self.name] = orphan or FakeVllm(name=self.name, world_size=1)
        self.alive = True
        self._loop, self._gone = asyncio.get_running_loop(), asyncio.Event()

    def _end(self, rc: int) -> None:
        self.alive, self.rc = False, rc
        if self._loop is not None and self._gone is not None:
            self._loop.call_soon_threadsafe(self._gone.set)

    def is_alive(self) -> bool:
        return self.alive

    async def exited(self) -> int | None:
        if self._gone is not None:
            await self._gone.wait()
        return self.rc

    def wait_ready(self, timeout_s: float = 0.0, interval_s: float = 0.0) -> float:
        if (slow := self.fleet.slow_boots.pop(self.name, None)) is not None:
            slow.wait(10)
        if self.fleet.start_failures.get(self.name, 0) > 0:
            self.fleet.start_failures[self.name] -= 1
            self._end(1)
            raise EngineStartError(f"engine {self.name} exited with code 1", model=self.name)
        self.fleet.events.append(("ready", self.name))
        return 0.0

    def stop(self, grace_s: float = 0.0) -> int | None:
        self.fleet.events.append(("stop", self.name))
        self.orphans = False
        self._end(0)
        return 0

    def kill(self) -> int | None:
        self.orphans = False
        self._end(-9)
        return -9

    def kill_keeper(self) -> None:
        """SIGKILL of the keeper alone: it exits, the engine's children stay in its group."""
        self.orphans = True
        self._end(-9)

    def group_left(self) -> list[int]:
        return [4242] if self.orphans or self.alive else []


class Router(httpx.AsyncBaseTransport):
    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        name = request.url.host  # a managed engine's URL is http://NAME (its socket aside)
        proc = self.fleet.procs.get(name)
        if proc is None or not proc.alive:
            raise httpx.ConnectError("connection refused", request=request)
        vllm = self.fleet.vllm[name]
        body = request.content
        if request.url.path == "/collective_rpc" and (
            b"hotswap_suspend" in body or b"hotswap_sleep" in body
        ):
            self.fleet.events.append(("suspend", name))
        return await vllm.handle(request)


@dataclass
class World:
    fleet: Fleet
    manager: Manager
    coordinator: SwapCoordinator
    supervisor: Supervisor
    registry: CollectorRegistry

    def state(self, name: str) -> State:
        return self.manager.get(name).snapshot().state

    async def until(self, name: str, state: State, timeout_s: float = 5.0) -> None:
        """Until the model is in `state`, woken by the fleet's changes (nothing polls)."""
        try:
            changes = self.manager.fleet.changes
            await until(lambda: self.state(name) is state, changes, timeout_s=timeout_s)
        except AssertionError:
            raise AssertionError(f"{name} is {self.state(name).value}, not {state.value}") from None


@asynccontextmanager
async def world(
    names: tuple[str, ...] = ("a", "b"),
    pinned: tuple[str, ...] = (),
    swap: dict[str, Any] | None = None,
    **supervisor: Any,
) -> AsyncIterator[World]:
    fleet = Fleet()
    settings = Settings(
        models=[
            ModelSettings.model_validate(
                {"name": n, "command": ["engine", n], "pinned": n in pinned}
            )
            for n in names
        ],
        timeouts=TimeoutSettings(drain_s=1.0, shutdown_s=1.0),
        swap={"max_awake": 1, "min_awake_s": 0.0, **(swap or {})},
        supervisor={
            "restart_backoff_s": 0.05,
            "restart_backoff_max_s": 0.2,
            **supervisor,
        },
    )

    def make(model: ModelSettings) -> FakeProcess:
        proc = FakeProcess(model, fleet)
        fleet.procs[model.name] = proc
        return proc

    side = wire(settings, Router(fleet), process_factory=make)
    manager, coordinator, sup, registry = (
        side.manager,
        side.swap,
        side.supervisor,
        side.registry,
    )
    assert coordinator is not None
    assert sup is not None
    await manager.start()
    try:
        yield World(fleet, manager, coordinator, sup, registry)
    finally:
        await manager.stop()
        await sup.stop()


def run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 20))


def test_boot_is_staggered_each_engine_asleep_before_the_next_starts() -> None:
    async def body() -> None:
        async with world(("a", "b", "c")) as w:
            assert {w.state(n) for n in "abc"} == {State.UNKNOWN}  # the manager left them
            await w.supervisor.boot()
            assert w.fleet.events == [
                ("start", "a"),
                ("ready", "a"),
                ("suspend", "a"),
                ("start", "b"),
                ("ready", "b"),
                ("suspend", "b"),
                ("start", "c"),
                ("ready", "c"),
                ("suspend", "c"),
            ]
            for n in "abc":
                assert w.state(n) is State.SUSPENDED
                snap = w.manager.get(n).snapshot()
                assert snap.gate is Gate.SWAPPABLE  # managed behind the gateway
                assert snap.counts_ready  # asleep by policy is healthy
                assert not snap.ready  # the strict per-model readiness is not
                assert w.manager.fleet[n].holdings.footprint == sum(POOL_BYTES.values())

    run(body())


def test_pinned_models_stay_awake_after_boot() -> None:
    async def body() -> None:
        async with world(("a", "b"), pinned=("a",)) as w:
            await w.supervisor.boot()
            assert w.state("a") is State.RUNNING
            assert w.state("b") is State.SUSPENDED
            assert ("suspend", "a") not in w.fleet.events

    run(body())


def test_a_crashed_engine_is_failed_then_restarted_and_logged(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def body() -> None:
        async with world(("a", "b")) as w:
            w.supervisor.start()
            await asyncio.wait_for(w.supervisor.booted.wait(), 5)
            await w.coordinator.wake(w.manager.get("a"))
            w.fleet.procs["a"].kill()
            await w.until("a", State.FAILED)
            assert "exited with code -9" in (w.manager.get("a").snapshot().last_error or "")
            await w.until("a", State.SUSPENDED)  # restarted, then asleep like at boot
            assert w.registry.get_sample_value("hotswap_engine_restarts_total", {"model": "a"}) == 1
            assert w.fleet.events.count(("start", "a")) == 2
            assert (await w.coordinator.wake(w.manager.get("a"))).outcome is not None
            assert w.state("a") is State.RUNNING

    with caplog.at_level(logging.INFO, logger="hotswap.supervisor"):
        run(body())
    restarts = [r for r in caplog.records if "restart #1" in r.getMessage()]
    assert restarts
    assert all(getattr(r, "model", None) == "a" for r in restarts)


def test_a_failed_transition_restarts_the_engine() -> None:
    async def body() -> None:
        async with world(("a", "b")) as w:
            w.supervisor.start()
            await asyncio.wait_for(w.supervisor.booted.wait(), 5)
            w.fleet.vllm["a"].fail["hotswap_restore_and_verify"] = "mismatch"
            with pytest.raises(Exception, match="differ"):
                await w.coordinator.wake(w.manager.get("a"))
            assert w.state("a") in (State.FAILED, State.STARTING)
            await w.until("a", State.SUSPENDED)
            assert w.fleet.events.count(("start", "a")) == 2
            await w.coordinator.wake(w.manager.get("a"))  # the fresh engine has no injected failure
            assert w.state("a") is State.RUNNING

    run(body())


def test_restarts_back_off_exponentially_up_to_the_cap(caplog: pytest.LogCaptureFixture) -> None:
    async def body() -> None:
        async with world(("a",)) as w:
            w.fleet.start_failures["a"] = 4  # the boot and three restarts fail
            w.supervisor.start()
            await w.until("a", State.SUSPENDED, timeout_s=10)
            assert w.fleet.events.count(("start", "a")) == 5
            assert w.manager.fleet["a"].process.restarts == 4

    with caplog.at_level(logging.WARNING, logger="hotswap.supervisor"):
        run(body())
    delays = [
        float(r.getMessage().split(" in ")[-1].split(" s")[0])
        for r in caplog.records
        if "restart #" in r.getMessage()
    ]
    assert delays == [0.05, 0.1, 0.2, 0.2]  # doubling, capped at restart_backoff_max_s


def test_a_start_answered_by_an_orphan_is_never_taken_for_its_own_engine() -> None:
    """The engine that answers made memory steps (here: it is fully asleep): not the process
    just started. The old probe made a STARTING model RUNNING whatever answered."""

    async def body() -> None:
        async with world(("a",), pinned=("a",)) as w:
            w.fleet.orphans["a"] = FakeVllm(name="a", world_size=1).asleep(1)
            await w.supervisor.boot()
            snap = w.manager.get("a").snapshot()
            assert snap.state is State.FAILED
            assert not snap.ready
            assert "not the process just started" in str(snap.last_error)

    run(body())


def test_no_lock_is_held_across_a_boot() -> None:
    """b's engine takes its time to boot; a wake of a on the same device, which fits, goes
    on meanwhile (the device lock covers the plan, not the boot of up to boot_timeout_s)."""

    async def body() -> None:
        async with world(("a", "b"), swap={"max_awake": 2}) as w:
            slow = w.fleet.slow_boots["b"] = threading.Event()
            w.supervisor.start()
            await w.until("a", State.SUSPENDED)
            await w.until("b", State.STARTING)
            try:
                await asyncio.wait_for(w.coordinator.wake(w.manager.get("a")), 2.0)
                assert w.state("a") is State.RUNNING
                assert w.state("b") is State.STARTING  # still booting
            finally:
                slow.set()
            await asyncio.wait_for(w.supervisor.booted.wait(), 5)
            assert w.state("b") is State.SUSPENDED

    run(body())


def test_a_booting_model_counts_at_its_footprint_meanwhile() -> None:
    """With room for one awake model, a wake during b's boot is refused with a retry (the
    gateway holds and retries), not run into the memory b's engine is taking."""

    async def body() -> None:
        async with world(("a", "b")) as w:
            slow = w.fleet.slow_boots["b"] = threading.Event()
            w.supervisor.start()
            await w.until("b", State.STARTING)
            try:
                with pytest.raises(WakeRefused, match=r"b \(STARTING\)") as refused:
                    await asyncio.wait_for(w.coordinator.wake(w.manager.get("a")), 2.0)
                assert refused.value.retry_after_s == 1.0
            finally:
                slow.set()
            await asyncio.wait_for(w.supervisor.booted.wait(), 5)
            await w.coordinator.wake(w.manager.get("a"))
            assert w.state("a") is State.RUNNING

    run(body())


def test_a_failed_engine_counts_until_its_process_is_gone() -> None:
    async def body() -> None:
        async with world(("a", "b")) as w:
            await w.supervisor.boot()
            assert w.coordinator.engine_gone(w.manager.fleet["a"]) is False
            w.fleet.procs["a"].kill()
            assert w.coordinator.engine_gone(w.manager.fleet["a"]) is True
            assert w.coordinator.engine_gone(w.manager.fleet["b"]) is False

    run(body())


def test_a_host_budget_makes_the_managed_engines_demotable_unless_their_env_says() -> None:
    """HOTSWAP_DEMOTABLE is off by default (it costs every level-1 sleep on CUDA); under a
    host budget the sidecar turns it on for the engines it starts, keeping a model's own
    value; attached engines and a fleet without a budget are left as they are."""

    def fleet(**swap: Any) -> Settings:
        return Settings(
            models=[
                ModelSettings(name="a", command=["vllm", "serve", "/m/a"]),  # type: ignore[call-arg]
                ModelSettings(  # type: ignore[call-arg]
                    name="b", command=["vllm", "serve", "/m/b"], env={"HOTSWAP_DEMOTABLE": "0"}
                ),
                ModelSettings(name="c", url="http://c:8000"),  # type: ignore[call-arg]
            ],
            swap=swap,  # type: ignore[arg-type]
        )

    plain = fleet()
    assert with_demotable_engines(plain, {}) is plain
    told = fleet(host_budget=64 << 30)  # the sidecar's own environment says: left as it is
    assert with_demotable_engines(told, {"HOTSWAP_DEMOTABLE": "0"}) is told
    budgeted = with_demotable_engines(fleet(host_budget=64 << 30), {})
    env = {m.name: m.env for m in budgeted.models}
    assert env["a"]["HOTSWAP_DEMOTABLE"] == "1"
    assert env["b"]["HOTSWAP_DEMOTABLE"] == "0"  # the model's own word
    assert "HOTSWAP_DEMOTABLE" not in env["c"]  # attached: started by someone else


@pytest.mark.parametrize(
    ("method", "settled"),
    [("hotswap_wake", State.SUSPENDED), ("hotswap_sleep", State.RUNNING)],
)
def test_a_recoverable_failure_is_left_to_the_reconciliation(method: str, settled: State) -> None:
    """A step every rank refuses before touching memory (`ok: false`) fails the request,
    and the reconciliation finds the engine as it was (asleep, or awake and resumed): the
    supervisor leaves that engine alone. It used to see the FAILED of the failed step, mark
    the model FAILED again after the reconciliation and replace the engine (on a GPU: the
    host copy lost, a cold boot)."""

    async def body() -> None:
        async with world(("a", "b")) as w:
            w.supervisor.start()
            await asyncio.wait_for(w.supervisor.booted.wait(), 5)
            if method == "hotswap_sleep":
                await w.coordinator.wake(w.manager.get("a"))
            vllm = w.fleet.vllm["a"]
            vllm.fail[method] = "rank"
            # The reconciliation after the failed step reads the engine back: held at its
            # /health while the model is FAILED, the watch loop has its turn meanwhile.
            health = vllm.block("/health")
            step = (
                w.coordinator.sleep(w.manager.get("a"))
                if method == "hotswap_sleep"
                else w.coordinator.wake(w.manager.get("a"))
            )
            request = asyncio.ensure_future(step)
            await asyncio.wait_for(vllm.entered["/health"].wait(), 5)
            assert w.state("a") is State.FAILED
            await asyncio.sleep(0.1)
            health.set()
            with pytest.raises(Exception, match="fake"):
                await request
            del vllm.fail[method]
            assert w.state("a") is settled
            for _ in range(20):  # the watch loop's turn, and a restart's backoff
                await asyncio.sleep(0.02)
                assert w.state("a") is settled
            assert w.fleet.events.count(("start", "a")) == 1
            assert w.registry.get_sample_value("hotswap_engine_restarts_total", {"model": "a"}) in (
                None,
                0,
            )
            if settled is State.SUSPENDED:
                await w.coordinator.wake(w.manager.get("a"))
            assert w.state("a") is State.RUNNING

    run(body())


def test_a_lost_keepers_group_is_ended_before_a_new_engine_starts() -> None:
    """A keeper SIGKILLed leaves the engine's children in its process group (on a GPU they
    keep its memory). The restart ends that group first; it used to stop only a keeper
    still alive, and started a second engine beside the orphans."""

    async def body() -> None:
        async with world(("a", "b")) as w:
            w.supervisor.start()
            await asyncio.wait_for(w.supervisor.booted.wait(), 5)
            old = w.fleet.procs["a"]
            w.fleet.events.clear()
            old.kill_keeper()
            for _ in range(500):
                if ("start", "a") in w.fleet.events:
                    break
                await asyncio.sleep(0.01)
            await w.until("a", State.SUSPENDED)  # restarted, asleep again
            assert w.fleet.events.index(("stop", "a")) < w.fleet.events.index(("start", "a"))
            assert old.group_left() == []

    run(body())
