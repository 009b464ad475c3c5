"""The engine's processes die with the server that started them, from the moment each exists.

vLLM runs its engine core, and the core its workers, as separate processes. When the server dies
(SIGKILL, the OOM killer, or a SIGTERM that stops it while the engine still loads) nothing tells
them: they are re-parented to PID 1 and go on running, holding memory (and, on a GPU, the device)
that a restarted replica then cannot have. Each of them asks the kernel for SIGKILL when its
parent dies (Linux `PR_SET_PDEATHSIG`): the server's death takes the engine core down, and the
core's death its workers.

The request has to be made before the process does anything else: a child spends its first
seconds importing torch and vLLM, and an orchestrator stops pods at any moment of their start.
So multiprocessing starts these processes through a small launcher (`tie_spawned_processes`)
that makes the request, checks that the parent is still there, and only then executes Python.
multiprocessing's resource tracker is started plainly: it ignores signals by design, and exits
by itself once every process holding its pipe has gone, after removing what they leaked.

vLLM loads the entry points of the `vllm.general_plugins` group in every process it starts;
`die_with_parent` is one (pyproject.toml): it has an engine process start its own children
through the same launcher. It acts only beneath a server that called `mark_engine_parent`, so
that any other program using vLLM is left as it is.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import sys
from pathlib import Path

from plumbing.lifetime import PR_SET_PDEATHSIG, signal_on_parent_death

logger = logging.getLogger(__name__)

# The server's pid, inherited through the environment by every process the engine starts.
ENGINE_PARENT_ENV = "LLM_COMPLETIONS_SERVER_PID"
# The launcher's path, and the pid of the process whose children it is starting.
LAUNCHER_ENV = "LLM_COMPLETIONS_ENGINE_LAUNCHER"
SPAWNER_ENV = "LLM_COMPLETIONS_SPAWNER_PID"
RESOURCE_TRACKER = "multiprocessing.resource_tracker"

# Run as `launcher ARGS...` in place of `python ARGS...`; -I -S keep its own start to a few ms.
LAUNCHER_SOURCE = """#!{python} -IS
# Starts {python} killed when its parent dies (llm-completions, service/model/lifetime.py).
import ctypes, os, sys
if "{tracker}" not in " ".join(sys.argv[1:]):
    if ctypes.CDLL(None).prctl({option}, {signal}, 0, 0, 0) != 0:
        sys.exit("cannot ask to be killed with the parent process (prctl failed)")
    if os.getppid() != int(os.environ["{spawner}"]):
        os._exit(1)  # the parent died before the request took effect
os.execv({python!r}, [{python!r}, *sys.argv[1:]])
"""


def mark_engine_parent(scratch: Path) -> None:
    """Called by the server before it starts the engine: the engine's processes, started from
    now on, die with it. The launcher is written into `scratch`, which lives as long as the
    engine."""
    os.environ[ENGINE_PARENT_ENV] = str(os.getpid())
    if not sys.platform.startswith("linux"):
        return
    launcher = scratch / "engine-python"
    launcher.write_text(
        LAUNCHER_SOURCE.format(
            python=sys.executable,
            tracker=RESOURCE_TRACKER,
            option=PR_SET_PDEATHSIG,
            signal=int(signal.SIGKILL),
            spawner=SPAWNER_ENV,
        )
    )
    launcher.chmod(0o755)
    os.environ[LAUNCHER_ENV] = str(launcher)
    tie_spawned_processes()


def tie_spawned_processes() -> None:
    """The processes multiprocessing starts from now on (spawn or forkserver) start through
    the launcher, tied to this one."""
    launcher = os.environ.get(LAUNCHER_ENV)
    if launcher is None or not os.access(launcher, os.X_OK):
        return
    os.environ[SPAWNER_ENV] = str(os.getpid())
    multiprocessing.set_executable(launcher)


def is_engine_process() -> bool:
    server_pid = os.environ.get(ENGINE_PARENT_ENV)
    return server_pid is not None and server_pid != str(os.getpid())


def die_with_parent() -> None:
    """In an engine process: be killed when the parent process dies (already asked by the
    launcher that started it; asked again for a process started otherwise, e.g. forked), and
    start this process's own children through the launcher."""
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
    tie_spawned_processes()
