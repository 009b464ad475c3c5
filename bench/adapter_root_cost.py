"""What serving adapters costs the base model's calls on vLLM's CPU build: two replicas of the
embedded model with `make serve`'s settings, each on a core of its own, one of them also given
an (empty) adapter root, which enables LoRA and, on the CPU build, runs base-model calls
through the all-zero stand-in adapter (docs/operating/adapters.md). The same base-model calls
go to each in turn, one at a time: a decode-bound call (a short prompt, `DECODE_TOKENS`
tokens) and a prefill-bound one (a `PREFILL_WORDS`-word prompt, one token). Reports each
replica's median latency and their ratio, measured in the same run.

Usage: python -m bench.adapter_root_cost [--rounds 3] [--calls 5]   (about 2 minutes)
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import grpc
from google.protobuf import json_format
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateCompletionRequest

from bench.servers import wait_serving
from service.model.default_model import DEFAULT_SERVED_MODEL_NAME
from tests.processes import free_port

DECODE_TOKENS = 32
PREFILL_WORDS = 110
CALLS = {
    "decode (32 tokens)": {"prompt": "Count:", "max_tokens": DECODE_TOKENS, "ignore_eos": True},
    "prefill (110 words)": {"prompt": "information " * PREFILL_WORDS, "max_tokens": 1},
}


@contextmanager
def replica_process(core: int, extra: list[str]) -> Iterator[tuple[str, int]]:
    """A replica of the embedded model on `core`, serving until the block ends: its target and
    its server's pid."""
    port = free_port()
    command = [sys.executable, "-m", "service", "serve", "--port", str(port)]
    command += ["--cpu-cores", str(core), "--metrics-port", str(free_port()), *extra]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_serving(f"127.0.0.1:{port}", server)
        yield f"127.0.0.1:{port}", server.pid
    finally:
        server.terminate()
        server.wait(timeout=60)


@contextmanager
def replica(core: int, extra: list[str]) -> Iterator[str]:
    """A replica of the embedded model on `core`, serving until the block ends: its target."""
    with replica_process(core, extra) as (target, _):
        yield target


def latency(stub: completions_pb2_grpc.CompletionServiceStub, fields: dict[str, object]) -> float:
    request = json_format.ParseDict(
        {"model": DEFAULT_SERVED_MODEL_NAME, **fields}, CreateCompletionRequest()
    )
    started = time.monotonic()
    list(stub.CreateCompletion(request, timeout=120))
    return time.monotonic() - started


def median_latency(target: str, fields: dict[str, object], calls: int) -> float:
    with grpc.insecure_channel(target) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        latency(stub, fields)  # warm: the first call pays for lazy set-ups
        return statistics.median(latency(stub, fields) for _ in range(calls))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--calls", type=int, default=5)
    args = parser.parse_args()
    with ExitStack() as stack:
        root = stack.enter_context(tempfile.TemporaryDirectory(prefix="adapter-root-"))
        plain = stack.enter_context(replica(0, []))
        with_root = stack.enter_context(replica(1, ["--adapter-root", root]))
        print("| base-model call | round | plain (s) | with an adapter root (s) | ratio |")
        print("|---|---|---|---|---|")
        for number in range(1, args.rounds + 1):
            for name, fields in CALLS.items():
                alone = median_latency(plain, fields, args.calls)
                beside = median_latency(with_root, fields, args.calls)
                print(f"| {name} | {number} | {alone:.3f} | {beside:.3f} | {beside / alone:.2f}x |")


if __name__ == "__main__":
    main()
