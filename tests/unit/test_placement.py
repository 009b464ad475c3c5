"""Where the engine runs: core lists, their split over the engine's workers, the environment
vLLM reads, and the warning when automatic binding would share cores with another engine."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from service.model import placement
from service.model.placement import PlacementError, binding, parse_core_list, place_engine

FOUR = {0, 1, 2, 3}


@pytest.mark.parametrize(
    ("text", "cores"),
    [("0", (0,)), ("0-3", (0, 1, 2, 3)), ("0,2", (0, 2)), ("0-1, 3", (0, 1, 3))],
)
def test_core_lists(text: str, cores: tuple[int, ...]) -> None:
    assert parse_core_list(text, FOUR) == cores


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("a", "not a list of cores"),
        ("1-", "not a list of cores"),
        ("3-1", "empty range"),
        ("0,0", "names a core twice"),
        ("2-5", "cores [4, 5] are not available here (this process may use 0,1,2,3)"),
    ],
)
def test_bad_core_lists_say_why(text: str, said: str) -> None:
    with pytest.raises(PlacementError, match=re.escape(said)):
        parse_core_list(text, FOUR)


def test_cores_are_split_evenly_over_the_engines_workers() -> None:
    assert binding((0, 1, 2, 3), 1) == "0,1,2,3"
    assert binding((0, 1, 2, 3), 2) == "0,1|2,3"
    with pytest.raises(PlacementError, match="evenly over 2"):
        binding((0, 1, 2), 2)


def fake_proc(root: Path, processes: dict[int, str]) -> Path:
    for pid, name in processes.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "comm").write_text(name + "\n")
    (root / "self").mkdir()
    return root


def test_other_engines_are_found_by_their_process_names(tmp_path: Path) -> None:
    proc = fake_proc(tmp_path, {10: "VLLM::Worker", 11: "VLLM::EngineCor", 12: "python"})
    assert placement.other_engines(proc) == [10, 11]


def test_explicit_cores_reach_vllm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(placement.CPU_BIND_ENV, raising=False)
    place_engine((1,), None, ranks=1, on_cpu=True)
    assert placement.os.environ[placement.CPU_BIND_ENV] == "1"


def test_gpu_devices_reach_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(placement.DEVICES_ENV, raising=False)
    place_engine((), "2,3", ranks=1, on_cpu=False)
    assert placement.os.environ[placement.DEVICES_ENV] == "2,3"


@pytest.mark.parametrize("others", [[], [4242]])
def test_automatic_binding_warns_beside_another_engine(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, others: list[int]
) -> None:
    monkeypatch.delenv(placement.CPU_BIND_ENV, raising=False)
    monkeypatch.setattr(placement, "other_engines", lambda: others)
    with caplog.at_level(logging.INFO, logger=placement.__name__):
        place_engine((), None, ranks=1, on_cpu=True)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == len(others)
    if others:
        assert "4242" in warnings[0].getMessage() and "--cpu-cores" in warnings[0].getMessage()


def fake_stat(root: Path, pid: int, name: str, ppid: int) -> None:
    (root / str(pid)).mkdir()
    (root / str(pid) / "stat").write_text(f"{pid} ({name}) S {ppid} {pid} {pid} 0 -1\n")


def test_an_engines_processes_are_found_beneath_its_server(tmp_path: Path) -> None:
    fake_stat(tmp_path, 100, "python", 1)
    fake_stat(tmp_path, 101, "VLLM::EngineCor", 100)
    fake_stat(tmp_path, 102, "VLLM::Worker", 101)
    fake_stat(tmp_path, 103, "a (odd) name", 102)
    fake_stat(tmp_path, 200, "VLLM::Worker", 1)  # another server's
    assert placement.children_by_name(100, tmp_path) == {
        "VLLM::EngineCor": [101],
        "VLLM::Worker": [102],
        "a (odd) name": [103],
    }


NAMED_SLEEPER = (
    "import os, sys, time; open('/proc/self/comm', 'w').write(sys.argv[1]); "
    "cores = sys.argv[2]; cores and os.sched_setaffinity(0, {int(c) for c in cores.split(',')}); "
    "print(flush=True); time.sleep(60)"
)


@pytest.fixture
def fake_engine() -> Iterator[Callable[[str, str], int]]:
    """Child processes that name themselves as the engine's do, bound to the given cores."""
    started: list[subprocess.Popen[str]] = []

    def start(name: str, cores: str) -> int:
        process = subprocess.Popen(
            [sys.executable, "-c", NAMED_SLEEPER, name, cores], stdout=subprocess.PIPE, text=True
        )
        started.append(process)
        assert process.stdout is not None and process.stdout.readline() == "\n"
        return process.pid

    yield start
    for process in started:
        process.kill()
        process.wait()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_the_engine_core_moves_onto_its_workers_cores(
    fake_engine: Callable[[str, str], int],
) -> None:
    worker_core = min(os.sched_getaffinity(0))
    core_pid = fake_engine("VLLM::EngineCor", "")
    fake_engine("VLLM::Worker", str(worker_core))
    placement.confine_engine_core()
    assert os.sched_getaffinity(core_pid) == {worker_core}


def test_the_engine_core_stays_put_when_its_worker_is_not_bound(
    fake_engine: Callable[[str, str], int],
) -> None:
    core_pid = fake_engine("VLLM::EngineCor", "")
    fake_engine("VLLM::Worker", "")
    placement.confine_engine_core()
    assert os.sched_getaffinity(core_pid) == os.sched_getaffinity(0)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores")
def test_an_engine_core_running_its_worker_is_left_on_its_cores_and_said_so(
    fake_engine: Callable[[str, str], int], caplog: pytest.LogCaptureFixture
) -> None:
    core = min(os.sched_getaffinity(0))
    core_pid = fake_engine("VLLM::EngineCor", str(core))
    with caplog.at_level(logging.INFO, logger=placement.__name__):
        placement.confine_engine_core()
    assert os.sched_getaffinity(core_pid) == {core}
    assert f"engine core (pid {core_pid}) runs its worker, on cores {core}" in caplog.text
