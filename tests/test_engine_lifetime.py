"""The engine's processes never outlive the server: killed outright (SIGKILL, as the OOM
killer does) the server takes its engine core and workers with it and frees its port; stopped
while the engine is still loading, it stops the load and exits at once. (Started beside the
session's engine with automatic binding, the service also warns that they share cores, and
moves its engine core onto the cores vLLM bound its worker to.)"""

from __future__ import annotations

import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

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


def test_sigterm_while_the_engine_loads_stops_the_load_and_exits(service: TestStack) -> None:
    server = psutil.Process(service.processes[0].pid)
    deadline = time.monotonic() + ENGINE_START_TIMEOUT
    while not any(p.name() == "VLLM::Worker" for p in engine_processes(server)):
        assert time.monotonic() < deadline, "the engine never started loading"
        assert service.processes[0].poll() is None, "the service exited while loading"
        time.sleep(0.2)
    assert not service.service_serving(), "the engine should still be loading"
    engines = engine_processes(server)
    sent = time.monotonic()
    server.send_signal(signal.SIGTERM)
    service.processes[0].wait(timeout=SIGTERM_EXIT_SECONDS)
    exited = time.monotonic() - sent
    assert exited < SIGTERM_EXIT_SECONDS
    wait_gone(engines, GONE_WITHIN_SECONDS)
