"""The real-process suite in shards that run side by side: `python -m tests.shards [pytest
options]` runs each shard as its own pytest session, at the same time, prints their output
line by line under the shard's name, and exits non-zero if any shard failed.

One session alone kept the 2-core host 40-80 % busy (it waits on streams, drains, keepalives
and timeouts as much as it computes); two side by side keep it busy and finish in about half
the time of one session. The shards split the modules so that no engine is started by two of
them: "stack" runs every module of the default stack, vLLM's servers and the adapter stack;
"fleet" the traced fleet's modules, the small engine's (which starts beside the fleet), and the
others that start, stop or kill engines of their own (the TLS stack's among them). conftest.py
refuses a shared engine to a shard that does not own it (TEST_SHARD names the shard a session
runs).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SHARD_ENV = "TEST_SHARD"

# The "fleet" shard's modules: the traced fleet's, and some of those that use no shared engine
# (each starts what it needs, or nothing, and stops it), as many as keep the two shards about
# equally long on a fresh machine, where the fleet shard also runs the image's install from
# nothing (tests/test_image_runtime.py, at the lowest priority). A working copy on 2026-12-06:
# stack 18.3, fleet 16.5 minutes before the TLS stack's module moved to "fleet"; fresh clones,
# later: stack 13.5, fleet 13.9 with the command line's and the manifests' modules (which start
# no engine) in "fleet"; they run in "stack" since. Every other module runs in "stack".
FLEET_MODULES = (
    "test_batch_resume.py",
    "test_capacity.py",
    "test_engine_death.py",
    "test_engine_lifetime.py",
    "test_fleet_adapters.py",
    "test_frontends.py",
    "test_generated_code.py",
    "test_gpu_pins.py",
    "test_image_runtime.py",
    "test_images.py",
    "test_multi_replica.py",
    "test_prefix_routing.py",
    "test_profile_summary.py",
    "test_proto_lint.py",
    "test_service_lifecycle.py",
    "test_tls.py",
    "test_tracing.py",
)
# The shared engines (tests/engines.py) each shard may start.
SHARD_ENGINES = {
    "stack": frozenset({"main", "vllm", "lora", "vllm-lora"}),
    "fleet": frozenset({"fleet", "small", "vlm", "vllm-vlm"}),
}
# Engines a test does not place float over the host's cores, one OpenMP thread each, instead
# of vLLM's automatic binding (the same core for every engine): each shard waits on streams,
# drains and timeouts for part of its run, and then the other shard's engines take the idle
# core. Each shard's engines pinned to a core of its own left the host idle 10 % of a run;
# floating, 6 % (a working copy on 2026-12-06, with the LoRA target modules of the same day).
FLOATING_ENGINES = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}


def real_modules() -> list[str]:
    return sorted(path.name for path in TESTS.glob("test_*.py"))


def shard_modules() -> dict[str, list[str]]:
    """Each shard's modules: "fleet" those listed, "stack" every other real-process module."""
    modules = real_modules()
    return {
        "stack": [m for m in modules if m not in FLEET_MODULES],
        "fleet": [m for m in modules if m in FLEET_MODULES],
    }


def shard_environment(shard: str) -> dict[str, str]:
    # Unbuffered: a shard's lines reach the relay as pytest writes them, not at its end.
    return {**FLOATING_ENGINES, **os.environ, SHARD_ENV: shard, "PYTHONUNBUFFERED": "1"}


def may_start(shard: str | None, engine: str) -> bool:
    """Whether a session running `shard` (None: not sharded) may start a shared engine."""
    return shard is None or engine in SHARD_ENGINES.get(shard, ())


def relay(shard: str, lines: Iterable[str], started: float) -> None:
    """Prints a shard's output under its name and the minutes since the run started (which
    module ran beside which), and when it ended."""
    for line in lines:
        sys.stdout.write(f"[{shard} {(time.monotonic() - started) / 60:4.1f}] {line}")
        sys.stdout.flush()
    print(f"[{shard}] ended after {(time.monotonic() - started) / 60:.1f} minutes", flush=True)


def overall_exit(codes: Iterable[int]) -> int:
    """The run's exit code: the first shard's failure (a shard killed by a signal counts as a
    failure, though its code is negative), or 0."""
    return next((code if code > 0 else 1 for code in codes if code != 0), 0)


def run_shards(pytest_args: list[str]) -> int:
    started = time.monotonic()
    running: dict[str, subprocess.Popen[str]] = {}
    relays = []
    for shard, modules in shard_modules().items():
        running[shard] = subprocess.Popen(
            [sys.executable, "-m", "pytest", *pytest_args, *(f"tests/{m}" for m in modules)],
            cwd=TESTS.parent,
            env=shard_environment(shard),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        output = running[shard].stdout
        assert output is not None
        relays.append(threading.Thread(target=relay, args=(shard, output, started)))
        relays[-1].start()
    codes = {shard: process.wait() for shard, process in running.items()}
    for thread in relays:
        thread.join()
    minutes = (time.monotonic() - started) / 60
    for shard, code in codes.items():
        print(f"shard {shard}: {'passed' if code == 0 else f'failed (exit {code})'}")
    print(f"real-process tests: {minutes:.1f} minutes, {len(codes)} shards side by side")
    return overall_exit(codes.values())


if __name__ == "__main__":
    sys.exit(run_shards(sys.argv[1:]))
