"""The engine's processes die with the server that started them.

vLLM runs its engine core, and the core its workers, as separate processes. When the server is
killed outright (SIGKILL, the OOM killer, a crashed container runtime) nothing tells them: they
are re-parented to PID 1 and go on running, holding memory (and, on a GPU, the device) that a
restarted replica then cannot have. Each of them asks the kernel for SIGKILL when its parent
dies (Linux `PR_SET_PDEATHSIG`): the server's death takes the engine core down, and the core's
death its workers.

vLLM loads the entry points of the `vllm.general_plugins` group in every process it starts;
`die_with_parent` is one (pyproject.toml). It acts only in processes started beneath a server
that called `mark_engine_parent`, so that any other program using vLLM is left as it is.
"""

from __future__ import annotations

import ctypes
import logging
import multiprocessing
import os
import signal
import sys

logger = logging.getLogger(__name__)

# The server's pid, inherited through the environment by every process the engine starts.
ENGINE_PARENT_ENV = "LLM_COMPLETIONS_SERVER_PID"
PR_SET_PDEATHSIG = 1


def mark_engine_parent() -> None:
    """Called by the server before it starts the engine."""
    os.environ[ENGINE_PARENT_ENV] = str(os.getpid())


def is_engine_process() -> bool:
    server_pid = os.environ.get(ENGINE_PARENT_ENV)
    return server_pid is not None and server_pid != str(os.getpid())


def signal_on_parent_death(signum: int) -> str | None:
    """Asks Linux to send this process `signum` when its parent dies; the error, if refused."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        return os.strerror(ctypes.get_errno())
    return None


def die_with_parent() -> None:
    """In an engine process: be killed when the parent process dies."""
    if not is_engine_process() or not sys.platform.startswith("linux"):
        return
    problem = signal_on_parent_death(signal.SIGKILL)
    if problem is not None:
        logger.warning(
            "cannot tie this engine process to its parent (prctl: %s); it would outlive a "
            "killed server",
            problem,
        )
        return
    parent = multiprocessing.parent_process()
    if parent is not None and os.getppid() != parent.pid:
        os._exit(1)  # the parent died before the request took effect: nothing is left to serve
