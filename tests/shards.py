"""The real-process suite in shards that run side by side: `python -m tests.shards [pytest
options]` runs each shard as its own pytest session, at the same time, prints their output
line by line under the shard's name, and exits non-zero if any shard failed.

Most of a run waits (on engine start-ups, streams, drains and timeouts) rather than computes,
so two sessions side by side finish in far less than one after the other. The shards split
the modules so that no engine is started by two of them: the shared engines (tests/engines.py)
all belong to the "shared" shard, and the "own" shard holds the modules that start, stop or
kill engines of their own. conftest.py refuses a shared engine in a shard that does not own
it (TEST_SHARD names the shard a session runs)."""

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

# Modules that use no shared engine: each starts what it needs (or nothing) and stops it.
OWN_MODULES = (
    "test_cli.py",
    "test_deploy.py",
    "test_engine_lifetime.py",
    "test_generated_code.py",
    "test_gpu_pins.py",
    "test_image_runtime.py",
    "test_multi_replica.py",
    "test_profile_summary.py",
    "test_proto_lint.py",
    "test_tls.py",
)
# The shards' engine cores: vLLM's CPU build binds its worker to core 0 when not told, so the
# "own" shard's engines are put on the other core (where there is one) unless a test places
# them itself.
OWN_SHARD_CORE = "1"


def real_modules() -> list[str]:
    return sorted(path.name for path in TESTS.glob("test_*.py"))


def shard_modules() -> dict[str, list[str]]:
    """Each shard's modules: "own" those listed, "shared" every other real-process module."""
    modules = real_modules()
    return {
        "shared": [m for m in modules if m not in OWN_MODULES],
        "own": [m for m in modules if m in OWN_MODULES],
    }


def shard_environment(shard: str) -> dict[str, str]:
    environment = {**os.environ, SHARD_ENV: shard}
    if shard == "own" and (os.cpu_count() or 1) > 1:
        environment.setdefault("VLLM_CPU_OMP_THREADS_BIND", OWN_SHARD_CORE)
    return environment


def may_start_shared_engines(shard: str | None) -> bool:
    """Whether a session running `shard` (None: not sharded) may start the shared engines."""
    return shard in (None, "shared")


def relay(shard: str, lines: Iterable[str], started: float) -> None:
    """Prints a shard's output under its name, and when it ended."""
    for line in lines:
        sys.stdout.write(f"[{shard}] {line}")
        sys.stdout.flush()
    print(f"[{shard}] ended after {(time.monotonic() - started) / 60:.1f} minutes", flush=True)


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
    return max(codes.values())


if __name__ == "__main__":
    sys.exit(run_shards(sys.argv[1:]))
