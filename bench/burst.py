"""A burst at high concurrency on the path users run (`make bench-burst`): `make serve` against
`vllm serve`, both with their default capacity settings, 512 streamed clients at once on the
embedded model (bench/servers.py starts both as users start them, with the same model, context
length and KV cache).

Each round measures vLLM first (REST, with vLLM's own benchmark client), then our stack (REST
through Envoy with the same client, then gRPC with a grpc.aio client of the same shape), each
after a small warm-up. Reported per server: requests refused or failed (the target is none),
output throughput and p50/p99 time to first token, each of ours as a ratio to vLLM's in the same
round; and the engine's peak running and waiting gauges during the burst (the batch it ran and
the queue it held).

Usage: python -m bench.burst [--rounds N] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.grpc_client import run_load
from bench.run import MODEL, same_prompts, vllm_bench
from bench.servers import MakeServe, VllmServe, prioritize_load_clients
from bench.workloads import Workload
from service.model.default_model import prepare_default_model
from tests.metrics import GaugeWatch

BURST = Workload("burst", concurrency=512, num_prompts=512, input_len=64, output_len=16)
WARMUP = Workload("warmup", concurrency=4, num_prompts=8, input_len=16, output_len=8)
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")
SERVERS = ("vllm serve (REST)", "make serve (REST)", "make serve (gRPC)")
REPORTED = ("output_throughput", "median_ttft_ms", "p99_ttft_ms")


def measured(run: Callable[[], dict[str, Any]], metrics_url: str) -> dict[str, Any]:
    """The run's figures (refused counted as vLLM's client counts failed requests), with the
    engine's peak gauges while it ran."""
    with GaugeWatch(metrics_url, GAUGES) as watch:
        result = run()
    return {
        "refused": result["failed"],
        "completed": result["completed"],
        **{key: result[key] for key in REPORTED},
        "peak_running": watch.peaks["vllm:num_requests_running"],
        "peak_waiting": watch.peaks["vllm:num_requests_waiting"],
    }


def one_round(model_dir: Path, logs: Path, index: int) -> dict[str, dict[str, Any]]:
    results: dict[str, dict[str, Any]] = {}
    vllm = VllmServe(model_dir, MODEL)
    try:
        vllm.wait_ready()
        vllm_bench(vllm.base_url, "/v1/completions", model_dir, WARMUP)
        results[SERVERS[0]] = measured(
            lambda: vllm_bench(vllm.base_url, "/v1/completions", model_dir, BURST),
            f"{vllm.base_url}/metrics",
        )
    finally:
        vllm.stop()
    ours = MakeServe(model_dir, MODEL, log_path=logs / f"make-serve-{index}.log")
    try:
        ours.wait_ready()
        vllm_bench(ours.base_url, "/v2/completions", model_dir, WARMUP)
        results[SERVERS[1]] = measured(
            lambda: vllm_bench(ours.base_url, "/v2/completions", model_dir, BURST),
            ours.metrics_url,
        )
        prompts = same_prompts(model_dir, BURST)
        results[SERVERS[2]] = measured(
            lambda: asyncio.run(
                run_load(ours.grpc_target, MODEL, prompts, BURST.output_len, BURST.concurrency)
            ),
            ours.metrics_url,
        )
    finally:
        ours.stop()
    return results


def ratios(round_results: dict[str, dict[str, Any]]) -> dict[str, dict[str, float]]:
    peer = round_results[SERVERS[0]]
    return {
        server: {key: round_results[server][key] / peer[key] for key in REPORTED}
        for server in SERVERS[1:]
    }


def summarize(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, Any]:
    per_round = [ratios(results) for results in rounds]
    return {
        "refused": {server: [r[server]["refused"] for r in rounds] for server in SERVERS},
        "median_ratios": {
            server: {key: statistics.median(r[server][key] for r in per_round) for key in REPORTED}
            for server in SERVERS[1:]
        },
    }


def markdown(rounds: list[dict[str, dict[str, Any]]], summary: dict[str, Any]) -> str:
    w = BURST
    lines = [
        f"Burst: {w.concurrency} streamed clients at once, {w.input_len} tokens in / "
        f"{w.output_len} out, the embedded model; {len(rounds)} rounds, vllm serve first in "
        "each. Ratios are ours over vllm serve's in the same round.",
        "",
        "| round | server | refused | output tok/s | p50 TTFT ms | p99 TTFT ms | peak running | "
        "peak waiting |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for index, results in enumerate(rounds, 1):
        relative = ratios(results)
        for server in SERVERS:
            figures = results[server]
            cells = [
                f"{figures[key]:.1f}"
                + (f" ({relative[server][key]:.2f}x)" if server in relative else "")
                for key in REPORTED
            ]
            lines.append(
                f"| {index} | {server} | {figures['refused']} | " + " | ".join(cells) + " | "
                f"{figures['peak_running']:.0f} | {figures['peak_waiting']:.0f} |"
            )
    lines += ["", "Median ratios to vllm serve:", ""]
    for server, medians in summary["median_ratios"].items():
        shown = ", ".join(f"{key} {value:.2f}x" for key, value in medians.items())
        lines.append(f"- {server}: {shown}")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    options = parser.parse_args()
    print(f"bench-burst: {prioritize_load_clients()}", flush=True)
    model_dir = prepare_default_model()
    logs = Path(tempfile.mkdtemp(prefix="bench-burst-"))
    print(f"bench-burst: make serve's logs in {logs}", flush=True)
    rounds = []
    for index in range(1, options.rounds + 1):
        print(f"bench-burst: round {index} of {options.rounds}", flush=True)
        rounds.append(one_round(model_dir, logs, index))
    summary = summarize(rounds)
    (options.out / "burst.json").write_text(
        json.dumps({"workload": vars(BURST), "rounds": rounds, "summary": summary}, indent=2)
    )
    report = markdown(rounds, summary)
    (options.out / "burst.md").write_text(report)
    print(report, flush=True)


if __name__ == "__main__":
    main()
