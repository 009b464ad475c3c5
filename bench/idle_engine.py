"""What a replica costs while it waits for calls: a replica of the embedded model with `make
serve`'s settings and `vllm serve` on the same model with its defaults, each on a core of its
own, each after one call, then left idle. Reports the CPU every process of each used over the
idle minute, by thread name (vLLM's worker sets up 13 gloo process groups for one rank, each with
a loop thread that wakes every 10 ms unless given timer slack: service/model/gloo_timer_slack.py),
and the ratio of the two servers' totals, measured in the same run.

Usage: python -m bench.idle_engine [--seconds 60] [--rounds 2]   (about 3 minutes)
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import psutil

from bench.adapter_root_cost import CALLS, median_latency, replica_process
from bench.servers import VllmOpenAIServer
from service.model.default_model import DEFAULT_SERVED_MODEL_NAME, prepare_default_model

SETTLE_SECONDS = 5.0  # past vLLM's one second of polling after a call
TICK = os.sysconf("SC_CLK_TCK")


def thread_seconds(pid: int) -> Counter[str]:
    """CPU-seconds of each thread of a process, by thread name."""
    seconds: Counter[str] = Counter()
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        seconds[name] += (int(fields[11]) + int(fields[12])) / TICK
    return seconds


def tree_seconds(pid: int) -> Counter[str]:
    """CPU-seconds of a process and those below it, by "process: thread" name."""
    seconds: Counter[str] = Counter()
    root = psutil.Process(pid)
    for process in [root, *root.children(recursive=True)]:
        for thread, used in thread_seconds(process.pid).items():
            seconds[f"{process.name()}: {thread}"] += used
    return seconds


@contextmanager
def vllm_serve(core: int) -> Iterator[int]:
    server = VllmOpenAIServer(prepare_default_model(), DEFAULT_SERVED_MODEL_NAME, cores=str(core))
    try:
        server.wait_ready()
        httpx.post(
            f"{server.base_url}/v1/completions",
            json={"model": DEFAULT_SERVED_MODEL_NAME, "prompt": "Hi", "max_tokens": 4},
            timeout=120,
        ).raise_for_status()
        yield server.process.pid
    finally:
        server.stop()


def idle_use(pids: dict[str, int], seconds: float) -> dict[str, Counter[str]]:
    """Each server's CPU over `seconds` of idleness, by process and thread name."""
    time.sleep(SETTLE_SECONDS)
    before = {name: tree_seconds(pid) for name, pid in pids.items()}
    time.sleep(seconds)
    after = {name: tree_seconds(pid) for name, pid in pids.items()}
    return {name: after[name] - before[name] for name in pids}


def report(use: dict[str, Counter[str]], seconds: float, number: int) -> None:
    totals = {name: sum(threads.values()) for name, threads in use.items()}
    ours, theirs = totals["ours"], totals["vllm serve"]
    print(f"\nround {number}: {seconds:.0f} s idle")
    print("| server | process: thread | CPU-s |")
    print("|---|---|---|")
    for name, threads in use.items():
        for thread, used in threads.most_common(6):
            print(f"| {name} | {thread} | {used:.2f} |")
        share = totals[name] / seconds
        print(f"| {name} | **all** | **{totals[name]:.2f}** ({share:.1%} of a core) |")
    print(f"ratio ours / vllm serve: {ours / theirs:.2f}x" if theirs else "vllm serve used none")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    with ExitStack() as stack:
        target, ours = stack.enter_context(replica_process(0, []))
        median_latency(target, next(iter(CALLS.values())), 1)
        theirs = stack.enter_context(vllm_serve(1))
        for number in range(1, args.rounds + 1):
            use = idle_use({"ours": ours, "vllm serve": theirs}, args.seconds)
            report(use, args.seconds, number)


if __name__ == "__main__":
    main()
