#!/usr/bin/env python3
"""The CPU time of a command and of every process it started, however they ended.

    python3 scripts/cputime.py [--limit-s S] -- COMMAND...

`/usr/bin/time` counts only the children that were waited for, all the way up: a vLLM
worker whose EngineCore was stopped before it reaped it is reparented away and its CPU is
counted nowhere. Here this process is the subreaper of the command's tree (Linux
PR_SET_CHILD_SUBREAPER): every orphan is reparented to it and reaped by it, so the user and
system time printed at the end is the whole tree's. It waits until no process of the tree
is left (or --limit-s passed, default 3600: then it says so). Exit status: the command's.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import resource
import subprocess
import sys
import time

PR_SET_CHILD_SUBREAPER = 36


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit-s", type=float, default=3600.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("no command")
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"cputime: prctl failed (errno {ctypes.get_errno()})", file=sys.stderr)
        return 70
    start = time.monotonic()
    child = subprocess.Popen(command)
    rc: int | None = None
    left = False
    while True:
        try:
            pid, status = os.waitpid(-1, 0 if rc is None else os.WNOHANG)
        except ChildProcessError:
            break
        if pid == child.pid:
            rc = os.waitstatus_to_exitcode(status)
        elif pid == 0:  # the command ended; orphans still run
            if time.monotonic() - start > args.limit_s:
                left = True
                break
            time.sleep(0.5)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    wall = time.monotonic() - start
    note = " (processes of the tree were still running at the limit)" if left else ""
    print(
        f"cputime: user {usage.ru_utime:.1f} s, system {usage.ru_stime:.1f} s, "
        f"total {usage.ru_utime + usage.ru_stime:.1f} s of CPU in {wall:.0f} s wall{note}",
        file=sys.stderr,
    )
    return rc if rc is not None else 1


if __name__ == "__main__":
    sys.exit(main())
