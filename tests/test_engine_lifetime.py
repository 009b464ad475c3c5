"""The engine's processes never outlive the server: stopped at any moment of its start, with
SIGTERM or SIGKILL, a replica exits at once and leaves no process; with two frontend
processes (API_SERVER_COUNT=2) too, stopped while its engine core loads and its frontends
start. (A copy of the server standing by for the engine core, killed with the server:
tests/unit/test_standby_core.py. Killed outright once it
serves: tests/test_multi_replica.py, where a replica of a fleet is SIGKILLed. Started beside
another engine with automatic binding: tests/test_service_lifecycle.py.)"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from service.model.lifetime import ENGINE_PARENT_ENV
from tests.conftest import ENGINE_START_TIMEOUT, SMALL_ENGINE
from tests.processes import TestStack, free_port, is_engine, still_running

GONE_WITHIN_SECONDS = 5.0
# Gone "at once": measured 0.1-2 s, and 6.7 s on a host running the other shard's tests;
# well under Kubernetes' 30 s grace before it kills.
SIGTERM_EXIT_SECONDS = 10.0
KILLED_EXIT_GUARD = 60.0  # a hang guard: a SIGKILLed process cannot take time to exit


def engine_processes(server: psutil.Process) -> list[psutil.Process]:
    return [child for child in server.children(recursive=True) if is_engine(child)]


# The moments of a start at which an orchestrator may stop a replica (a rolling update, a failed
# startup probe, a scale-in), each recognised by what the replica has shown so far: the seconds
# since its engine core appeared (None before), and its log.
StageReached = Callable[[float | None, str], bool]
STAGES: dict[str, StageReached] = {
    # The engine core has just been launched: the server's copy, standing by since the end of
    # the server's imports (service/model/standby_core.py), has taken vLLM's engine core on.
    "just spawned": lambda core_age, log: core_age is not None,
    # Its first second: handed the engine, it sets up (the engine's configuration, its queues,
    # the device), before it loads the model.
    "setting up": lambda core_age, log: core_age is not None and core_age >= 1.0,
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
    started: list[psutil.Process] | None = None  # its processes when it was stopped

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
        self.started = psutil.Process(self.pid).children(recursive=True)
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


def left_running(one: Starting) -> list[psutil.Process]:
    """What the replica started and still runs: its processes when it was stopped, and any
    process on the host carrying its pid."""
    found = {p.pid: p for p in [*(one.started or []), *processes_of(one.pid)]}
    return [process for process in found.values() if still_running(process)]


def start_replica(tmp_path: Path, signum: signal.Signals, frontends: int) -> Starting:
    several = {"API_SERVER_COUNT": str(frontends)} if frontends > 1 else {}
    if several:
        several["FRONTEND_PORTS"] = ",".join(str(free_port()) for _ in range(frontends))
    replica = TestStack(
        grpc_port=free_port(),
        service_args=[*SMALL_ENGINE, "--metrics-port", str(free_port())],
        service_log=tmp_path / f"service-{signum.name}.log",
        engine="lifetime",
        env=several,
    )
    replica.start(with_envoy=False)
    return Starting(replica, signum)


# Each stage with one frontend; with two, the moment its engine core loads the weights while
# its frontends start.
CASES = [(stage, 1) for stage in STAGES] + [("loading weights", 2)]


@pytest.mark.parametrize(("stage", "frontends"), CASES)
def test_stopped_at_any_moment_of_its_start_a_replica_leaves_nothing(
    tmp_path: Path, stage: str, frontends: int
) -> None:
    """Two replicas start side by side; at `stage`, one gets SIGTERM and one SIGKILL. Both
    are gone at once (SIGTERM: a clean exit), and a few seconds later no process either
    started is left anywhere on the host."""
    starting = [start_replica(tmp_path, s, frontends) for s in (signal.SIGTERM, signal.SIGKILL)]
    try:
        deadline = time.monotonic() + ENGINE_START_TIMEOUT
        while not all([one.stop_at(STAGES[stage]) for one in starting]):
            assert time.monotonic() < deadline, f"never reached {stage!r}"
            time.sleep(0.1)
        for one in starting:
            # SIGKILL ends a process at once by definition: only a clean exit on SIGTERM is
            # timed (waiting on one replica must not count against the other).
            timeout = SIGTERM_EXIT_SECONDS if one.signum == signal.SIGTERM else KILLED_EXIT_GUARD
            returncode = one.replica.processes[0].wait(timeout=timeout)
            assert returncode == (0 if one.signum == signal.SIGTERM else -signal.SIGKILL)
            assert one.stopped_at is not None
            if one.signum == signal.SIGTERM:
                assert time.monotonic() - one.stopped_at < SIGTERM_EXIT_SECONDS + 1
        deadline = time.monotonic() + GONE_WITHIN_SECONDS
        while any(left_running(one) for one in starting) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = {one.signum.name: left_running(one) for one in starting}
        assert not any(left.values()), f"still running after {stage!r}: {left}"
    finally:
        for one in starting:
            for process in left_running(one):
                process.kill()
            one.replica.stop()
