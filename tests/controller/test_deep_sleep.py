"""The deep sleep (docs/contracts.md §2.2) through the control API: fake vLLM engines
(MockTransport) and the checkpoint helper run for real against its file-backed fake driver
(HOTSWAP_CUDACKPT_FAKE). The engine's "processes" are this test's own process group, and the
fake driver says this process holds a CUDA context."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry
from support import asgi
from support.fakesidecar import make_settings, make_sidecar
from support.fakevllm import FakeVllm
from support.wait import until

from controller.config.modelsettings import ModelSettings
from controller.config.settings import Settings, TimeoutSettings
from controller.sidecar import Sidecar
from controller.state import State

pytestmark = pytest.mark.anyio


@dataclass
class GroupOf:
    """An engine process as the deep sleep sees it: its keeper's pid, the process group."""

    pid: int


@pytest.fixture
def driver(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    (tmp_path / "cuda").write_text(f"{os.getpid()} 123456\n")
    monkeypatch.setenv("HOTSWAP_CUDACKPT_FAKE", str(tmp_path))
    return tmp_path


@pytest.fixture
def other_group() -> Iterator[subprocess.Popen[bytes]]:
    """A process in a process group of its own: a second engine's for the fake driver."""
    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait(5)


def driver_states(driver: Path) -> set[str]:
    path = driver / "state.json"
    return set(json.loads(path.read_text()).values()) if path.exists() else {"running"}


@asynccontextmanager
async def deep_sidecar(
    fake: FakeVllm, *, reachable: bool = True, **model: Any
) -> AsyncIterator[tuple[httpx.AsyncClient, Sidecar]]:
    settings = make_settings({"a": fake}, None, a=model)
    sc = make_sidecar(settings, {"a": fake}, CollectorRegistry())
    if reachable:
        sc.fleet["a"].process.engine = GroupOf(os.getpgid(0))  # type: ignore[assignment]
    app = sc.app
    async with asgi.client(app, "http://s") as client:
        await sc.started.wait()  # the start-up probes run once the app serves
        yield client, sc


def phases(body: dict[str, Any]) -> list[str]:
    return [p["name"] for p in body["transition"]["phases"]]


async def test_deep_sleep_then_wake(driver: Path) -> None:
    fake = FakeVllm(name="a")
    async with deep_sidecar(fake) as (client, _):
        r = await client.post("/models/a/sleep", json={"deep": True})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["state"] == "SUSPENDED"
        assert phases(body)[-1] == "checkpoint"
        snap = (await client.get("/models/a")).json()
        assert snap["deep"] is True
        assert snap["resident_bytes"] == 0  # NVML's figure after the checkpoint
        assert snap["fleet"]["deepable"] is True
        assert driver_states(driver) == {"checkpointed"}
        metrics = (await client.get("/metrics")).text
        assert 'hotswap_model_deep{model="a"} 1.0' in metrics
        assert 'hotswap_deep_sleeps_total{model="a",result="ok"} 1.0' in metrics
        calls = len(fake.calls)
        r = await client.get("/models/a/audit?level=1")  # a checkpointed rank answers nothing
        assert r.status_code == 409
        assert len(fake.calls) == calls
        r = await client.post("/models/a/wake")
        assert r.status_code == 200, r.text
        assert phases(r.json())[0] == "restore"
        assert r.json()["state"] == "RUNNING"
        assert driver_states(driver) == {"running"}
        assert (await client.get("/models/a")).json()["deep"] is False


async def test_a_cpu_engine_is_refused_and_nothing_changes(driver: Path) -> None:
    (driver / "cuda").write_text("")  # no process holds a CUDA context
    fake = FakeVllm(name="a")
    async with deep_sidecar(fake) as (client, _):
        calls = len(fake.calls)
        r = await client.post("/models/a/sleep", json={"deep": True})
        assert r.status_code == 422
        assert r.json()["error"] == "DeepSleepRefused"
        assert "CUDA context" in r.json()["message"]
        assert len(fake.calls) == calls
        snap = (await client.get("/models/a")).json()
        assert snap["state"] == "RUNNING"
        assert snap["fleet"]["deepable"] is False


@pytest.mark.parametrize(("file", "says"), [("noapi", "lacks"), ("nodriver", "no CUDA driver")])
async def test_a_driver_without_the_api_is_refused(driver: Path, file: str, says: str) -> None:
    (driver / file).write_text("")
    async with deep_sidecar(FakeVllm(name="a")) as (client, _):
        r = await client.post("/models/a/sleep?wait=false", json={"deep": True})
        assert r.status_code == 422
        assert says in r.json()["message"]
        assert (await client.get("/models/a")).json()["state"] == "RUNNING"


async def test_an_engine_out_of_reach_is_refused(driver: Path) -> None:
    async with deep_sidecar(FakeVllm(name="a"), reachable=False) as (client, _):
        r = await client.post("/models/a/sleep", json={"deep": True})
        assert r.status_code == 422
        assert "can be reached" in r.json()["message"]


@pytest.mark.parametrize("fail", ["lock", "checkpoint"])
async def test_a_failed_checkpoint_leaves_it_asleep_not_deep(driver: Path, fail: str) -> None:
    (driver / "fail").write_text(fail)
    async with deep_sidecar(FakeVllm(name="a")) as (client, _):
        r = await client.post("/models/a/sleep", json={"deep": True})
        assert r.status_code == 200, r.text
        snap = (await client.get("/models/a")).json()
        assert snap["state"] == "SUSPENDED"
        assert snap["deep"] is False
        assert fail in snap["deep_error"]
        assert snap["last_transition"]["phases"][-1]["ok"] is False
        assert driver_states(driver) == {"running"}
        (driver / "fail").unlink()
        r = await client.post("/models/a/wake")  # an ordinary wake, no restore
        assert r.status_code == 200
        assert "restore" not in phases(r.json())


async def test_a_failed_restore_is_failed_and_sends_nothing(driver: Path) -> None:
    fake = FakeVllm(name="a")
    async with deep_sidecar(fake) as (client, _):
        assert (await client.post("/models/a/sleep", json={"deep": True})).status_code == 200
        (driver / "fail").write_text("restore")
        calls = len(fake.calls)
        r = await client.post("/models/a/wake")
        assert r.status_code == 502
        snap = (await client.get("/models/a")).json()
        assert snap["state"] == "FAILED"
        assert "restore" in snap["last_error"]
        assert [c for c in fake.calls[calls:] if c.startswith("hotswap_")] == []


async def test_a_sleeper_asked_deep_is_deepened(driver: Path) -> None:
    async with deep_sidecar(FakeVllm(name="a")) as (client, _):
        assert (await client.post("/models/a/sleep", json={"level": 1})).status_code == 200
        r = await client.post("/models/a/sleep", json={"deep": True})
        assert r.status_code == 200, r.text
        snap = (await client.get("/models/a")).json()
        assert (snap["state"], snap["deep"], snap["level"]) == ("SUSPENDED", True, 1)
        assert snap["last_transition"]["kind"] == "deepen"


async def test_deep_sleep_always_is_the_models_setting(driver: Path) -> None:
    async with deep_sidecar(FakeVllm(name="a"), deep_sleep="always") as (client, _):
        assert (await client.post("/models/a/sleep")).status_code == 200
        assert (await client.get("/models/a")).json()["deep"] is True
        assert (await client.post("/models/a/wake")).status_code == 200
        r = await client.post("/models/a/sleep", json={"deep": False})
        assert r.status_code == 200
        assert (await client.get("/models/a")).json()["deep"] is False


async def test_a_restarted_sidecar_finds_a_checkpointed_engine(driver: Path) -> None:
    """No RPC reaches it while deep; its wake restores, asks the ranks their level, wakes."""
    fake = FakeVllm(name="a").asleep(level=1)
    (driver / "state.json").write_text(json.dumps({str(os.getpid()): "checkpointed"}))
    async with deep_sidecar(fake) as (client, _):
        snap = (await client.get("/models/a")).json()
        assert (snap["state"], snap["deep"], snap["ready"]) == ("SUSPENDED", True, False)
        assert [c for c in fake.calls if c.startswith("hotswap_")] == []
        r = await client.post("/models/a/wake")
        assert r.status_code == 200, r.text
        assert phases(r.json())[:2] == ["restore", "info"]
        assert r.json()["state"] == "RUNNING"
        assert driver_states(driver) == {"running"}


@pytest.fixture
def same_group() -> Iterator[subprocess.Popen[bytes]]:
    """A process in this test's process group: one more process of the engine."""
    proc = subprocess.Popen(["sleep", "60"])
    yield proc
    proc.kill()
    proc.wait(5)


async def test_a_process_without_a_context_is_left_running(
    driver: Path, same_group: subprocess.Popen[bytes]
) -> None:
    """A process of the engine the driver knows (it ran cuInit) with no device memory in
    NVML, as vLLM's API server: the deep sleep and its wake leave it alone (each call on
    the rank's process timed), and a restarted sidecar still finds the engine deep."""
    (driver / "cuda").write_text(f"{os.getpid()} 123456\n{same_group.pid} 0\n")
    async with deep_sidecar(FakeVllm(name="a")) as (client, _):
        r = await client.post("/models/a/sleep", json={"deep": True})
        assert r.status_code == 200, r.text
        ckpt = r.json()["transition"]["phases"][-1]["detail"]
        assert ckpt["pids"] == [os.getpid()]  # the probe left the other one out
        assert ckpt["driver_by_pid"][str(os.getpid())].keys() == {"lock", "checkpoint"}
        assert json.loads((driver / "state.json").read_text()) == {str(os.getpid()): "checkpointed"}
    async with deep_sidecar(FakeVllm(name="a").asleep(level=1)) as (client, _):
        snap = (await client.get("/models/a")).json()
        assert (snap["state"], snap["deep"]) == ("SUSPENDED", True)  # not "mixed"
        r = await client.post("/models/a/wake")
        assert r.status_code == 200, r.text
        assert r.json()["state"] == "RUNNING"
        assert driver_states(driver) == {"running"}


async def test_mixed_driver_states_are_failed(driver: Path) -> None:
    (driver / "cuda").write_text(f"{os.getpid()}\n{os.getppid()}\n")
    ppid_in_group = os.getpgid(os.getppid()) == os.getpgid(0)
    if not ppid_in_group:
        pytest.skip("the parent is in another process group here")
    (driver / "state.json").write_text(json.dumps({str(os.getpid()): "checkpointed"}))
    async with deep_sidecar(FakeVllm(name="a").asleep()) as (client, _):
        assert (await client.get("/models/a")).json()["state"] == "FAILED"


def fleet_of(
    names: str, deep_sleep: str = "pressure", **swap: Any
) -> tuple[Any, dict[str, FakeVllm]]:
    """A sidecar over fake ranks named by the letters of `names`, each leaving 1,000 bytes
    resident asleep, every model at `deep_sleep`; `swap` settings (a budget of 27,000 bytes
    unless given). Returns the sidecar and its fakes."""
    fakes = {n: FakeVllm(name=n, resident_bytes=1000) for n in names}
    settings = Settings(
        models=[
            ModelSettings(name=n, url=f"http://{n}.engine.test", deep_sleep=deep_sleep)
            for n in fakes
        ],
        swap={"budget_bytes": 27_000, **swap},
        timeouts=TimeoutSettings(drain_s=5.0, shutdown_s=2.0),
    )
    return make_sidecar(settings, fakes, CollectorRegistry()), fakes


async def test_under_pressure_a_sleeper_goes_deep_before_an_eviction(driver: Path) -> None:
    """Three models of 12,288 bytes awake, 2,000 left beside their pools asleep (fake ranks):
    a awake, b and c asleep; c's wake fits in 27,000 only once b's leftover is gone."""
    sc, _ = fleet_of("abc")
    for n in "abc":
        sc.fleet[n].process.engine = GroupOf(os.getpgid(0))  # type: ignore[assignment]
    app = sc.app
    async with asgi.client(app, "http://s") as client:
        await sc.started.wait()
        for n in "bc":
            assert (await client.post(f"/models/{n}/sleep", json={"level": 1})).status_code == 200
        r = await client.post("/models/c/wake")
        assert r.status_code == 200, r.text
        plan = r.json()["policy"]["policy"]
        assert plan["deepen"] == []  # the plan once b is deep: it fits
        states = {n: (await client.get(f"/models/{n}")).json() for n in "abc"}
        assert states["a"]["state"] == "RUNNING"  # nothing awake was evicted
        assert (states["b"]["state"], states["b"]["deep"]) == ("SUSPENDED", True)
        assert states["b"]["last_transition"]["kind"] == "deepen"
        assert states["c"]["state"] == "RUNNING"


async def test_a_sleeper_whose_weights_are_still_mapped_is_not_taken_deep(driver: Path) -> None:
    """As above, but b's ranks were read back with only its KV cache asleep (a failed
    wake's reconciliation): its checkpoint would copy its weights through the driver on c's
    path (8.29 s for an 8B in the H200 density run), so c's plan evicts a instead."""
    sc, _ = fleet_of("abc", min_awake_s=0)
    for n in "abc":
        sc.fleet[n].process.engine = GroupOf(os.getpgid(0))  # type: ignore[assignment]
    async with asgi.client(sc.app, "http://s") as client:
        await sc.started.wait()
        for n in "bc":
            assert (await client.post(f"/models/{n}/sleep", json={"level": 1})).status_code == 200
        sc.fleet["b"].facts.asleep = ("kv_cache",)  # as that reconciliation finds it
        r = await client.post("/models/c/wake")
        assert r.status_code == 200, r.text
        assert r.json()["policy"]["evicted"] == ["a"]
        b = (await client.get("/models/b")).json()
        assert (b["state"], b["deep"]) == ("SUSPENDED", False)
        assert b["last_transition"]["kind"] == "sleep"


async def test_the_sleepers_of_one_plan_go_deep_side_by_side(
    driver: Path, other_group: subprocess.Popen[bytes]
) -> None:
    """d's wake fits only once b's and c's leftovers are gone: both checkpoints run at once
    (each deepen below waits for the other to have started: one after the other, the first
    would wait for ever)."""
    sc, _ = fleet_of("abcd")
    # b's and c's engines: a process group each (c's the other one), so each checkpoint is
    # its own
    (driver / "cuda").write_text(f"{os.getpid()}\n{other_group.pid}\n")
    for n in "abcd":
        group = other_group.pid if n == "c" else os.getpgid(0)
        sc.fleet[n].process.engine = GroupOf(group)  # type: ignore[assignment]
    started = {n: asyncio.Event() for n in "bc"}

    def side_by_side(n: str, real: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        async def deepen() -> Any:
            started[n].set()
            await asyncio.wait_for(started["c" if n == "b" else "b"].wait(), 5.0)
            return await real()

        return deepen

    for n in "bc":
        mm = sc.manager.get(n)
        mm.deepen = side_by_side(n, mm.deepen)  # type: ignore[method-assign]
    async with asgi.client(sc.app, "http://s") as client:
        await sc.started.wait()
        for n in "bcd":
            assert (await client.post(f"/models/{n}/sleep", json={"level": 1})).status_code == 200
        r = await client.post("/models/d/wake")
        assert r.status_code == 200, r.text
        states = {n: (await client.get(f"/models/{n}")).json() for n in "abcd"}
        assert [(states[n]["state"], states[n]["deep"]) for n in "bc"] == [("SUSPENDED", True)] * 2
        assert (states["a"]["state"], states["d"]["state"]) == ("RUNNING", "RUNNING")


async def test_an_evicted_model_is_taken_deep_after_the_swap(
    driver: Path, other_group: subprocess.Popen[bytes]
) -> None:
    """deep_sleep "always", room for one model: b's wake evicts a, whose sleep has no
    checkpoint (b does not wait for the driver's copy); a is taken deep right after."""
    sc, _ = fleet_of("ab", "always", budget_bytes=20_000, min_awake_s=0)
    # b's "engine": a process group of its own, so each model's checkpoint is its own
    other = other_group
    (driver / "cuda").write_text(f"{os.getpid()}\n{other.pid}\n")
    sc.fleet["a"].process.engine = GroupOf(os.getpgid(0))  # type: ignore[assignment]
    sc.fleet["b"].process.engine = GroupOf(other.pid)  # type: ignore[assignment]
    app = sc.app
    async with asgi.client(app, "http://s") as client:
        await sc.started.wait()
        assert (await client.post("/models/b/sleep")).status_code == 200
        r = await client.post("/models/b/wake")
        assert r.status_code == 200, r.text
        assert r.json()["policy"]["evicted"] == ["a"]
        a = sc.fleet["a"]
        evicted = a.snapshot.last_transition
        assert evicted is not None
        assert evicted.kind == "sleep"
        assert "checkpoint" not in [p.name for p in evicted.phases]
        await until(lambda: a.snapshot.deep, sc.fleet.changes, timeout_s=10.0)
        snap = (await client.get("/models/a")).json()
        assert (snap["state"], snap["deep"]) == ("SUSPENDED", True)
        assert snap["last_transition"]["kind"] == "deepen"
        assert (await client.get("/models/b")).json()["state"] == "RUNNING"


def always_pair(
    driver: Path, other_group: subprocess.Popen[bytes]
) -> tuple[Any, dict[str, FakeVllm]]:
    """deep_sleep "always", room for one of a and b; a's engine is this test's process group,
    b's another one, both seen by the fake driver."""
    sc, fakes = fleet_of("ab", "always", budget_bytes=20_000, min_awake_s=0)
    (driver / "cuda").write_text(f"{os.getpid()}\n{other_group.pid}\n")
    sc.fleet["a"].process.engine = GroupOf(os.getpgid(0))  # type: ignore[assignment]
    sc.fleet["b"].process.engine = GroupOf(other_group.pid)  # type: ignore[assignment]
    return sc, fakes


async def test_an_evicted_model_with_requests_held_for_it_is_not_taken_deep(
    driver: Path, other_group: subprocess.Popen[bytes]
) -> None:
    """deep_sleep "always", a request held for a when b's wake evicts it: a is about to be
    woken, so it stays at level 1 (no checkpoint now and no restore on that request's path)."""
    sc, fakes = always_pair(driver, other_group)
    async with asgi.client(sc.app, "http://s") as client:
        await sc.started.wait()
        assert (await client.post("/models/b/sleep")).status_code == 200
        a = sc.fleet["a"]
        gate = fakes["a"].block("hotswap_suspend")
        wake = asyncio.create_task(client.post("/models/b/wake"))
        await fakes["a"].entered["hotswap_suspend"].wait()  # a is being evicted
        a.lane.hold(+1)  # the gateway holds a request for a (its wake waits for the device)
        gate.set()
        r = await wake
        assert r.status_code == 200, r.text
        assert r.json()["policy"]["evicted"] == ["a"]
        assert a.swapping.deepen_task is None  # no checkpoint started
        snap = (await client.get("/models/a")).json()
        assert (snap["state"], snap["deep"]) == ("SUSPENDED", False)
        a.lane.hold(-1)


@pytest.mark.parametrize("setting", ["off", "pressure", "always"])
async def test_a_helper_is_started_ahead_where_the_sidecar_may_go_deep(
    driver: Path, setting: str
) -> None:
    # out of reach: the start-up read calls no helper, so only the prewarm starts one
    async with deep_sidecar(FakeVllm(name="a"), reachable=False, deep_sleep=setting) as (_, sc):
        spare = sc.manager.checkpointer._spare
        if setting == "off":  # only a request's deep: true: no helper until then
            assert spare is None
        else:
            assert spare is not None
            assert spare.returncode is None  # warming, waiting for its call


async def test_a_deep_models_restore_starts_with_its_swaps_eviction(
    driver: Path, other_group: subprocess.Popen[bytes]
) -> None:
    """deep_sleep "always", room for one model: b is deep, its wake evicts a. b's restore
    (what it brings back fits beside a) runs while a's sleep is still in its suspend, not
    after it; b's wake then has no restore phase of its own."""
    sc, fakes = always_pair(driver, other_group)
    async with asgi.client(sc.app, "http://s") as client:
        await sc.started.wait()
        assert (await client.post("/models/b/sleep")).status_code == 200
        b = sc.fleet["b"]
        assert b.snapshot.deep
        gate = fakes["a"].block("hotswap_suspend")
        wake = asyncio.create_task(client.post("/models/b/wake"))
        await fakes["a"].entered["hotswap_suspend"].wait()  # a is being evicted
        await until(lambda: not b.snapshot.deep, sc.fleet.changes, timeout_s=10.0)
        assert b.snapshot.last_transition is not None
        assert b.snapshot.last_transition.kind == "restore"
        assert b.state.value == "SUSPENDED"  # restored, not woken: a still holds the room
        gate.set()
        r = await wake
        assert r.status_code == 200, r.text
        assert r.json()["policy"]["evicted"] == ["a"]
        woke = (await client.get("/models/b")).json()
        assert (woke["state"], woke["deep"]) == ("RUNNING", False)
        assert woke["last_transition"]["kind"] == "wake"
        assert "restore" not in phases({"transition": woke["last_transition"]})


async def test_the_checkpoints_after_a_swap_run_one_at_a_time_per_device(
    driver: Path, other_group: subprocess.Popen[bytes]
) -> None:
    """deep_sleep "always": c's wake evicts a and b, each taken deep after the swap; their
    checkpoints run one after the other (the driver's copies slow a restore beside them),
    not at once."""
    sc, _ = fleet_of("abc", "always", budget_bytes=20_000, min_awake_s=0)
    (driver / "cuda").write_text(f"{os.getpid()}\n{other_group.pid}\n")
    for n, group in (("a", os.getpgid(0)), ("b", other_group.pid), ("c", os.getpgid(0))):
        sc.fleet[n].process.engine = GroupOf(group)  # type: ignore[assignment]
    spans: dict[str, list[float]] = {}

    def timed(n: str, real: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[Any]]:
        async def deepen() -> Any:
            loop = asyncio.get_running_loop()
            spans[n] = [loop.time()]
            await asyncio.sleep(0.2)  # a checkpoint that takes a while
            try:
                return await real()
            finally:
                spans[n].append(loop.time())

        return deepen

    for n in "ab":
        mm = sc.manager.get(n)
        mm.deepen = timed(n, mm.deepen)  # type: ignore[method-assign]
    async with asgi.client(sc.app, "http://s") as client:
        await sc.started.wait()
        r = await client.post("/models/c/sleep", json={"deep": False})
        assert r.status_code == 200, r.text
        r = await client.post("/models/c/wake")
        assert r.status_code == 200, r.text
        assert sorted(r.json()["policy"]["evicted"]) == ["a", "b"]
        await until(lambda: all(len(s) == 2 for s in spans.values()) and len(spans) == 2,
                    sc.fleet.changes, timeout_s=10.0)  # fmt: skip
        first, second = sorted(spans.values())
        assert first[1] <= second[0]  # one after the other
        assert [sc.fleet[n].snapshot.deep for n in "ab"] == [True, True]


async def test_the_wake_begins_once_its_victims_sleep_while_its_restore_ahead_ends(
    driver: Path, other_group: subprocess.Popen[bytes]
) -> None:
    """b's restore ahead outlasts a's eviction: b's wake begins (RESUMING, counted by every
    later plan, the device's lock given back) once a is asleep, and waits for the restore
    under it; a restore that fails there leaves b FAILED with no second restore."""
    sc, _ = fleet_of("ab", "always", budget_bytes=20_000, min_awake_s=0)
    (driver / "cuda").write_text(f"{os.getpid()}\n{other_group.pid}\n")
    sc.fleet["a"].process.engine = GroupOf(os.getpgid(0))  # type: ignore[assignment]
    sc.fleet["b"].process.engine = GroupOf(other_group.pid)  # type: ignore[assignment]
    ckpt = sc.manager.checkpointer
    real, gate, ops = ckpt.call, asyncio.Event(), []

    async def call(op: str, pids: tuple[int, ...]) -> Any:
        ops.append(op)
        if op == "restore":
            await gate.wait()
        return await real(op, pids)

    ckpt.call = call  # type: ignore[method-assign]
    async with asgi.client(sc.app, "http://s") as client:
        await sc.started.wait()
        assert (await client.post("/models/b/sleep")).status_code == 200
        a, b = sc.fleet["a"], sc.fleet["b"]
        assert b.snapshot.deep
        wake = asyncio.create_task(client.post("/models/b/wake"))
        await until(lambda: a.state.value == "SUSPENDED", sc.fleet.changes, timeout_s=10.0)
        await until(lambda: b.state.value == "RESUMING", sc.fleet.changes, timeout_s=10.0)
        assert ops.count("restore") == 1
        assert b.snapshot.deep  # the restore still runs
        gate.set()
        r = await wake
        assert r.status_code == 200, r.text
        assert b.state.value == "RUNNING"
        assert ops.count("restore") == 1
        # again, with the restore failing: FAILED, and no second restore by the wake
        ops.clear()
        assert (await client.post("/models/b/sleep")).status_code == 200
        await until(lambda: b.snapshot.deep, sc.fleet.changes, timeout_s=10.0)
        r = await client.post("/models/a/wake", params={"evict": "false"})
        assert r.status_code == 200, r.text
        assert a.state.value == "RUNNING"  # b's wake evicts it: a restore ahead again
        ops.clear()  # a's wake may have restored a (deepened after its eviction)
        (driver / "fail").write_text("restore")
        r = await client.post("/models/b/wake")
        assert r.status_code >= 400
        assert b.state.value == "FAILED"
        assert ops.count("restore") == 1


async def test_a_deep_model_waking_is_counted_at_what_its_restore_brings_back(
    driver: Path,
) -> None:
    """While b's deep wake restores it (RESUMING; the device's lock has gone), every other
    plan counts b's engine at what it left beside its pools before its checkpoint, which the
    restore brings back, not NVML's 0 after the checkpoint."""
    sc, _ = fleet_of("ab", budget_bytes=60_000)
    for n in "ab":
        sc.fleet[n].process.engine = GroupOf(os.getpgid(0))  # type: ignore[assignment]
    async with asgi.client(sc.app, "http://s") as client:
        await sc.started.wait()
        r = await client.post("/models/b/sleep", json={"deep": True})
        assert r.status_code == 200, r.text
        b = sc.fleet["b"]
        assert b.snapshot.deep
        assert b.leftover_bytes == 0  # NVML's after the checkpoint
        left = b.holdings.asleep_bytes
        assert left > 0
        assert sc.swap is not None
        coord, mm = sc.swap, sc.manager.get("b")
        seen: list[int] = []

        def look(rec: Any) -> bool:
            if rec.state is State.RESUMING and rec.snapshot.deep:
                seen.append(coord.view(mm).asleep_bytes)
            return bool(rec.state is State.RUNNING)

        watch = asyncio.ensure_future(b.wait_for(look, 10.0))
        r = await client.post("/models/b/wake")
        assert r.status_code == 200, r.text
        assert await watch
        assert seen  # its restore was seen under way
        assert set(seen) == {left}
        assert coord.view(mm).asleep_bytes == b.leftover_bytes  # awake: the record's again
