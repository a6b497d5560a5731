"""The rank's own truth about its memory, kept for the life of the worker process.

A pure record (no torch, no vLLM): the extension moves it at every memory step and
`hotswap_info` reports it (docs/contracts.md §1.1). `failed` is final: only a new process,
with a new `boot_id`, is awake and verified again.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

AWAKE_VERIFIED = "awake_verified"
SUSPENDED = "suspended"
RESUMED_UNVERIFIED = "resumed_unverified"
FAILED = "failed"
PHASES = (AWAKE_VERIFIED, SUSPENDED, RESUMED_UNVERIFIED, FAILED)

_IMPORTED_S = time.time()


def process_start_time(stat: str | None = None, proc_stat: str | None = None) -> float:
    """This process's start time in Unix seconds, as Prometheus' process collector reads
    it (boot time plus the start tick of /proc/self/stat); the module's import time where
    /proc cannot be read. `stat` and `proc_stat` stand in for the two files in tests."""
    try:
        if stat is None:
            with open("/proc/self/stat", encoding="ascii") as f:
                stat = f.read()
        if proc_stat is None:
            with open("/proc/stat", encoding="ascii") as f:
                proc_stat = f.read()
        # the command name (field 2) may hold spaces and parentheses: split after the last ")"
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime
        btime = next(int(ln.split()[1]) for ln in proc_stat.splitlines() if ln.startswith("btime"))
        return btime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return _IMPORTED_S


@dataclass
class RankPhase:
    boot_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    process_start_s: float = field(default_factory=process_start_time)
    pid: int = field(default_factory=os.getpid)
    phase: str = AWAKE_VERIFIED  # a fresh load is awake and verified by construction
    level: int | None = None
    tags: tuple[str, ...] = ()
    reason: str | None = None
    transitions: int = 0
    verified_transition: int = 0

    def _step(self) -> bool:
        """Count one memory step; False when the rank is failed (nothing moves it then)."""
        self.transitions += 1
        return self.phase != FAILED

    def suspended(self, level: int, asleep: Iterable[str]) -> None:
        """A suspend reached the memory; `asleep` is every pool asleep after it."""
        if self._step():
            self.phase, self.level, self.tags = SUSPENDED, int(level), tuple(sorted(asleep))

    def resumed(self, asleep: Iterable[str]) -> None:
        """A resume mapped pools back; `asleep` is what is still asleep after it."""
        if self._step():
            self.tags = tuple(sorted(asleep))
            self.phase = SUSPENDED if self.tags else RESUMED_UNVERIFIED

    def reloaded(self) -> None:
        """The weights were refilled from the checkpoint: still unverified."""
        if self._step() and self.phase == AWAKE_VERIFIED:
            # a reload of a rank that never slept rewrites bytes nobody verified
            self.phase = RESUMED_UNVERIFIED

    def verified(self) -> None:
        """A restore and verify passed with every pool mapped."""
        if self._step():
            self.phase, self.level, self.tags = AWAKE_VERIFIED, None, ()
            self.verified_transition = self.transitions

    def failed(self, reason: str) -> None:
        """A memory step failed after it started, or a verify found a mismatch."""
        first = self.phase != FAILED
        self.transitions += 1
        if first:
            self.phase, self.reason, self.level, self.tags = FAILED, reason, None, ()

    def report(self) -> dict[str, Any]:
        return {
            "phase": self.phase,
            "phase_level": self.level,
            "phase_tags": list(self.tags),
            "phase_reason": self.reason,
            "transitions": self.transitions,
            "verified_transition": self.verified_transition,
            "boot_id": self.boot_id,
            "process_start_s": self.process_start_s,
            "pid": self.pid,
        }
