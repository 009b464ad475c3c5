"""Where a pytest session's CPU goes, by test: load it as a plugin (`-p bench.test_cpu`) and
the session's summary lists the tests and the modules that cost the most CPU, counted over the
pytest process and every process below it (engines, Envoys, pickers started by fixtures),
with each test's wall time beside it. A shared engine's start-up counts against the first
test that needs it. A process re-parented away from the session (to PID 1) is lost from the
count from then on.

Usage: python -m tests.shards -p bench.test_cpu (each shard reports its own), or
python -m pytest -p bench.test_cpu tests/test_x.py; BENCH_TEST_CPU_TOP sets how many lines.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil
import pytest

TOP = int(os.environ.get("BENCH_TEST_CPU_TOP", "40"))


def own_cpu_seconds() -> float:
    """CPU used so far by the pytest process itself (its clients, parsers, polling)."""
    times = psutil.Process().cpu_times()
    return times.user + times.system


def tree_cpu_seconds() -> float:
    """CPU used so far by this process, its live descendants, and the children each has
    reaped."""
    total = 0.0
    here = psutil.Process()
    for process in [here, *here.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
        total += times.user + times.system + times.children_user + times.children_system
    return total


@dataclass(frozen=True)
class Cost:
    cpu: float  # the whole tree's
    own: float  # pytest's own
    wall: float


@dataclass
class TestCpu:
    by_test: dict[str, Cost] = field(default_factory=dict)
    session_start: float = field(default_factory=tree_cpu_seconds)

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item: pytest.Item) -> Iterator[None]:
        cpu, own, wall = tree_cpu_seconds(), own_cpu_seconds(), time.monotonic()
        yield
        self.by_test[item.nodeid] = Cost(
            tree_cpu_seconds() - cpu, own_cpu_seconds() - own, time.monotonic() - wall
        )

    def pytest_terminal_summary(self, terminalreporter: pytest.TerminalReporter) -> None:
        write = terminalreporter.write_line
        total = tree_cpu_seconds() - self.session_start
        write(f"CPU by test (bench.test_cpu): {total / 60:.1f} CPU-minutes in the session")
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
