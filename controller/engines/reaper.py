"""The keeper of one managed engine: `python -m controller.engines.reaper GRACE_S PARENT [--nice=N]
-- ARGV`.

The sidecar starts this, not the engine: it leads its own process group, asks the kernel
for SIGTERM when the thread that started it dies (PR_SET_PDEATHSIG), becomes the child
subreaper of everything below it, and runs the engine as its child in the same group, with
SIGKILL as the engine's own parent-death signal. When the sidecar goes, however it goes
(SIGKILL included), or the engine exits by itself, the keeper ends the whole group: SIGTERM,
`GRACE_S` for it to empty, then SIGKILL. So no engine, EngineCore or worker outlives the
sidecar, and the sidecar's process group check (`launcher.EngineProcess`) knows every
process that may answer for the engine. Standard library only: it runs inside the vLLM
image too. Its exit code is the engine's (128 + N when a signal N ended it).

With `--nice=N` the keeper first lowers its own CPU priority by N (its nice value, inherited
by the engine and every process and thread it starts): the engines then give way to the
sidecar that watches them whenever both want a CPU.

PARENT is the sidecar's pid, as the sidecar knew it before the fork. The death signal is
asked for only once this interpreter runs, a while after the fork: a sidecar that died in
between is seen by comparing PARENT with the parent the keeper has by then (read at that
moment, the new parent would pass for the sidecar and the keeper would never be told).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from types import FrameType

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36
USAGE = "usage: python -m controller.engines.reaper GRACE_S [PARENT] [--nice=N] -- ARGV..."


def _prctl(option: int, value: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(option, value, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}, {value}) failed")


def die_with_parent(sig: int, parent: int) -> None:
    """Get `sig` when the parent dies; if it died already (the race before prctl), now."""
    _prctl(PR_SET_PDEATHSIG, sig)
    if os.getppid() != parent:
        os.kill(os.getpid(), sig)


def _reap_children() -> None:
    """Collect every exited child (the subreaper inherits the group's orphans)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def end_group(pgid: int, grace_s: float) -> None:
    """SIGTERM every other process of the group, wait up to `grace_s`, SIGKILL the rest."""
    me = os.getpid()
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group signal reaches the keeper too
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while members(pgid, me) and time.monotonic() < deadline:
        _reap_children()
        time.sleep(0.05)
    deadline = time.monotonic() + 5.0
    while (left := members(pgid, me)) and time.monotonic() < deadline:
        for pid in left:  # one by one: a group SIGKILL would end the keeper first
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        _reap_children()
        time.sleep(0.05)
    _reap_children()


def members(pgid: int, me: int | None = None) -> list[int]:
    """The live processes of group `pgid` but `me`, read from /proc (zombies excluded)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...: comm may hold spaces, so split after its ')'.
        fields = stat[stat.rfind(b")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":
            found.append(int(entry))
    return found


def main(argv: list[str]) -> int:
    try:
        sep = argv.index("--")
    except ValueError:
        sep = -1
    nice = 0
    if sep >= 2 and argv[sep - 1].startswith("--nice="):
        nice = int(argv[sep - 1].removeprefix("--nice="))
        argv = argv[: sep - 1] + argv[sep:]
        sep -= 1
    if sep not in (1, 2) or len(argv) <= sep + 1:
        print(USAGE, file=sys.stderr)
        return 2
    grace_s = float(argv[0])
    command = argv[sep + 1 :]
    # Without PARENT (started by hand) the parent is whoever it is now.
    parent = int(argv[1]) if sep == 2 else os.getppid()
    if nice > 0:
        os.nice(nice)  # before the engine starts: it and everything it starts inherit it
    pgid = os.getpgid(0)
    stop = False

    def on_term(sig: int, frame: FrameType | None) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    signal.signal(signal.SIGINT, on_term)
    die_with_parent(signal.SIGTERM, parent)
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    if stop:
        return 128 + signal.SIGTERM  # the sidecar was gone before the engine started
    me = os.getpid()
    # No threads here, so preexec_fn is safe: the engine dies if the keeper is killed outright.
    engine = subprocess.Popen(command, preexec_fn=lambda: die_with_parent(signal.SIGKILL, me))
    code: int | None = None
    while not stop and code is None:
        code = engine.poll()
        if code is None:
            time.sleep(0.1)
    end_group(pgid, grace_s)
    if code is None:
        code = engine.poll()
    if code is None:
        return 128 + signal.SIGKILL
    return 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
