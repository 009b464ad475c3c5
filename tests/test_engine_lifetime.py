"""The engine's processes never outlive the server: killed outright (SIGKILL, as the OOM
killer does) the server takes its engine core and workers with it and frees its port; stopped
at any moment of its start, with SIGTERM or SIGKILL, it exits at once and leaves no process.
(Started beside the session's engine with automatic binding, the service also warns that they
share cores, and moves its engine core onto the cores vLLM bound its worker to.)"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from service.model.lifetime import ENGINE_PARENT_ENV
from tests.conftest import ENGINE_START_TIMEOUT, SMALL_ENGINE
from tests.processes import TestStack, free_port, thread_affinities

ENGINE_PROCESS_PREFIX = "VLLM::"
GONE_WITHIN_SECONDS = 5.0
SIGTERM_EXIT_SECONDS = 5.0


def engine_processes(server: psutil.Process) -> list[psutil.Process]:
    return [child for child in server.children(recursive=True) if is_engine(child)]


def is_engine(process: psutil.Process) -> bool:
    try:
        return process.name().startswith(ENGINE_PROCESS_PREFIX) or any(
            part.startswith(ENGINE_PROCESS_PREFIX) for part in process.cmdline()[:1]
        )
    except psutil.NoSuchProcess:
        return False


def alive(processes: list[psutil.Process]) -> list[psutil.Process]:
    return [p for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]


def wait_gone(processes: list[psutil.Process], timeout: float) -> None:
    """Fails if any of them still runs after `timeout` (and then kills it, as an operator
    would have to)."""
    deadline = time.monotonic() + timeout
    while alive(processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = alive(processes)
    for process in left:
        process.kill()
    assert not left, f"still running {timeout:.0f}s later: {left}"


@pytest.fixture
def service(tmp_path: Path) -> Iterator[TestStack]:
    running = TestStack(
        grpc_port=free_port(),
        service_args=[*SMALL_ENGINE, "--metrics-port", str(free_port())],
        service_log=tmp_path / "service.log",
    )
    running.start(with_envoy=False)
    try:
        yield running
    finally:
        running.stop()


def assert_warned_about_shared_cores(service: TestStack) -> None:
    """It bound automatically while another engine (the session's) ran on this host."""
    assert service.service_log is not None
    warnings = [
        line
        for line in service.service_log.read_text().splitlines()
        if "WARNING" in line and "beside another vLLM engine" in line
    ]
    assert len(warnings) == 1 and "--cpu-cores" in warnings[0]


def assert_engine_core_beside_its_worker(engines: list[psutil.Process]) -> None:
    """With automatic binding, the engine core's threads all sit on the worker's bound cores."""
    (worker,) = [p for p in engines if p.name() == "VLLM::Worker"]
    (engine_core,) = [p for p in engines if p.name() == "VLLM::EngineCore"]
    anywhere = os.sched_getaffinity(0)
    worker_cores = set().union(*(c for c in thread_affinities(worker) if c < anywhere))
    assert worker_cores and worker_cores < anywhere
    assert all(cores == worker_cores for cores in thread_affinities(engine_core))


def test_a_killed_server_leaves_no_engine_process_and_frees_its_port(
    stack: TestStack, service: TestStack
) -> None:
    service.wait_ready_service(ENGINE_START_TIMEOUT)
    assert_warned_about_shared_cores(service)
    server = psutil.Process(service.processes[0].pid)
    engines = engine_processes(server)
    assert {p.name() for p in engines} >= {"VLLM::EngineCore", "VLLM::Worker"}, engines
    assert_engine_core_beside_its_worker(engines)
    server.send_signal(signal.SIGKILL)
    service.processes[0].wait(timeout=10)
    wait_gone(engines, GONE_WITHIN_SECONDS)
    # The port is free at once: a restarted replica can listen on it.
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", service.grpc_port))
        sock.listen()


# The moments of a start at which an orchestrator may stop a replica (a rolling update, a failed
# startup probe, a scale-in), each recognised by what the replica has shown so far: the seconds
# since its engine core appeared (None before), and its log.
StageReached = Callable[[float | None, str], bool]
STAGES: dict[str, StageReached] = {
    "just spawned": lambda core_age, log: core_age is not None,
    # The core spends its first seconds importing torch and vLLM, before it loads any plugin.
    "importing": lambda core_age, log: core_age is not None and core_age >= 1.0,
    "loading weights": lambda core_age, log: "Starting to load model" in log,
    "warming up": lambda core_age, log: "Loading weights took" in log,
}


@dataclass
class Starting:
    """A replica being started, to be stopped with `signum` once it reaches a stage."""

    replica: TestStack
    signum: signal.Signals
    core_seen: float | None = None
    stopped_at: float | None = None

    @property
    def pid(self) -> int:
        return self.replica.processes[0].pid

    def log(self) -> str:
        assert self.replica.service_log is not None
        return self.replica.service_log.read_text(errors="replace")

    def stop_at(self, stage: StageReached) -> bool:
        """Sends the signal once the stage is reached; True once sent."""
        if self.stopped_at is not None:
            return True
        assert self.replica.processes[0].poll() is None, "the replica exited while starting"
        if self.core_seen is None and engine_processes(psutil.Process(self.pid)):
            self.core_seen = time.monotonic()
        core_age = None if self.core_seen is None else time.monotonic() - self.core_seen
        if not stage(core_age, self.log()):
            return False
        assert not self.replica.service_serving(), "the replica should still be starting"
        os.kill(self.pid, self.signum)
        self.stopped_at = time.monotonic()
        return True


def processes_of(server_pid: int) -> list[psutil.Process]:
    """Every process on the host that a server started, whoever its parent is now: they all
    carry the server's pid in their environment (even re-parented to PID 1)."""
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get(ENGINE_PARENT_ENV) == str(server_pid):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return [p for p in found if p.pid != server_pid]


def start_replica(tmp_path: Path, signum: signal.Signals) -> Starting:
    replica = TestStack(
        grpc_port=free_port(),
        service_args=[*SMALL_ENGINE, "--metrics-port", str(free_port())],
        service_log=tmp_path / f"service-{signum.name}.log",
    )
    replica.start(with_envoy=False)
    return Starting(replica, signum)


@pytest.mark.parametrize("stage", list(STAGES))
def test_stopped_at_any_moment_of_its_start_a_replica_leaves_nothing(
    tmp_path: Path, stage: str
) -> None:
    """Two replicas start side by side; at `stage`, one gets SIGTERM and one SIGKILL. Both
    are gone at once (SIGTERM: a clean exit), and a few seconds later no process either
    started is left anywhere on the host."""
    starting = [start_replica(tmp_path, s) for s in (signal.SIGTERM, signal.SIGKILL)]
    try:
        deadline = time.monotonic() + ENGINE_START_TIMEOUT
        while not all([one.stop_at(STAGES[stage]) for one in starting]):
            assert time.monotonic() < deadline, f"never reached {stage!r}"
            time.sleep(0.1)
        for one in starting:
            returncode = one.replica.processes[0].wait(timeout=SIGTERM_EXIT_SECONDS)
            assert returncode == (0 if one.signum == signal.SIGTERM else -signal.SIGKILL)
            assert one.stopped_at is not None
            assert time.monotonic() - one.stopped_at < SIGTERM_EXIT_SECONDS + 1
        deadline = time.monotonic() + GONE_WITHIN_SECONDS
        while any(processes_of(one.pid) for one in starting) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {one.signum.name: processes_of(one.pid) for one in starting}
        assert not any(left.values()), f"still running after {stage!r}: {left}"
    finally:
        for one in starting:
            for process in processes_of(one.pid):
                process.kill()
            one.replica.stop()
