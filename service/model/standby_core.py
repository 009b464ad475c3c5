"""On vLLM's CPU build, the engine core starts as a copy of the server, forked once the server has
imported torch and vLLM, instead of as a new interpreter that imports them again.

vLLM's CPU build spawns its engine core: a new Python process spends its first ~10 s (as many
CPU-seconds) importing what the server has already imported. Forking the server when vLLM
launches the core would copy gRPC's threads and listening sockets into it, so the copy is made
earlier (`stand_by`): right after the server's imports, before it starts a thread or opens a
socket. The copy waits. When vLLM launches the engine core, `standing_in` hands vLLM's process
object to the copy, which runs it as a forked multiprocessing child would (vLLM watches, signals
and joins it by the same pid and sentinel). A copy never handed anything exits when the server
closes its end of the pipe, or dies with the server.

What a spawned process reads as it starts, the copy read in the server: the environment at the
launch is handed over with the process; OpenMP read its binding (the environment vLLM sets for
its worker) when torch loaded, so the copy binds itself instead: its main thread, and every
thread it starts, on the engine's cores, with as many OpenMP threads as cores.

GNU OpenMP does not rebuild its thread pool after a fork: a copy of a process that has run a
team of several threads hangs at its own first team. So the server loads torch with one OpenMP
thread (`torch_loaded_single_threaded`), which never needs a pool, and gets its usual count back
once the copy is made.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import popen_fork, process, reduction, util
from multiprocessing.context import SpawnContext, set_spawning_popen
from typing import Any, NoReturn

from plumbing.lifetime import signal_on_parent_death

logger = logging.getLogger(__name__)

OMP_THREADS_ENV = "OMP_NUM_THREADS"

# What the engine core imports beyond the server's: imported before the copy is made.
ENGINE_CORE_MODULES = (
    "vllm.v1.engine.core",
    "vllm.v1.executor.uniproc_executor",
    "vllm.v1.worker.cpu_worker",
)


@dataclass
class Standby:
    """The server's copy, waiting for the process it is to run."""

    pid: int
    orders: int  # the write end of the pipe the copy reads its process from
    sentinel: int  # readable once the copy has exited (it holds the other end)
    parent_sentinel: int  # held open by the server: the copy's view of its parent
    handed: bool = False

    def hand_over(self, payload: bytes) -> None:
        with open(self.orders, "wb", closefd=True) as orders:
            orders.write(payload)
        self.handed = True

    def dismiss(self) -> None:
        """Let a copy that was handed nothing exit (it reads the end of its pipe)."""
        if not self.handed:
            self.handed = True
            os.close(self.orders)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(self.pid, 0)
            os.close(self.sentinel)
            os.close(self.parent_sentinel)


@contextlib.contextmanager
def torch_loaded_single_threaded() -> Iterator[None]:
    """Hold while torch is first imported: OpenMP reads a count of one thread."""
    usual = os.environ.get(OMP_THREADS_ENV)
    os.environ[OMP_THREADS_ENV] = "1"
    try:
        yield
    finally:
        if usual is None:
            os.environ.pop(OMP_THREADS_ENV)
        else:
            os.environ[OMP_THREADS_ENV] = usual


def usual_thread_count() -> int:
    """OpenMP's count for this process had torch loaded as usual."""
    configured = os.environ.get(OMP_THREADS_ENV, "").split(",")[0].strip()
    return int(configured) if configured.isdigit() else len(os.sched_getaffinity(0))


def stand_by(wanted: bool) -> Standby | None:
    """If `wanted`, fork the copy; call before this process starts a thread or opens a socket.
    None (vLLM spawns its engine core) off Linux, if torch was not loaded single-threaded, or if
    a Python thread runs already (the copy would lack it). Either way, torch runs with its usual
    thread count afterwards."""
    import torch

    try:
        if not wanted or not sys.platform.startswith("linux"):
            return None
        if torch.get_num_threads() != 1 or threading.active_count() > 1:
            logger.warning("torch ran threads, or a thread runs: vLLM spawns the engine core")
            return None
        return fork_standby()
    finally:
        torch.set_num_threads(usual_thread_count())


def fork_standby() -> Standby:
    for name in ENGINE_CORE_MODULES:
        __import__(name)
    orders_read, orders_write = os.pipe()
    sentinel_read, sentinel_write = os.pipe()
    parent_read, parent_write = os.pipe()
    util._flush_std_streams()
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        for end in (orders_write, sentinel_read, parent_write):
            os.close(end)
        wait_for_orders(server, orders_read, parent_read)
    for end in (orders_read, sentinel_write, parent_read):
        os.close(end)
    logger.info("engine core standing by (pid %d), forked after the imports", pid)
    return Standby(pid, orders_write, sentinel_read, parent_write)


def wait_for_orders(server: int, orders: int, parent_sentinel: int) -> NoReturn:
    """In the copy: die with the server, wait for the process to run, run it, exit."""
    code = 1
    try:
        if signal_on_parent_death(signal.SIGKILL) is not None or os.getppid() != server:
            return  # untied, or the server is gone already
        with open(orders, "rb", closefd=True) as pipe:
            payload = pipe.read()
        if not payload:
            code = 0  # dismissed
            return
        process.current_process()._inheriting = True  # type: ignore[attr-defined]
        try:
            environment, cores, engine_core = reduction.ForkingPickler.loads(payload)
        finally:
            del process.current_process()._inheriting  # type: ignore[attr-defined]
        take_environment(environment)
        bind_threads(cores)
        code = engine_core._bootstrap(parent_sentinel=parent_sentinel)
    finally:
        os._exit(code)


def take_environment(environment: dict[str, str]) -> None:
    """Make this process's environment `environment`. setproctitle claims the memory of the
    arguments and the environment the first time it is used, and finds no room for a title
    (vLLM's `VLLM::EngineCore`) once the environment has changed: it is made to claim it first."""
    with contextlib.suppress(ImportError):
        import setproctitle

        setproctitle.getproctitle()
    os.environ.clear()
    os.environ.update(environment)


def bind_threads(cores: Sequence[int]) -> None:
    """This thread and the threads it starts on `cores`, OpenMP's count as many (none: its
    usual count, anywhere)."""
    import torch

    if cores:
        os.sched_setaffinity(0, cores)
    torch.set_num_threads(len(cores) or usual_thread_count())


class StandbyPopen(popen_fork.Popen):
    """multiprocessing's view of the engine core that the copy runs: a forked child's."""

    method = "standby"
    standby: Standby | None = None  # the copy to hand the next process to
    cores: Sequence[int] = ()

    def duplicate_for_child(self, fd: int) -> int:
        raise ValueError("a process handed to the standing-by copy cannot be given open files")

    def _launch(self, process_obj: Any) -> None:
        standby, StandbyPopen.standby = StandbyPopen.standby, None
        if standby is None:
            raise RuntimeError("no copy of the server stands by for this process")
        self.pid = standby.pid
        self.sentinel = standby.sentinel
        self.finalizer = util.Finalize(self, util.close_fds, (standby.sentinel,))
        payload = io.BytesIO()
        set_spawning_popen(self)  # lets the process's authkey be pickled, as spawn does
        try:
            reduction.dump((dict(os.environ), tuple(self.cores), process_obj), payload)
        finally:
            set_spawning_popen(None)
        standby.hand_over(payload.getvalue())


class StandbyProcess(process.BaseProcess):
    # In the copy, multiprocessing's default for its own children: a spawned engine core's.
    _start_method = "spawn"

    @staticmethod
    def _Popen(process_obj: Any) -> StandbyPopen:
        return StandbyPopen(process_obj)


class StandbyContext(SpawnContext):
    """vLLM's multiprocessing context while the copy stands in: its one Process is the copy;
    anything else (queues, locks) as spawn makes them."""

    _name = StandbyPopen.method
    Process = StandbyProcess


@contextlib.contextmanager
def standing_in(standby: Standby | None, cores: Sequence[int]) -> Iterator[None]:
    """While vLLM launches the engine core: the core is `standby`, bound to `cores`."""
    if standby is None or standby.handed:
        yield
        return
    import vllm.v1.engine.utils as vllm_engine_utils

    StandbyPopen.standby, StandbyPopen.cores = standby, cores
    launch_context = vllm_engine_utils.get_mp_context
    vllm_engine_utils.get_mp_context = StandbyContext  # type: ignore[assignment]
    try:
        yield
    finally:
        vllm_engine_utils.get_mp_context = launch_context
        StandbyPopen.standby = None
        if not standby.handed:  # the launch failed, or spawned a process of its own
            logger.warning("the standing-by engine core was not used: letting it go")
            standby.dismiss()
