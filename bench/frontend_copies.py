"""A replica's frontends as copies of its parent against spawned frontends: the start-up's time,
CPU and memory, on the path `--api-server-count` runs.

Each round starts a replica with `--frontends` frontends in each arrangement, one after the
other (their order alternating between rounds), each with the engine core a copy of the parent
as the server makes it: "copies" as the server starts its frontends (service/model/
standby_core.py), "spawned" with only the engine core's copy made, so that every frontend is a
new interpreter, as before. Measured per start: seconds from the launch until every frontend's
own port answers its health check SERVING, and the CPU-seconds and the proportional memory
(PSS, shared pages split between the processes that share them) of the replica's processes
then. Figures are reported as ratios of "copies" to "spawned" in the same round, and the
medians over rounds.

Usage: python -m bench.frontend_copies [--rounds N] [--frontends N]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from typing import Any

import psutil

from bench.servers import wait_serving
from tests.processes import free_port

ARRANGEMENTS = ("spawned", "copies")
ENGINE = ["--max-model-len", "512", "--kv-cache-gib", "0.25"]


def serve_with_spawned_frontends(argv: list[str]) -> None:
    """In the replica's process: the server, with copies for its engine core alone. The
    replica's module binds `stand_by` when imported, after the command line loads torch."""
    from service import cli
    from service.model import standby_core

    make_copies = standby_core.stand_by

    def engine_core_copy_only(copies: int, modules: tuple[str, ...] = ()) -> Any:
        return make_copies(min(copies, 1), modules)

    standby_core.stand_by = engine_core_copy_only  # type: ignore[assignment]
    cli.main(argv)


def tree_figures(pid: int) -> dict[str, float]:
    """CPU-seconds and PSS (MiB) of a process and every process beneath it."""
    root = psutil.Process(pid)
    cpu = pss = 0.0
    for process in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.Error):
            times = process.cpu_times()
            cpu += times.user + times.system
            pss += process.memory_full_info().pss / 2**20
    return {"ready_cpu_s": cpu, "pss_mib": pss}


def measure_one(arrangement: str, frontends: int) -> dict[str, float]:
    ports = [free_port() for _ in range(frontends + 1)]
    argv = ["--api-server-count", str(frontends), "--port", str(ports[0])]
    argv += ["--frontend-ports", ",".join(map(str, ports[1:])), *ENGINE]
    command = [sys.executable, "-m", "bench.frontend_copies", "--one", arrangement, "--"]
    began = time.monotonic()
    replica = subprocess.Popen(
        [*command, *argv], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    try:
        for port in ports[1:]:
            wait_serving(f"127.0.0.1:{port}", replica)
        figures = {"ready_s": time.monotonic() - began, **tree_figures(replica.pid)}
    finally:
        replica.send_signal(signal.SIGTERM)
        replica.wait(timeout=120)
    return figures


def report(rounds: list[dict[str, dict[str, float]]]) -> None:
    rounds_named = " | ".join(f"round {i + 1}" for i in range(len(rounds)))
    print(f"| copies / spawned | {rounds_named} | median |")
    print("|---" * (len(rounds) + 2) + "|")
    for key in ("ready_s", "ready_cpu_s", "pss_mib"):
        cells = [f"{r['copies'][key]:.1f} / {r['spawned'][key]:.1f}" for r in rounds]
        ratio = statistics.median(r["copies"][key] / r["spawned"][key] for r in rounds)
        print(f"| {key} | {' | '.join(cells)} | {ratio:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--frontends", type=int, default=2)
    parser.add_argument("--one", choices=ARRANGEMENTS, help=argparse.SUPPRESS)
    args, server_argv = parser.parse_known_args()
    if args.one == "spawned":
        serve_with_spawned_frontends([a for a in server_argv if a != "--"])
        return
    if args.one == "copies":
        from service import cli

        cli.main([a for a in server_argv if a != "--"])
        return
    rounds = []
    for index in range(args.rounds):
        order = ARRANGEMENTS if index % 2 == 0 else tuple(reversed(ARRANGEMENTS))
        measured = {name: measure_one(name, args.frontends) for name in order}
        print(f"round {index + 1}: {json.dumps(measured)}", file=sys.stderr, flush=True)
        rounds.append(measured)
    report(rounds)


if __name__ == "__main__":
    os.environ.setdefault("LOG_LEVEL", "WARNING")
    main()
