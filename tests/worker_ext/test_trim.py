"""worker_ext.trim: the compile-worker pool goes at the first sleep, and a later compile
could start a new one (torch's own shutdown clears its cache)."""

from __future__ import annotations

import sys
import types

import pytest

from worker_ext import trim


def test_no_inductor_loaded_is_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "torch._inductor.async_compile", raising=False)
    assert trim.release_compile_workers() == 0


def test_the_pools_are_shut_down_once(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("torch._inductor.async_compile")
    shut: list[int] = []
    fake._pool_set = {object(), object()}  # type: ignore[attr-defined]

    def shutdown() -> None:
        shut.append(len(fake._pool_set))  # type: ignore[attr-defined]
        fake._pool_set.clear()  # type: ignore[attr-defined]

    fake.shutdown_compile_workers = shutdown  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torch._inductor.async_compile", fake)
    assert trim.release_compile_workers() == 2
    assert trim.release_compile_workers() == 0  # the next sleep pays nothing
    assert shut == [2]
