"""The host budget through the coordinator, over fake engines: a level-1 sleep that would
exceed it demotes the least recently used level-1 sleeper first; a sleeper whose engine
refuses to demote (a CUDA backend) is skipped, and the sleep is made at level 2 instead."""

from __future__ import annotations

from fakevllm import POOL_BYTES
from test_gateway import run, world

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
            assert w.coordinator.fleet["b"].host_bytes == 0
            assert w.coordinator.fleet["c"].host_bytes == W
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
            assert w.coordinator.fleet["b"].demotable is False  # not asked again
            assert w.sample("hotswap_demotions_total", model="b", reason="host_budget") == 0
            assert w.coordinator.fleet["c"].host_bytes == 0

    run(body)


def test_without_a_host_budget_nothing_is_demoted() -> None:
    async def body() -> None:
        async with world(("a", "b", "c"), swap={"max_awake": 3}) as w:
            assert [w.manager.get(n).snapshot().level for n in ("b", "c")] == [1, 1]
            assert "hotswap_demote" not in w.engines["b"].fake.rpc_calls()

    run(body)
