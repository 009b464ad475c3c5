"""Where a pytest session's CPU goes, by test: load it as a plugin (`-p bench.test_cpu`) and the
session's summary lists the tests and the modules that cost the most CPU, counted over the
pytest process and every process below it (engines, Envoys, pickers started by fixtures), with
pytest's own share and each test's wall time beside it. A shared engine's start-up counts
against the test that first needs it (or the tests that run while it starts in the background).

The processes are sampled each `INTERVAL` seconds and at each test's start and end, and each
sample's CPU is charged to the test running then (as bench.suite_cpu does for the whole host): a
process's last interval before it exits is lost, and so is a process that lives less than one.

Usage: python -m tests.shards -p bench.test_cpu (each shard reports its own), or
python -m pytest -p bench.test_cpu tests/test_x.py; BENCH_TEST_CPU_TOP sets how many tests.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil
import pytest

TOP = int(os.environ.get("BENCH_TEST_CPU_TOP", "40"))
INTERVAL = 0.5
OUTSIDE_TESTS = "(between tests: collection, shared engines stopping)"


def cpu_seconds(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


@dataclass
class TreeSampler:
    """CPU of this process and its descendants, charged to whatever `current` names."""

    current: str = OUTSIDE_TESTS
    charged: Counter[str] = field(default_factory=Counter)
    seen: dict[tuple[int, float], float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    done: threading.Event = field(default_factory=threading.Event)

    def sample(self) -> None:
        here = psutil.Process()
        with self.lock:
            for process in [here, *here.children(recursive=True)]:
                try:
                    key = (process.pid, process.create_time())
                    seconds = cpu_seconds(process)
                except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
                    continue
                self.charged[self.current] += seconds - self.seen.get(key, 0.0)
                self.seen[key] = seconds

    def switch_to(self, name: str) -> None:
        self.sample()
        self.current = name

    def run(self) -> None:
        while not self.done.wait(INTERVAL):
            self.sample()


@dataclass(frozen=True)
class Cost:
    cpu: float  # the whole tree's
    own: float  # pytest's own
    wall: float


@dataclass
class TestCpu:
    sampler: TreeSampler = field(default_factory=TreeSampler)
    by_test: dict[str, Cost] = field(default_factory=dict)

    def __post_init__(self) -> None:
        threading.Thread(target=self.sampler.run, name="test-cpu", daemon=True).start()

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        own, wall = cpu_seconds(psutil.Process()), time.monotonic()
        self.sampler.switch_to(item.nodeid)
        yield
        self.sampler.switch_to(OUTSIDE_TESTS)
        self.by_test[item.nodeid] = Cost(
            self.sampler.charged[item.nodeid],
            cpu_seconds(psutil.Process()) - own,
            time.monotonic() - wall,
        )

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        self.sampler.sample()
        write = terminalreporter.write_line
        total = sum(self.sampler.charged.values())
        outside = self.sampler.charged[OUTSIDE_TESTS]
        write(f"CPU by test (bench.test_cpu): {total / 60:.1f} CPU-minutes in the session,")
        write(f"  {outside:.0f} CPU-s of them {OUTSIDE_TESTS}")
        write(f"  {'CPU-s':>7} {'pytest':>7} {'wall s':>7}")
        ranked = sorted(self.by_test.items(), key=lambda entry: -entry[1].cpu)
        for test_id, cost in ranked[:TOP]:
            write(f"  {cost.cpu:7.1f} {cost.own:7.1f} {cost.wall:7.1f}  {test_id}")
        by_module: dict[str, Counter[str]] = {}
        for test_id, cost in self.by_test.items():
            module = by_module.setdefault(test_id.split("::", 1)[0], Counter())
            module.update({"cpu": cost.cpu, "own": cost.own, "wall": cost.wall})
        write("CPU by module:")
        for name, module in sorted(by_module.items(), key=lambda entry: -entry[1]["cpu"]):
            write(f"  {module['cpu']:7.1f} {module['own']:7.1f} {module['wall']:7.1f}  {name}")


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(TestCpu(), "bench-test-cpu")
