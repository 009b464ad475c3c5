"""What callers that fall behind cost the replica: `STREAMS` concurrent gRPC streams on the
embedded model, read by callers that keep up, then by callers that stop reading for
`STOP_SECONDS` after their first message (with a small HTTP/2 window, so the replica's writes
wait for them), many engine steps at this concurrency. Reports
messages per output token and the replica's serving CPU per token (the server process,
without its engine core and worker) for both, and their ratio, measured in the same run.

Usage: python -m bench.slow_consumers [--rounds 2]   (2 rounds: about 3.5 minutes)
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import json_format
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateCompletionRequest

from bench.servers import cpu_seconds, wait_serving
from service.model.default_model import DEFAULT_SERVED_MODEL_NAME
from tests.processes import free_port

STREAMS = 64
TOKENS = 128
STOP_SECONDS = 10.0
SMALL_WINDOW = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 1024)]


@dataclass
class Load:
    messages: int = 0
    tokens: int = 0
    cpu: float = 0.0

    def row(self, name: str) -> str:
        per_token = self.cpu / self.tokens * 1000
        return f"| {name} | {self.messages / self.tokens:.2f} | {per_token:.3f} | {self.tokens} |"


def request() -> CreateCompletionRequest:
    fields = {
        "model": DEFAULT_SERVED_MODEL_NAME,
        "prompt": "Count:",
        "max_tokens": TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    return json_format.ParseDict(
        {**fields, "stream_options": {"include_usage": True}}, CreateCompletionRequest()
    )


async def one_stream(stub: Any, stop: float, load: Load) -> None:
    async for message in stub.CreateCompletion(request(), timeout=600):
        if message.choices:
            load.messages += 1
        if message.choices and stop:
            await asyncio.sleep(stop)  # behind, once: after the stream's first message
            stop = 0
        if message.HasField("usage"):
            load.tokens += message.usage.completion_tokens


async def streams(target: str, pause: float, load: Load) -> None:
    async with grpc.aio.insecure_channel(target, options=SMALL_WINDOW) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        await asyncio.gather(*(one_stream(stub, pause, load) for _ in range(STREAMS)))


def measure(target: str, server_pid: int, pause: float) -> Load:
    load = Load()
    before = cpu_seconds(server_pid)
    asyncio.run(streams(target, pause, load))
    load.cpu = cpu_seconds(server_pid) - before
    return load


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    rounds = parser.parse_args().rounds
    port = free_port()
    target = f"127.0.0.1:{port}"
    command = [sys.executable, "-m", "service", "serve", "--port", str(port)]
    server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_serving(target, server)
        measure(target, server.pid, 0)  # warm: the first calls pay for lazy set-ups
        print(f"{STREAMS} streams of {TOKENS} tokens; behind: {STOP_SECONDS:.0f}s after the first")
        print("| callers | messages per token | serving CPU ms per token | tokens |")
        print("|---|---|---|---|")
        for number in range(1, rounds + 1):
            kept_up = measure(target, server.pid, 0)
            behind = measure(target, server.pid, STOP_SECONDS)
            print(kept_up.row(f"keeping up, round {number}"))
            print(behind.row(f"behind, round {number}"))
            ratio = (behind.cpu / behind.tokens) / (kept_up.cpu / kept_up.tokens)
            print(f"| behind / keeping up, round {number} | | {ratio:.2f}x | |")
    finally:
        server.terminate()
        server.wait(timeout=60)


if __name__ == "__main__":
    main()
