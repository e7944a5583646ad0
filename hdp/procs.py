"""Helper processes that die with the process that started them (Linux parent-death signal).

A rank killed in the middle of a checkpoint save must not leave its writer processes behind (an
orphan adopted by init keeps writing shards, holds memory and the caller's stdout).  Linux's
``PR_SET_PDEATHSIG`` makes the kernel send a signal to a process when its parent dies; it must be
set *in the child*.  :func:`die_with_parent` does that (for forked children from an
``os.register_at_fork`` hook, for spawned ones as a ``multiprocessing`` initializer).  On other
systems it does nothing.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int | None = None) -> None:
    """Have this process SIGKILLed when its parent dies; exit at once if the parent is already gone.

    ``parent_pid``: the parent this process must outlive no longer than (default: the current
    parent).  Call it first thing in a child process.
    """
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid() if parent_pid is None else int(parent_pid)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        return
    if os.getppid() != parent:  # the parent died before the signal was armed
        os._exit(1)
