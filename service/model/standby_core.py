"""The processes a server starts for its engine, the engine core on vLLM's CPU build and the
frontends of a replica with several, start as copies of the server, forked once the server has
imported torch and vLLM, instead of as new interpreters that import them again.

vLLM spawns its engine core on its CPU build, and a replica spawned its frontends: a new Python
process spends its first ~10 s (as many CPU-seconds) importing what the server has already
imported. Forking the server at the launch would copy gRPC's threads and listening sockets
into the child, so the copies are made earlier (`stand_by`): right after the server's imports,
before it starts a thread or opens a socket. A copy waits. When a process is launched
(`standing_in` for vLLM's engine core, `start_process` for a frontend), its multiprocessing
process object is handed to a copy, with the open files it refers to (its queues' sockets,
its shared memory; passed over a unix socket, as multiprocessing's forkserver passes them),
and the copy runs it as a forked multiprocessing child would (the server watches, signals and
joins it by the same pid and sentinel). A copy never handed anything exits when the server
shuts the channel down, or dies with the server.

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
import socket
import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing import get_context, popen_fork, process, reduction, util
from multiprocessing.context import SpawnContext, set_spawning_popen
from multiprocessing.process import BaseProcess
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


# Open files a handed process may carry (its queues' sockets, shared memory): a frontend of
# several carries about four.
MAX_HANDED_FILES = 64


@dataclass
class Standby:
    """A copy of the server, waiting for the process it is to run."""

    pid: int
    orders: int  # the server's end of the socket the copy reads its process (and files) from
    sentinel: int  # readable once the copy has exited (it holds the other end)
    parent_sentinel: int  # held open by the server: the copy's view of its parent
    handed: bool = False

    def hand_over(self, payload: bytes, files: Sequence[int]) -> None:
        """Send the pickled process and the open files it refers to (by their place in
        `files`, as InheritedFile); the copy reads until the end. Handed even if sending
        fails: the copy then reads a broken process and exits."""
        self.handed = True
        with socket.socket(fileno=self.orders) as orders:
            if files:
                socket.send_fds(orders, [b"F"], list(files))
            else:
                orders.sendall(b"-")
            orders.sendall(payload)
            end_of_orders(orders)

    def dismiss(self) -> None:
        """Let a copy that was handed nothing exit (it reads the end of its orders)."""
        if not self.handed:
            self.handed = True
            try:
                with socket.socket(fileno=self.orders) as orders:
                    end_of_orders(orders)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(self.pid, 0)
            finally:  # a stop signal while waiting still closes them
                os.close(self.sentinel)
                os.close(self.parent_sentinel)


def end_of_orders(orders: socket.socket) -> None:
    """The copy reads the end of its orders even where a process forked since holds the
    server's end too (vLLM forks its engine core on a GPU): a shutdown, not only a close."""
    with contextlib.suppress(OSError):
        orders.shutdown(socket.SHUT_WR)


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


def stand_by(copies: int, modules: Sequence[str] = ()) -> list[Standby]:
    """Fork `copies` copies of this process, once it has imported `modules` too (what they will
    run beyond its own imports: ENGINE_CORE_MODULES for vLLM's CPU engine core only, as they
    patch torch for a CPU); call before it starts a thread or opens a socket. None (an empty
    list: the processes are spawned) off Linux, if torch was not loaded single-threaded, or
    if a Python thread runs already (a copy would lack it). Either way, torch runs with its
    usual thread count afterwards."""
    import torch

    try:
        if not copies or not sys.platform.startswith("linux"):
            return []
        if torch.get_num_threads() != 1 or threading.active_count() > 1:
            logger.warning("torch ran threads, or a thread runs: the engine's processes spawn")
            return []
        for name in modules:
            __import__(name)
        standbys: list[Standby] = []
        for _ in range(copies):
            standbys.append(fork_standby(standbys))
        logger.info(
            "%d %s of the server standing by (pids %s), forked after the imports",
            copies,
            "copy" if copies == 1 else "copies",
            ",".join(str(standby.pid) for standby in standbys),
        )
        return standbys
    finally:
        torch.set_num_threads(usual_thread_count())


def fork_standby(earlier: Sequence[Standby]) -> Standby:
    """Fork one copy; it closes the server's ends of the `earlier` copies' channels (else a
    copy dismissed would never read the end of its orders)."""
    orders_read, orders_write = socket.socketpair()
    sentinel_read, sentinel_write = os.pipe()
    parent_read, parent_write = os.pipe()
    util._flush_std_streams()
    server = os.getpid()
    pid = os.fork()
    if pid == 0:
        try:  # the copy never returns into the server's code
            orders_write.close()
            for end in (sentinel_read, parent_write):
                os.close(end)
            for other in earlier:
                for end in (other.orders, other.sentinel, other.parent_sentinel):
                    os.close(end)
            wait_for_orders(server, orders_read.detach(), parent_read)
        finally:
            os._exit(1)
    orders_read.close()
    for end in (sentinel_write, parent_read):
        os.close(end)
    return Standby(pid, orders_write.detach(), sentinel_read, parent_write)


# In a copy: the open files handed with its process, as InheritedFile refers to them.
HANDED_FILES: list[int] = []


class InheritedFile:
    """An open file pickled for a copy: its place among the files handed with the process
    (multiprocessing's `DupFd` for a forkserver's child works the same way)."""

    def __init__(self, index: int) -> None:
        self.index = index

    def detach(self) -> int:
        return HANDED_FILES[self.index]


def read_orders(orders: int) -> bytes:
    """In the copy: the pickled process, with its open files kept in HANDED_FILES; empty if
    dismissed."""
    with socket.socket(fileno=orders) as channel:
        marker, files, _, _ = socket.recv_fds(channel, 1, MAX_HANDED_FILES)
        HANDED_FILES[:] = files
        chunks = []
        while chunk := channel.recv(1 << 20):
            chunks.append(chunk)
    return b"".join(chunks) if marker else b""


def wait_for_orders(server: int, orders: int, parent_sentinel: int) -> NoReturn:
    """In the copy: die with the server, wait for the process to run, run it, exit."""
    code = 1
    try:
        if signal_on_parent_death(signal.SIGKILL) is not None or os.getppid() != server:
            return  # untied, or the server is gone already
        payload = read_orders(orders)
        if not payload:
            code = 0  # dismissed
            return
        process.current_process()._inheriting = True  # type: ignore[attr-defined]
        try:
            environment, cores, handed = reduction.ForkingPickler.loads(payload)
        finally:
            del process.current_process()._inheriting  # type: ignore[attr-defined]
        take_environment(environment)
        bind_threads(cores)
        code = handed._bootstrap(parent_sentinel=parent_sentinel)
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
    """multiprocessing's view of a process that a copy runs: a forked child's."""

    method = "standby"
    standby: Standby | None = None  # the copy to hand the next process to
    cores: Sequence[int] = ()
    DupFd = InheritedFile

    def duplicate_for_child(self, fd: int) -> int:
        self.handed_files.append(fd)
        return len(self.handed_files) - 1

    def _launch(self, process_obj: Any) -> None:
        standby, StandbyPopen.standby = StandbyPopen.standby, None
        if standby is None:
            raise RuntimeError("no copy of the server stands by for this process")
        self.handed_files: list[int] = []
        payload = io.BytesIO()
        set_spawning_popen(self)  # lets the process's authkey and open files be pickled
        try:
            reduction.dump((dict(os.environ), tuple(self.cores), process_obj), payload)
        finally:
            set_spawning_popen(None)
        # The copy's pid and sentinel are this process's from here (a failed pickling above
        # leaves the copy whole, for its dismissal to close).
        self.pid = standby.pid
        self.sentinel = standby.sentinel
        self.finalizer = util.Finalize(self, util.close_fds, (standby.sentinel,))
        standby.hand_over(payload.getvalue(), self.handed_files)


class StandbyProcess(process.BaseProcess):
    # In the copy, multiprocessing's default for its own children: a spawned process's.
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
def handing_to(standby: Standby, cores: Sequence[int]) -> Iterator[None]:
    """While held, the next StandbyProcess started is run by `standby`, bound to `cores`."""
    StandbyPopen.standby, StandbyPopen.cores = standby, cores
    try:
        yield
    finally:
        StandbyPopen.standby = None


def start_process(standby: Standby | None, **process_arguments: Any) -> BaseProcess:
    """Start a multiprocessing process (`process_arguments` as Process takes them): run by
    `standby`, or spawned without one."""
    if standby is None:
        spawned = get_context("spawn").Process(**process_arguments)
        spawned.start()
        return spawned
    started = StandbyProcess(**process_arguments)
    with handing_to(standby, ()):
        started.start()
    return started


@contextlib.contextmanager
def standing_in(standby: Standby | None, cores: Sequence[int]) -> Iterator[None]:
    """While vLLM launches the engine core: the core is `standby`, bound to `cores`."""
    if standby is None or standby.handed:
        yield
        return
    import vllm.v1.engine.utils as vllm_engine_utils

    launch_context = vllm_engine_utils.get_mp_context
    vllm_engine_utils.get_mp_context = StandbyContext  # type: ignore[assignment]
    try:
        with handing_to(standby, cores):
            yield
    finally:
        vllm_engine_utils.get_mp_context = launch_context
        if not standby.handed:  # the launch failed, or spawned a process of its own
            logger.warning("the standing-by engine core was not used: letting it go")
            standby.dismiss()
