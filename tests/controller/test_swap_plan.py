"""benchmarks/swap.py's planning and arguments, without engines, run as a user runs it
(`python -m benchmarks.swap ... --plan`, a process of its own): with three models two stay
awake and each swap's victim is the policy's pick among them; runs in which no swap, or no
choice, could happen are refused before any engine boots. The bench's own estimate of the
policy's pick is checked on CPU by running it (`--platform cpu --models 3`)."""

from __future__ import annotations

import json

import pytest
from support.procs import run_module

TIMEOUT_S = 120  # an interpreter's start and the benchmark's imports, on a busy machine


def plan(*args: str) -> tuple[int, str]:
    return run_module(["benchmarks.swap", *args, "--plan"], TIMEOUT_S)


def test_three_models_two_awake_each_swap_picks_a_victim_among_them() -> None:
    rc, out = plan("--models", "3", "--util", "0.42", "--swaps", "6", "--graphs", "0")
    assert rc == 0, out
    got = json.loads(out.strip().splitlines()[-1])
    assert got["models"] == ["a", "b", "c"]
    assert got["max_awake"] == 2  # two 8B awake at 0.42 of the device each, not three
    assert got["swaps"] == 6
    assert "least used" in got["rule"]  # the bench's expectation is the policy's rule


def test_two_14b_models_one_awake() -> None:
    rc, out = plan("--shape", "qwen25-14b", "--util", "0.85", "--graphs", "1")
    assert rc == 0, out
    got = json.loads(out.strip().splitlines()[-1])
    assert (got["models"], got["max_awake"], got["shape"]) == (["a", "b"], 1, "qwen25-14b")
    assert "rule" not in got  # two models: the victim is the other one


@pytest.mark.parametrize(
    ("args", "why"),
    [
        (("--models", "3", "--util", "0.85"), "do not fit awake"),
        (("--models", "3", "--util", "0.3"), "all fit awake"),
        (("--models", "3", "--util", "0.42", "--max-awake", "3"), "no swap"),
        (("--models", "1"), "2 to 8"),
    ],
)
def test_runs_without_a_swap_or_a_choice_are_refused(args: tuple[str, ...], why: str) -> None:
    rc, out = plan(*args)
    assert rc == 2, out
    assert why in out
