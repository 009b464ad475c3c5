"""Where a command's CPU time goes on this host, by kind of process: run the test suite (or any
command) under it to see what a shorter suite has to cut. Every process that starts while the
command runs is sampled from /proc each `--interval` seconds and its CPU time added to its kind
at that moment; an engine process counts as "engine process, importing" until vLLM renames it
(its first seconds: importing torch and vLLM). A process's last interval before it exits is
lost (at most `--interval` seconds each). Also reports the host's idle share over the run.

Usage: python -m bench.suite_cpu [--interval 1] -- python -m tests.shards
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
TICKS_PER_SECOND = os.sysconf("SC_CLK_TCK")
# Kinds by what a process's command line contains, first match wins (after vLLM's own names).
KINDS_BY_COMMAND = (
    ("multiprocessing.spawn", "engine process, importing"),
    ("facade.picker", "replica picker"),
    ("facade.launch", "Envoy's launcher"),
    ("vllm.entrypoints", "vLLM's own server"),
    ("-m service", "our server (and its frontends)"),
    ("bin/llm-completions", "our server (and its frontends)"),
    ("pytest", "pytest"),
    ("tests.shards", "pytest"),
    ("-m pip", "pip"),
    ("bin/pip", "pip"),
)


def kind_of(comm: str, command: str) -> str:
    if comm.startswith("VLLM::"):
        return {"VLLM::Worker": "engine worker", "VLLM::EngineCor": "engine core"}.get(
            comm, "our frontend processes"
        )
    if comm == "envoy":
        return "Envoy"
    return next((kind for part, kind in KINDS_BY_COMMAND if part in command), f"other ({comm})")


def read_process(pid: str) -> tuple[str, int] | None:
    """A process's kind and CPU ticks so far, or None if it is gone."""
    try:
        comm = (PROC / pid / "comm").read_text().strip()
        command = (
            (PROC / pid / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        )
        fields = (PROC / pid / "stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return kind_of(comm, command), int(fields[11]) + int(fields[12])


def host_ticks() -> tuple[int, int]:
    """The host's (busy, idle) ticks so far, over every core."""
    values = [int(v) for v in (PROC / "stat").read_text().splitlines()[0].split()[1:]]
    idle = values[3] + values[4]  # idle and iowait
    return sum(values) - idle, idle


@dataclass
class Sampler:
    """CPU ticks by kind, of processes that started after it did."""

    seen: dict[str, int] = field(default_factory=dict)  # pid -> ticks counted so far
    by_kind: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        self.before = {pid for pid in os.listdir(PROC) if pid.isdigit()}

    def sample(self) -> None:
        for pid in os.listdir(PROC):
            if not pid.isdigit() or pid in self.before or (found := read_process(pid)) is None:
                continue
            kind, ticks = found
            self.by_kind[kind] += ticks - self.seen.get(pid, 0)
            self.seen[pid] = ticks


def report(sampler: Sampler, seconds: float, busy: int, idle: int) -> str:
    total = sum(sampler.by_kind.values()) or 1
    lines = [f"CPU by kind of process over {seconds / 60:.1f} minutes (bench.suite_cpu):"]
    for kind, ticks in sampler.by_kind.most_common(12):
        lines.append(f"  {ticks / TICKS_PER_SECOND:8.0f} s  {ticks / total:6.1%}  {kind}")
    lines.append(
        f"  total {total / TICKS_PER_SECOND / 60:.1f} CPU-minutes; the host was idle "
        f"{idle / max(busy + idle, 1):.0%} of its {os.cpu_count()} cores' time"
    )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--interval", type=float, default=1.0, help="seconds between samples")
    parser.add_argument("command", nargs="+", help="the command to run, after --")
    args = parser.parse_args(argv)
    sampler = Sampler()
    busy_before, idle_before = host_ticks()
    started = time.monotonic()
    command = subprocess.Popen(args.command)
    while command.poll() is None:
        sampler.sample()
        time.sleep(args.interval)
    busy, idle = host_ticks()
    seconds = time.monotonic() - started
    print(report(sampler, seconds, busy - busy_before, idle - idle_before), flush=True)
    return command.returncode


if __name__ == "__main__":
    sys.exit(main())
