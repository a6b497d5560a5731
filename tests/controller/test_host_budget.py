"""The host budget through the coordinator, over fake engines: a level-1 sleep that would
exceed it demotes the least recently used level-1 sleeper first; a sleeper whose engine
refuses to demote, or whose prepare said it cannot (CUDA with HOTSWAP_DEMOTABLE=0), is
skipped, and the sleep is made at level 2 instead; a CUDA sleeper's pinned copy is released."""

from __future__ import annotations

from support.fakevllm import POOL_BYTES
from support.gatewayworld import run, world

from controller.http.views import fleet_dict
from controller.state import State

W = POOL_BYTES["weights"]  # what one level-1 sleeper holds in host memory (one rank)
BUDGET = {"host_budget": W + W // 2, "max_awake": 3}


def test_the_lru_level1_sleeper_is_demoted_first() -> None:
    async def body() -> None:
        # world() puts b, then c to sleep at level 1: c's sleep does not fit beside b's.
        async with world(("a", "b", "c"), swap=BUDGET) as w:
            b, c = (w.manager.get(n).snapshot() for n in ("b", "c"))
            assert (b.state, b.level) == (State.SUSPENDED, 2)
            assert (c.state, c.level) == (State.SUSPENDED, 1)
            assert w.coordinator.fleet["b"].holdings.host_bytes == 0
            assert w.coordinator.fleet["c"].holdings.host_bytes == W
            assert w.sample("hotswap_demotions_total", model="b", reason="host_budget") == 1
            assert w.sample("hotswap_model_host_bytes", model="c") == W
            assert "hotswap_demote" in w.engines["b"].fake.rpc_calls()

    run(body)


def test_a_sleeper_that_cannot_demote_makes_the_next_sleep_level_2() -> None:
    async def body() -> None:
        fail = {"b": {"hotswap_demote": "rank"}}  # every rank answers no, nothing touched
        async with world(("a", "b", "c"), swap=BUDGET, fail=fail) as w:
            b, c = (w.manager.get(n).snapshot() for n in ("b", "c"))
            assert (b.state, b.level) == (State.SUSPENDED, 1)  # as it was
            assert (c.state, c.level) == (State.SUSPENDED, 2)  # the sleep fell back
            assert w.coordinator.fleet["b"].holdings.demotable is False  # not asked again
            assert w.sample("hotswap_demotions_total", model="b", reason="host_budget") == 0
            assert w.coordinator.fleet["c"].holdings.host_bytes == 0

    run(body)


CUDA = {"host_backup": W, "demotable": True}  # a pinned copy per level-1 sleep, demotable


def test_a_cuda_sleeper_is_demoted_and_its_pinned_copy_released() -> None:
    async def body() -> None:
        fakes = {n: dict(CUDA) for n in ("a", "b", "c")}
        async with world(("a", "b", "c"), swap=BUDGET, fakes=fakes) as w:
            b, c = (w.manager.get(n).snapshot() for n in ("b", "c"))
            assert (b.state, b.level) == (State.SUSPENDED, 2)
            assert (c.state, c.level) == (State.SUSPENDED, 1)
            assert w.engines["b"].fake.backup_held == 0  # its rank released the copy
            assert w.coordinator.fleet["b"].holdings.host_bytes == 0
            assert (
                w.coordinator.fleet["c"].holdings.host_bytes == W
            )  # what its suspend said it pins
            assert w.sample("hotswap_demotions_total", model="b", reason="host_budget") == 1
            await w.coordinator.wake(w.manager.get("b"))  # the level-2 wake: reload and verify
            assert w.manager.get("b").snapshot().state is State.RUNNING
            assert "hotswap_reload" in w.engines["b"].fake.rpc_calls()

    run(body)


def test_a_prepare_that_cannot_demote_is_not_asked_to() -> None:
    async def body() -> None:
        fakes = {n: dict(CUDA) for n in ("a", "b", "c")}
        fakes["b"]["demotable"] = False  # CUDA with HOTSWAP_DEMOTABLE=0
        async with world(("a", "b", "c"), swap=BUDGET, fakes=fakes) as w:
            b, c = (w.manager.get(n).snapshot() for n in ("b", "c"))
            assert (b.state, b.level) == (State.SUSPENDED, 1)
            assert (c.state, c.level) == (State.SUSPENDED, 2)  # the sleep fell back
            assert w.coordinator.fleet["b"].holdings.demotable is False
            assert (
                fleet_dict(w.coordinator.fleet["b"], w.coordinator.settings)["demotable"] is False
            )
            assert "hotswap_demote" not in w.engines["b"].fake.rpc_calls()
            # a later sleep whose prepare can be demoted makes it demotable again
            w.engines["b"].fake.demotable = True
            await w.coordinator.wake(w.manager.get("b"))
            await w.coordinator.sleep(w.manager.get("b"))
            assert w.coordinator.fleet["b"].holdings.demotable is True

    run(body)


def test_without_a_host_budget_nothing_is_demoted() -> None:
    async def body() -> None:
        async with world(("a", "b", "c"), swap={"max_awake": 3}) as w:
            assert [w.manager.get(n).snapshot().level for n in ("b", "c")] == [1, 1]
            assert "hotswap_demote" not in w.engines["b"].fake.rpc_calls()

    run(body)


DROP = {"host_budget": 2 * W + W // 2, "max_awake": 2}


def test_an_awake_models_backup_is_dropped_before_a_sleeper_is_demoted() -> None:
    async def body() -> None:
        # b and c asleep at level 1 (2 W); b woken keeps a backup of W; a's sleep adds W.
        async with world(("a", "b", "c"), swap=DROP) as w:
            w.engines["b"].fake.host_backup = W
            await w.coordinator.wake(w.manager.get("b"))
            assert (
                w.coordinator.fleet["b"].holdings.host_bytes == W
            )  # what its resume said it keeps
            await w.coordinator.sleep(w.manager.get("a"))
            a = w.manager.get("a").snapshot()
            assert (a.state, a.level) == (State.SUSPENDED, 1)
            assert "hotswap_drop_backup" in w.engines["b"].fake.rpc_calls()
            assert "hotswap_demote" not in w.engines["c"].fake.rpc_calls()
            assert w.manager.get("b").snapshot().state is State.RUNNING
            assert w.coordinator.fleet["b"].holdings.host_bytes == 0
            assert w.engines["b"].fake.backup_held == 0
            assert w.sample("hotswap_host_backups_dropped_total", model="b") == 1
            assert w.sample("hotswap_demotions_total", model="c", reason="host_budget") == 0
            assert w.sample("hotswap_model_host_bytes", model="b") == 0

    run(body)


def test_a_refused_drop_leaves_the_model_as_it_was_and_a_sleeper_is_demoted() -> None:
    async def body() -> None:
        fail = {"b": {"hotswap_drop_backup": "rank"}}  # every rank answers no
        async with world(("a", "b", "c"), swap=DROP, fail=fail) as w:
            w.engines["b"].fake.host_backup = W
            await w.coordinator.wake(w.manager.get("b"))
            await w.coordinator.sleep(w.manager.get("a"))
            assert w.manager.get("b").snapshot().state is State.RUNNING  # as it was
            assert w.coordinator.fleet["b"].holdings.host_bytes == W
            assert w.sample("hotswap_host_backups_dropped_total", model="b") == 0
            c = w.manager.get("c").snapshot()
            assert (c.state, c.level) == (State.SUSPENDED, 2)  # demoted instead
            assert w.manager.get("a").snapshot().level == 1

    run(body)


def test_a_wake_that_keeps_a_backup_over_the_budget_drops_it() -> None:
    async def body() -> None:
        async with world(("a", "b"), swap={"host_budget": W + W // 2, "max_awake": 2}) as w:
            w.engines["b"].fake.host_backup = 2 * W  # more than the whole budget
            await w.coordinator.wake(w.manager.get("b"))
            task = w.coordinator.fleet["b"].swapping.host_task
            assert task is not None
            await task  # the fleet as it is, planned and enforced after the wake's answer
            assert "hotswap_drop_backup" in w.engines["b"].fake.rpc_calls()
            assert w.coordinator.fleet["b"].holdings.host_bytes == 0
            assert w.sample("hotswap_host_backups_dropped_total", model="b") == 1
            assert w.manager.get("b").snapshot().state is State.RUNNING

    run(body)


def test_a_wake_whose_backup_fits_the_budget_plans_nothing() -> None:
    async def body() -> None:
        async with world(("a", "b"), swap={"host_budget": 10 * W, "max_awake": 2}) as w:
            w.engines["b"].fake.host_backup = W  # kept, and the fleet stays within 10 W
            await w.coordinator.wake(w.manager.get("b"))
            assert w.coordinator.fleet["b"].holdings.host_bytes == W
            assert w.coordinator.fleet["b"].swapping.host_task is None
            assert "hotswap_drop_backup" not in w.engines["b"].fake.rpc_calls()

    run(body)


def test_a_wake_that_keeps_nothing_plans_nothing() -> None:
    async def body() -> None:
        async with world(("a", "b"), swap={"host_budget": W, "max_awake": 2}) as w:
            await w.coordinator.wake(
                w.manager.get("b")
            )  # the host backend keeps no backup: 0 bytes
            assert w.coordinator.fleet["b"].swapping.host_task is None
            assert "hotswap_drop_backup" not in w.engines["b"].fake.rpc_calls()

    run(body)


def test_a_sleepers_host_bytes_are_the_pinned_buffer_its_ranks_keep() -> None:
    """A CUDA-like rank says what it keeps pinned (a coded copy smaller than the weights):
    that is counted, not the raw bytes it offloaded; the host backend says 0: offloaded."""

    async def body() -> None:
        async with world(("a", "b"), swap={"host_budget": 10 * W, "max_awake": 2}) as w:
            assert w.coordinator.fleet["b"].holdings.host_bytes == W  # host backend: in place
            w.engines["a"].fake.host_backup = W // 2  # e.g. the codec's 0.68x
            await w.coordinator.sleep(w.manager.get("a"))
            assert w.coordinator.fleet["a"].holdings.host_bytes == W // 2
            assert w.sample("hotswap_model_host_bytes", model="a") == W // 2

    run(body)


def test_models_shows_what_the_device_policy_counts() -> None:
    """GET /models' fleet entry: the leftover beside the pools (awake too, once reported)
    and the wake's scratch, the same figures the policy's view holds."""

    async def body() -> None:
        async with world(("a", "b"), swap={"max_awake": 2}) as w:
            await w.coordinator.wake(w.manager.get("b"))
            w.engines["b"].fake.wake_scratch = 64
            await w.coordinator.sleep(w.manager.get("b"))
            rec, settings = w.coordinator.fleet["b"], w.coordinator.settings
            shown, seen = fleet_dict(rec, settings), w.coordinator.view(w.manager.get("b"))
            assert (shown["asleep_bytes"], shown["wake_scratch_bytes"]) == (100, 64)
            assert (seen.asleep_bytes, seen.wake_scratch_bytes) == (100, 64)
            await w.coordinator.wake(w.manager.get("b"))
            shown, seen = fleet_dict(rec, settings), w.coordinator.view(w.manager.get("b"))
            assert (shown["asleep_bytes"], shown["wake_scratch_bytes"]) == (100, 0)
            assert (seen.asleep_bytes, seen.wake_scratch_bytes) == (100, 0)
            assert rec.holdings.codec_scratch == 64  # its next sleep encodes through it: kept

    run(body)
