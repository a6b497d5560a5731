"""worker_ext.cumem.resident: what a CUDA suspend gives back before the engine sleeps (and a
deep sleep's checkpoint would copy): torch's cached blocks at every suspend, the context's
stack reserve; a fake torch and fake runtime limits."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from worker_ext.cumem.resident import ASLEEP_STACK_BYTES, Residency


class FakeTorch:
    def __init__(self, blas: bool = True) -> None:
        self.calls: list[str] = []
        cuda = SimpleNamespace(
            empty_cache=lambda: self.calls.append("empty_cache"),
            mem_get_info=lambda device: (10, 100),
            memory_snapshot=lambda: [],
        )
        self.cuda = cuda
        self._C = SimpleNamespace()
        if blas:
            self._C._cuda_clearCublasWorkspaces = lambda: self.calls.append("clear_blas")


class FakeRecords:
    def all(self) -> dict[int, Any]:
        return {}

    def graphs(self) -> frozenset[int]:
        return frozenset()


class FakeLimits:
    def __init__(self, stack: int = 1024, fail: str | None = None) -> None:
        self.stack = stack
        self.fail = fail
        self.sets: list[int] = []

    def get_limit(self, limit: int) -> int:
        assert limit == 0  # cudaLimitStackSize
        return self.stack

    def set_limit(self, limit: int, value: int) -> None:
        assert limit == 0
        if self.fail == "set" or (self.fail == "restore" and value > ASLEEP_STACK_BYTES):
            raise RuntimeError("cudaDeviceSetLimit failed: CUDA error 1 (invalid argument)")
        self.sets.append(value)
        self.stack = value


def residency(torch: FakeTorch, limits: FakeLimits | None = None) -> Residency:
    return Residency(torch, "cuda:0", FakeRecords(), limits)  # type: ignore[arg-type]


def test_the_stack_is_shrunk_by_every_suspends_trim() -> None:
    limits = FakeLimits(stack=1024)
    r = residency(FakeTorch(), limits)
    r.trim()
    assert limits.sets == [ASLEEP_STACK_BYTES]
    timings: dict[str, float] = {}
    r.restore_stack(timings)
    assert limits.sets == [ASLEEP_STACK_BYTES, 1024]
    assert timings["stack_restore_s"] >= 0


def test_trim_empties_the_cache_and_leaves_the_blas_workspaces() -> None:
    torch = FakeTorch()
    residency(torch).trim()
    assert torch.calls == ["empty_cache"]  # a graph may replay into a stream's workspace


def test_release_cached_empties_the_cache_and_leaves_the_stack() -> None:
    torch = FakeTorch()
    limits = FakeLimits(stack=1024)
    assert residency(torch, limits).release_cached() >= 0
    assert torch.calls == ["empty_cache"]
    assert limits.sets == []


def test_the_stack_shrinks_asleep_and_comes_back_at_the_wake() -> None:
    limits = FakeLimits(stack=3072)  # grown by a kernel that needed it
    r = residency(FakeTorch(), limits)
    slept = r.shrink_stack()
    assert slept["from"] == 3072
    assert slept["to"] == ASLEEP_STACK_BYTES
    assert limits.stack == ASLEEP_STACK_BYTES
    assert r.shrink_stack()["from"] == ASLEEP_STACK_BYTES  # a second suspend: nothing to do
    woke = r.restore_stack()
    assert woke["to"] == 3072
    assert limits.sets == [ASLEEP_STACK_BYTES, 3072]
    assert r.restore_stack() == {}  # restored once: a later resume sets nothing
    said = r.resident()["stack"]  # hotswap_info's resident.stack
    assert said["sleep"]["from"] == ASLEEP_STACK_BYTES
    assert said["wake"]["to"] == 3072


def test_without_the_runtimes_calls_nothing_is_touched() -> None:
    r = residency(FakeTorch(), None)
    assert r.shrink_stack() == {}
    assert r.restore_stack() == {}


@pytest.mark.parametrize("fail", ["set", "restore"])
def test_a_failing_limit_call_is_reported_never_raised(fail: str) -> None:
    limits = FakeLimits(stack=1024, fail=fail)
    r = residency(FakeTorch(), limits)
    slept = r.shrink_stack()
    if fail == "set":
        assert "cudaDeviceSetLimit failed" in slept["error"]
        assert limits.stack == 1024
        assert r.restore_stack() == {}  # nothing was shrunk: nothing to restore
    else:
        assert limits.stack == ASLEEP_STACK_BYTES
        woke = r.restore_stack()
        assert "cudaDeviceSetLimit failed" in woke["error"]
        assert r.restore_stack() == {}  # said once; kernels grow the stack as they need


def test_the_layout_says_which_segments_hold_what_empty_cache_cannot_give_back() -> None:
    """`resident.layout`: per private pool its segments and bytes, and the default pool's
    segments with free bytes beside live blocks, the most free first."""
    t = FakeTorch()

    def seg(total: int, pool: tuple[int, int], *blocks: tuple[int, str]) -> dict[str, Any]:
        used = sum(n for n, state in blocks if state == "active_allocated")
        # torch rounds a block up from the size asked for: the size asked for is one less
        rows = [{"size": n, "requested_size": n - 1, "state": state} for n, state in blocks]
        return {"address": total, "total_size": total, "allocated_size": used,
                "segment_pool_id": pool, "blocks": rows}  # fmt: skip

    t.cuda.memory_snapshot = lambda: [
        seg(20, (0, 0), (4, "active_allocated"), (16, "inactive")),
        seg(30, (0, 0), (2, "active_allocated"), (1, "active_allocated"), (27, "inactive")),
        seg(8, (0, 0), (8, "active_allocated")),
        seg(100, (1, 5), (100, "inactive")),
        seg(50, (1, 5), (10, "active_allocated"), (40, "inactive")),
        seg(16, (0, 0), (2, "active_allocated"), (2, "active_allocated"), (12, "inactive")),
    ]
    r = Residency(t, "cuda:0", FakeRecords())  # type: ignore[arg-type]
    res = r.resident()
    assert (res["torch_allocated"], res["torch_cached"], res["graph_pools"]) == (19, 55, 150)
    assert res["layout"] == {
        "private_pools": {"1,5": [2, 150, 10]},
        "default_free": [[30, 3, 2, 2], [20, 4, 1, 4], [16, 4, 2, 2]],
        "default_free_segments": 3,
        # [size asked for, blocks], the most bytes first: 7 x 1, 3 x 1, 1 x 3 (two of them
        # in one segment), 0 x 1
        "default_live": [[7, 1], [3, 1], [1, 3], [0, 1]],
        "private_live": {"1,5": [[9, 1]]},
    }


@pytest.mark.parametrize(
    ("nvml", "lent", "bytes_"),
    [
        (1_000, 0, 1_000),  # nothing lent: NVML's figure
        (100_800, 100_000, 800),  # NVML counts the lent memory as ours: taken out
        (800, 100_000, 500),  # it does not: never below the allocators' estimate
        (400, 100_000, 400),  # nor above NVML's own figure
    ],
)
def test_kv_memory_lent_is_not_counted_as_what_a_sleeper_holds(
    monkeypatch: pytest.MonkeyPatch, nvml: int, lent: int, bytes_: int
) -> None:
    """cumem.kvlend: the KV memory a sleep lent to a waking engine may stay on NVML's
    account of this process while the borrower maps it; what the sleeper reports holding
    (the controller's leftover bytes) leaves it out."""
    from worker_ext.cumem import resident as mod

    monkeypatch.setattr(mod, "nvml_process_bytes", lambda _pid: nvml)
    r = Residency(FakeTorch(), "cuda:0", FakeRecords())  # type: ignore[arg-type]
    r._other_at_start = 500  # the context's share, as estimated when the backend was made
    res = r.resident(lent)
    assert res["bytes"] == bytes_
    assert res["source"] == "nvml"
