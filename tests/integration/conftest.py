"""Integration tests: the real sidecar (support.sidecarthread.SidecarThread builds the Sidecar
`hotswap serve` builds) over real vLLM-CPU servers; run under the heavy lock. The measured
transitions are printed at the end of the session (the numbers the docs quote)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest


@pytest.fixture(scope="session")
def tiny_llama(tiny_model: Callable[..., Path]) -> Path:
    return tiny_model("llama", 0, True)


# ----------------------------------------------------------------------------- cycle report


@dataclass(frozen=True)
class CycleRecord:
    """One measured transition, printed at the end of the session."""

    layout: str  # "uni" | "mp" | "tp2"
    kind: str
    level: int | None
    total_s: float
    phases: tuple[tuple[str, float], ...]


_CYCLES = pytest.StashKey[list[CycleRecord]]()


def pytest_configure(config: pytest.Config) -> None:
    config.stash[_CYCLES] = []


@pytest.fixture(scope="session")
def cycle_report(pytestconfig: pytest.Config) -> Callable[[str, dict[str, Any]], None]:
    """`cycle_report(layout, transition_json)`: keep a transition's phase timings for the
    end-of-session summary (the numbers the docs quote come from a real run)."""

    def add(layout: str, transition: dict[str, Any]) -> None:
        pytestconfig.stash[_CYCLES].append(
            CycleRecord(
                layout=layout,
                kind=transition["kind"],
                level=transition.get("level"),
                total_s=float(transition["duration_s"]),
                phases=tuple((p["name"], float(p["duration_s"])) for p in transition["phases"]),
            )
        )

    return add


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    cycles = config.stash.get(_CYCLES, [])
    if not cycles:
        return
    terminalreporter.section("measured sleep/wake transitions (real CPU vLLM, ms)")
    for c in cycles:
        phases = "  ".join(f"{name}={seconds * 1e3:.1f}" for name, seconds in c.phases)
        level = f"L{c.level}" if c.level is not None else "--"
        terminalreporter.write_line(
            f"{c.layout:>4} {c.kind:<5} {level}  total={c.total_s * 1e3:7.1f}  {phases}"
        )
