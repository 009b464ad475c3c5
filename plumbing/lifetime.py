"""A process's lifetime tied to its parent's: Linux sends it a signal when the process that
started it dies (`PR_SET_PDEATHSIG`), so that nothing a stopped server or launcher started is
left running, re-parented to PID 1."""

from __future__ import annotations

import ctypes
import os

PR_SET_PDEATHSIG = 1


def signal_on_parent_death(signum: int) -> str | None:
    """Asks Linux to send this process `signum` when its parent dies; the error, if refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        return os.strerror(ctypes.get_errno())
    return None
