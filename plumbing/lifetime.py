"""A process's lifetime tied to its parent's: Linux sends it a signal when the process that
started it dies (`PR_SET_PDEATHSIG`), so that nothing a stopped server or launcher started is
left running, re-parented to PID 1."""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from typing import NoReturn

PR_SET_PDEATHSIG = 1


def signal_on_parent_death(signum: int) -> str | None:
    """Asks Linux to send this process `signum` when its parent dies; the error, if refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def exit_now(code: int) -> NoReturn:
    """End the process as soon as the server has stopped. By then its calls have ended, the
    engine's processes are gone and the ports are closed; what a normal exit would still do is
    tear down the event loop (cancelling gRPC's leftover internal tasks, which logs spurious
    errors) and the interpreter (freeing the model, torch's exit hooks): 3-7 s measured here,
    during which the process and its metrics port stay up."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
