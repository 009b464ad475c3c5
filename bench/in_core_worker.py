"""The worker inside the engine core against vLLM's CPU arrangement (a worker process of its
own): start-up and decoding cost, on the service's own engine path (`start_engine`).

Each round starts the engine in each arrangement, one after the other (their order alternating
between rounds), each in a fresh process whose engine is bound to the same cores (`--cores`,
default the last core): "vllm" keeps vLLM's arrangement (`--distributed-executor-backend mp`),
"in-core" runs the worker in a spawned engine core, "standby" in an engine core that is a copy
of the process forked after its imports, as the server does (service/model/standby_core.py).
Measured per start: seconds and CPU-seconds (the process and every child) from the process's
start to a ready engine; then, greedy decoding of 128 tokens for 1 and for 4 calls at once: wall
and CPU time a step. Figures are reported as ratios to the first arrangement named in the same
round, and the medians over rounds.

Usage: python -m bench.in_core_worker [--rounds N] [--cores C[,C...]] [--tokens N]
       [--arrangements vllm,in-core | in-core,standby | ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

import psutil

# The executor backend each is asked for; "standby" runs its engine core in a forked copy.
ARRANGEMENTS = {"vllm": "mp", "in-core": None, "standby": None}
BATCHES = (1, 4)
PROMPT = "The capital of France is"


def process_cpu_seconds() -> float:
    """CPU time of this process and every process beneath it (alive now)."""
    me = psutil.Process()
    total = 0.0
    for process in [me, *me.children(recursive=True)]:
        try:
            times = process.cpu_times()
        except psutil.Error:
            continue
        total += times.user + times.system
    return total


def started_at() -> float:
    """This process's start, on the monotonic clock (its imports count as start-up)."""
    ticks = os.sysconf("SC_CLK_TCK")
    with open("/proc/self/stat") as stat:
        start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as uptime:
        since_boot = float(uptime.read().split()[0])
    return time.monotonic() - (since_boot - start_ticks / ticks)


async def decode(engine: Any, batch: int, tokens: int) -> tuple[float, float]:
    """Wall and CPU seconds a step for `batch` greedy calls of `tokens` tokens at once."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)

    async def one(index: int) -> None:
        async for _ in engine.generate(PROMPT, params, request_id=f"b{batch}-{index}"):
            pass

    cpu, wall = process_cpu_seconds(), time.monotonic()
    await asyncio.gather(*(one(index) for index in range(batch)))
    return (time.monotonic() - wall) / tokens, (process_cpu_seconds() - cpu) / tokens


def measure_one(arrangement: str, cores: tuple[int, ...], tokens: int) -> dict[str, Any]:
    """In this process: start the service's engine in `arrangement` and measure it."""
    from service.model.standby_core import (
        ENGINE_CORE_MODULES,
        stand_by,
        torch_loaded_single_threaded,
    )

    began = started_at()
    with torch_loaded_single_threaded():
        from service.model.engine import start_engine
        from service.settings import EngineSettings

    copies = stand_by(int(arrangement == "standby"), ENGINE_CORE_MODULES)
    standby = copies[0] if copies else None
    settings = EngineSettings(
        model=None,
        served_model_name="default",
        cpu_cores=cores,
        distributed_executor_backend=ARRANGEMENTS[arrangement],
    )
    served = start_engine(settings, standby=standby)
    result: dict[str, Any] = {
        "ready_s": time.monotonic() - began,
        "ready_cpu_s": process_cpu_seconds(),
        "processes": sorted(p.name() for p in psutil.Process().children(recursive=True)),
    }

    async def steps() -> None:
        await decode(served.engine, 1, 4)  # warm
        for batch in BATCHES:
            wall, cpu = await decode(served.engine, batch, tokens)
            result[f"step_ms_b{batch}"] = wall * 1000
            result[f"step_cpu_ms_b{batch}"] = cpu * 1000

    asyncio.run(steps())
    served.engine.shutdown()
    return result


def run_one(arrangement: str, cores: str, tokens: int) -> dict[str, Any]:
    command = [sys.executable, "-m", "bench.in_core_worker", "--one", arrangement]
    command += ["--cores", cores, "--tokens", str(tokens)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or not lines:
        raise SystemExit(f"{arrangement} failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(lines[-1])


def report(rounds: list[dict[str, dict[str, Any]]], names: list[str]) -> None:
    keys = ["ready_s", "ready_cpu_s"]
    keys += [f"step{kind}_b{batch}" for batch in BATCHES for kind in ("_ms", "_cpu_ms")]
    baseline = names[0]
    print("| figure | " + " | ".join(f"round {i + 1}" for i in range(len(rounds))) + " | median |")
    print("|---" * (len(rounds) + 2) + "|")
    for name in names[1:]:
        for key in keys:
            cells = [f"{r[name][key]:.1f} / {r[baseline][key]:.1f}" for r in rounds]
            ratio = statistics.median(r[name][key] / r[baseline][key] for r in rounds)
            print(f"| {key} ({name} / {baseline}) | {' | '.join(cells)} | {ratio:.2f}x |")
    for name in names:
        print(f"{name}: processes {rounds[0][name]['processes']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cores", default=str(max(os.sched_getaffinity(0))), help="the engine's, e.g. 1 or 0,1"
    )
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--arrangements", default="vllm,in-core", help="the first is the baseline")
    parser.add_argument("--one", choices=sorted(ARRANGEMENTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        cores = tuple(int(core) for core in args.cores.split(","))
        print(json.dumps(measure_one(args.one, cores, args.tokens)), flush=True)
        return
    names = args.arrangements.split(",")
    if unknown := set(names) - set(ARRANGEMENTS):
        parser.error(f"unknown arrangements {sorted(unknown)}; known: {sorted(ARRANGEMENTS)}")
    rounds = []
    for index in range(args.rounds):
        order = names if index % 2 == 0 else list(reversed(names))
        measured = {name: run_one(name, args.cores, args.tokens) for name in order}
        print(f"round {index + 1}: {json.dumps(measured)}", file=sys.stderr, flush=True)
        rounds.append(measured)
    report(rounds, names)


if __name__ == "__main__":
    main()
