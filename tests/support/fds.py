"""File descriptors in tests: a fresh one to hand over, and whether one is still open."""

from __future__ import annotations

import os


def pipe_fd() -> int:
    """A new open descriptor (a pipe's read end, its write end closed)."""
    r, w = os.pipe()
    os.close(w)
    return r


def fd_closed(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return True
    return False
