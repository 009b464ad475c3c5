"""Batch jobs, measured: a job of chat lines on an otherwise idle replica with `make serve`'s
settings against `vllm run-batch` on the same lines and engine flags (generated tokens a
second, the engine's start-up left out of both), and the time to first token of a steady
interactive client on that replica beside a running job against the same client on the idle
replica. Both servers run on the embedded model, one after the other, on the whole host.

Usage: python -m bench.batch [--lines 2000] [--tokens 32] [--rounds 1]   (about 20 minutes)
Results: bench/results/batch.md
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.servers import MAKE_SERVE_ENV, MakeServe
from service.model.default_model import DEFAULT_SERVED_MODEL_NAME, prepare_default_model

RESULTS = Path(__file__).resolve().parent / "results" / "batch.md"
INTERACTIVE_TOKENS = 16
INTERACTIVE_GAP_SECONDS = 0.5
INTERACTIVE_CALLS = 40
POLL_SECONDS = 0.5


def chat_lines(count: int, tokens: int) -> list[dict[str, Any]]:
    return [
        {
            "messages": [{"role": "user", "content": f"Write a sentence about topic {i}."}],
            "max_completion_tokens": tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        for i in range(count)
    ]


def run_batch_seconds(model_dir: Path, lines: list[dict[str, Any]], scratch: Path) -> float:
    """`vllm run-batch` on the lines: its wall time, start-up included."""
    source, output = scratch / "run-batch-in.jsonl", scratch / "run-batch-out.jsonl"
    with source.open("w") as file:
        for index, line in enumerate(lines):
            body = {"model": DEFAULT_SERVED_MODEL_NAME, **line}
            request = {"custom_id": str(index), "method": "POST", "url": "/v1/chat/completions"}
            file.write(json.dumps({**request, "body": body}) + "\n")
    command = [
        *(sys.executable, "-m", "vllm.entrypoints.openai.run_batch"),
        *("-i", str(source), "-o", str(output)),
        *("--model", str(model_dir), "--served-model-name", DEFAULT_SERVED_MODEL_NAME),
        *("--dtype", "float32", "--enforce-eager", "--no-enable-prefix-caching"),
        *("--max-model-len", MAKE_SERVE_ENV["MAX_MODEL_LEN"]),
    ]
    environment = {"VLLM_CPU_KVCACHE_SPACE": MAKE_SERVE_ENV["KV_CACHE_GIB"]}
    started = time.monotonic()
    subprocess.run(
        command,
        check=True,
        env={**os.environ, **environment},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    return time.monotonic() - started


def vllm_tokens_per_second(model_dir: Path, lines: list[dict[str, Any]], tokens: int) -> float:
    """Generated tokens a second of `vllm run-batch`: its time for the lines less its time for
    one line (its start-up and teardown)."""
    with tempfile.TemporaryDirectory() as scratch:
        whole = run_batch_seconds(model_dir, lines, Path(scratch))
        alone = run_batch_seconds(model_dir, lines[:1], Path(scratch))
    return (len(lines) - 1) * tokens / (whole - alone)


def job_seconds(client: httpx.Client, lines: list[dict[str, Any]]) -> float:
    """A job of the lines on our replica, from its create call to its end."""
    body = {
        "model_config": {"model": DEFAULT_SERVED_MODEL_NAME},
        "content": lines,
        "output_data_path": f"bench-{time.time_ns()}.json",
    }
    started = time.monotonic()
    job = client.post("/v2/batch-completions", json=body, timeout=600).json()
    while job["status"] not in ("completed", "failed", "cancelled"):
        time.sleep(POLL_SECONDS)
        job = client.get(f"/v2/batch-completions/{job['job_id']}").json()["job"]
    assert job["status"] == "completed", job
    return time.monotonic() - started


def first_token_seconds(client: httpx.Client, calls: int) -> list[float]:
    """A steady interactive client: one streamed chat call every INTERACTIVE_GAP_SECONDS."""
    measured = []
    body = {
        "model": DEFAULT_SERVED_MODEL_NAME,
        "messages": [{"role": "user", "content": "Name a colour."}],
        "max_completion_tokens": INTERACTIVE_TOKENS,
        "stream": True,
    }
    for _ in range(calls):
        started = time.monotonic()
        first: float | None = None
        with client.stream("POST", "/v2/chat/completions", json=body, timeout=120) as response:
            for line in response.iter_lines():
                if first is None and line.startswith("data: ") and '"content"' in line:
                    first = time.monotonic() - started
        assert first is not None, "the stream had no content"
        measured.append(first)
        time.sleep(INTERACTIVE_GAP_SECONDS)
    return measured


def ours(model_dir: Path, lines: list[dict[str, Any]], tokens: int) -> dict[str, float]:
    with tempfile.TemporaryDirectory() as root:
        server = MakeServe(model_dir, DEFAULT_SERVED_MODEL_NAME, env={"BATCH_ROOT": root})
        try:
            server.wait_ready()
            with httpx.Client(base_url=server.base_url, timeout=120) as client:
                idle = first_token_seconds(client, INTERACTIVE_CALLS)
                throughput = len(lines) * tokens / job_seconds(client, lines)
                beside: list[float] = []
                running = threading.Thread(target=job_seconds, args=(client, lines))
                running.start()
                time.sleep(5)  # the job's window fills
                beside = first_token_seconds(client, INTERACTIVE_CALLS)
                running.join()
        finally:
            server.stop()
    return {
        "tokens_per_second": throughput,
        "ttft_idle": statistics.median(idle),
        "ttft_beside_batch": statistics.median(beside),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=2000)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=1)
    args = parser.parse_args()
    model_dir = prepare_default_model()
    lines = chat_lines(args.lines, args.tokens)
    rows = []
    for round_ in range(1, args.rounds + 1):
        mine = ours(model_dir, lines, args.tokens)
        theirs = vllm_tokens_per_second(model_dir, lines, args.tokens)
        rows.append(
            f"| {round_} | {mine['tokens_per_second']:.1f} | {theirs:.1f} | "
            f"{mine['tokens_per_second'] / theirs:.2f}x | {mine['ttft_idle'] * 1000:.0f} | "
            f"{mine['ttft_beside_batch'] * 1000:.0f} | "
            f"{mine['ttft_beside_batch'] / mine['ttft_idle']:.2f}x |"
        )
        print(rows[-1], flush=True)
    RESULTS.write_text(
        "\n".join(
            [
                "# Batch jobs against vllm run-batch",
                "",
                f"`python -m bench.batch --lines {args.lines} --tokens {args.tokens} --rounds "
                f"{args.rounds}`, {time.strftime('%Y-%m-%d')}: {args.lines} chat lines of "
                f"{args.tokens} generated tokens each, the embedded model, `make serve`'s "
                "settings and `vllm run-batch` with the same engine flags, one after the other.",
                "",
                "| round | ours, tokens/s | run-batch, tokens/s | ratio | TTFT idle, ms "
                "| TTFT beside the job, ms | ratio |",
                "|---|---|---|---|---|---|---|",
                *rows,
                "",
            ]
        )
    )


if __name__ == "__main__":
    main()
