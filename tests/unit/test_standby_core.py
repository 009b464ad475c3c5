"""The engine core and a replica's frontends as copies of the server forked after its imports: a
copy runs the process multiprocessing hands it as a forked child would, with the environment
of the launch and the open files the process refers to, and exits when dismissed (one of
several too); a server that ran torch with several threads, or runs a thread, spawns."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from multiprocessing import Event, Pipe, get_context
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch

from service.model import standby_core
from service.model.standby_core import StandbyContext, standing_in

EXIT_CODE_ENV = "STANDBY_TEST_EXIT_CODE"


def report(path: Path) -> None:
    """Run in the copy: what a process there sees."""
    with path.open("w") as out:
        print(
            os.getpid(),
            os.environ.get("STANDBY_TEST_VALUE"),
            sorted(os.sched_getaffinity(0)),
            torch.get_num_threads(),
            file=out,
        )
    sys.exit(int(os.environ.get(EXIT_CODE_ENV, "0")))


def as_if_single_threaded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)  # as if loaded single-threaded
    monkeypatch.setattr(torch, "set_num_threads", lambda count: None)  # this process keeps its own
    # As if no thread ran: an idle pool thread an earlier module of this worker left (vLLM's
    # tokenizer pool) is nothing the copies need.
    monkeypatch.setattr(standby_core.threading, "active_count", lambda: 1)


@pytest.fixture
def standby(monkeypatch: pytest.MonkeyPatch) -> Iterator[standby_core.Standby]:
    as_if_single_threaded(monkeypatch)
    (copy,) = standby_core.stand_by(1)
    yield copy
    copy.dismiss()


def launch(copy: standby_core.Standby, path: Path, cores: tuple[int, ...] = ()) -> BaseProcess:
    """Start `report` as vLLM starts its engine core, with the copy standing in."""
    with standing_in(copy, cores):
        import vllm.v1.engine.utils as vllm_engine_utils

        process = vllm_engine_utils.get_mp_context().Process(target=report, args=(path,))
        process.start()
    return process


def test_the_copy_runs_the_handed_process_with_the_launchs_environment(
    standby: standby_core.Standby, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "seen"
    monkeypatch.setenv("STANDBY_TEST_VALUE", "set-after-the-fork")
    monkeypatch.setenv(EXIT_CODE_ENV, "3")
    process = launch(standby, path)
    process.join(30)
    pid, value, _, _ = path.read_text().split(" ", 3)
    assert int(pid) == standby.pid == process.pid
    assert value == "set-after-the-fork"
    assert process.exitcode == 3  # multiprocessing sees the copy's exit as its child's


def test_the_copy_binds_itself_to_the_engines_cores(
    standby: standby_core.Standby, tmp_path: Path
) -> None:
    path = tmp_path / "seen"
    core = min(os.sched_getaffinity(0))
    process = launch(standby, path, (core,))
    process.join(30)
    assert path.read_text().split(" ", 2)[2].startswith(f"[{core}]")


def test_a_dismissed_copy_exits_and_another_launch_spawns(standby: standby_core.Standby) -> None:
    standby.dismiss()
    with pytest.raises(ChildProcessError):
        os.waitpid(standby.pid, os.WNOHANG)  # reaped: it exited
    import vllm.v1.engine.utils as vllm_engine_utils

    with standing_in(standby, ()):
        assert vllm_engine_utils.get_mp_context() is not StandbyContext


def test_a_server_that_ran_torch_on_several_threads_or_runs_a_thread_spawns(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(torch, "set_num_threads", lambda count: None)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    assert standby_core.stand_by(1) == []
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    stop = Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert standby_core.stand_by(1) == []
    finally:
        stop.set()
        thread.join()
    assert standby_core.stand_by(0) == []


def test_torch_loads_single_threaded_and_the_usual_count_comes_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "4")
    with standby_core.torch_loaded_single_threaded():
        assert os.environ["OMP_NUM_THREADS"] == "1"
    assert os.environ["OMP_NUM_THREADS"] == "4"
    assert standby_core.usual_thread_count() == 4
    monkeypatch.delenv("OMP_NUM_THREADS")
    with standby_core.torch_loaded_single_threaded():
        pass
    assert "OMP_NUM_THREADS" not in os.environ
    assert standby_core.usual_thread_count() == len(os.sched_getaffinity(0))


def test_the_environment_taken_is_the_launchs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KEPT", "1")
    monkeypatch.setenv("DROPPED", "1")
    wanted = {**os.environ, "ADDED": "2"}
    del wanted["DROPPED"]
    standby_core.take_environment(wanted)
    assert dict(os.environ) == wanted
    monkeypatch.delenv("ADDED")


def titled(path: Path) -> None:
    """Run in the copy: take vLLM's engine-core title, report the name the kernel shows."""
    from vllm.utils.system_utils import set_process_title

    set_process_title("EngineCore")
    path.write_text(Path("/proc/self/comm").read_text().strip())


def test_the_copy_takes_vllms_title_whatever_the_environment_became(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The launch's environment lacks a variable the copy was made with and has one it lacked
    (vLLM's placement and the parent-death tie are set after the copy is made)."""
    as_if_single_threaded(monkeypatch)
    monkeypatch.setenv("STANDBY_TEST_GONE_AT_THE_LAUNCH", "1")
    (copy,) = standby_core.stand_by(1)
    monkeypatch.delenv("STANDBY_TEST_GONE_AT_THE_LAUNCH")
    monkeypatch.setenv("STANDBY_TEST_SET_AT_THE_LAUNCH", "1")
    path = tmp_path / "comm"
    with standing_in(copy, ()):
        import vllm.v1.engine.utils as vllm_engine_utils

        engine_core = vllm_engine_utils.get_mp_context().Process(target=titled, args=(path,))
        engine_core.start()
    engine_core.join(30)
    assert engine_core.exitcode == 0
    assert path.read_text() == "VLLM::EngineCor"  # /proc's 15 characters of VLLM::EngineCore


KILLED_SERVER = """
import os, signal
from service.model import standby_core
with standby_core.torch_loaded_single_threaded():
    import torch
(copy,) = standby_core.stand_by(1)
print(copy.pid, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_copy_standing_by_dies_with_a_killed_server() -> None:
    server = subprocess.run(
        [sys.executable, "-c", KILLED_SERVER], capture_output=True, text=True, timeout=120
    )
    assert server.returncode == -signal.SIGKILL, server.stderr
    copy = int(server.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while psutil.pid_exists(copy) and psutil.Process(copy).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, "the copy outlived its server"
        time.sleep(0.05)


def test_a_launch_that_fails_before_the_handover_lets_the_copy_go(
    standby: standby_core.Standby,
) -> None:
    with pytest.raises(RuntimeError), standing_in(standby, ()):
        raise RuntimeError("the engine's configuration was refused")
    assert standby.handed
    with pytest.raises(ChildProcessError):
        os.waitpid(standby.pid, os.WNOHANG)  # reaped: it exited


def shared_and_sent(counters: Any, connection: Connection) -> None:
    """Run in a copy: write to the shared memory and over the socket it was handed."""
    counters[0] = os.getpid()
    connection.send("over the handed socket")
    sys.exit(0)


def test_a_process_handed_open_files_uses_them(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A frontend's shared memory and sockets reach the copy that runs it (spawn would pass
    them on its command line's descriptors; a copy made earlier is sent them)."""
    as_if_single_threaded(monkeypatch)
    first, second = standby_core.stand_by(2)
    counters = get_context("spawn").RawArray("q", 1)
    ours, theirs = Pipe()
    process = standby_core.start_process(second, target=shared_and_sent, args=(counters, theirs))
    theirs.close()
    assert ours.poll(30)
    assert ours.recv() == "over the handed socket"
    process.join(30)
    assert process.exitcode == 0
    assert counters[0] == second.pid == process.pid
    first.dismiss()  # the second copy held none of the first's channel: it read its end
    with pytest.raises(ChildProcessError):
        os.waitpid(first.pid, os.WNOHANG)


def test_without_a_copy_the_process_is_spawned(tmp_path: Path) -> None:
    path = tmp_path / "seen"
    process = standby_core.start_process(None, target=report, args=(path,))
    process.join(60)
    assert process.exitcode == 0
    assert int(path.read_text().split(" ", 1)[0]) == process.pid


def test_a_copy_let_go_exits_while_a_process_forked_since_holds_the_servers_end(
    standby: standby_core.Standby,
) -> None:
    """vLLM forks its engine core on a GPU: that process holds the server's end of every
    copy's channel too, and a copy let go must still read the end of its orders."""
    holder = os.fork()
    if holder == 0:
        time.sleep(60)
        os._exit(0)
    try:
        letting_go = threading.Thread(target=standby.dismiss)
        letting_go.start()
        letting_go.join(15)
        assert not letting_go.is_alive(), "the copy never read the end of its orders"
    finally:
        os.kill(holder, signal.SIGKILL)
        os.waitpid(holder, 0)
