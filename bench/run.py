"""Run the benchmark: the same workloads against (a) `vllm serve` on /v1/completions, (b) our
REST through Envoy on /v2/completions and (c) our gRPC method, one server at a time, each
started as a user comparing them would (`make serve` with its environment variables, `vllm
serve` with the matching flags: bench/servers.py), plus the offline engine ceiling.

Usage: python -m bench.run [--quick] [--out bench/results]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.grpc_client import run_load
from bench.report import write_report
from bench.servers import MakeServe, PeakRss, VllmServe, prioritize_load_clients
from bench.workloads import FULL, QUICK, Workload
from service.model.default_model import DEFAULT_SERVED_MODEL_NAME, prepare_default_model

MODEL = DEFAULT_SERVED_MODEL_NAME


def vllm_bench(base_url: str, endpoint: str, model_dir: Path, workload: Workload) -> dict:
    """vLLM's own serving benchmark client against an OpenAI-compatible endpoint."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(
        [
            "--backend",
            "openai",
            "--base-url",
            base_url,
            "--endpoint",
            endpoint,
            "--model",
            MODEL,
            "--tokenizer",
            str(model_dir),
            "--dataset-name",
            "random",
            "--random-input-len",
            str(workload.input_len),
            "--random-output-len",
            str(workload.output_len),
            "--num-prompts",
            str(workload.num_prompts),
            "--max-concurrency",
            str(workload.concurrency),
            "--ignore-eos",
            "--seed",
            "0",
            "--percentile-metrics",
            "ttft,tpot,itl,e2el",
            "--metric-percentiles",
            "50,99",
            "--disable-tqdm",
        ]
    )
    return main(args)


def same_prompts(model_dir: Path, workload: Workload) -> list[str]:
    """The prompts vLLM's benchmark client sends for this workload (same dataset and seed)."""
    from vllm.benchmarks.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    requests = RandomDataset(random_seed=0).sample(
        get_tokenizer(str(model_dir)),
        workload.num_prompts,
        input_len=workload.input_len,
        output_len=workload.output_len,
    )
    return [str(request.prompt) for request in requests]


def measure(server: VllmServe | MakeServe, runs: dict[str, Any]) -> int:
    """Run each workload against the server; the server's peak RSS over all of them."""
    sampler = PeakRss(server.pids)
    sampler.start()
    for name, run in runs.items():
        print(f"bench: {name}", flush=True)
        run()
    return sampler.stop()


def offline_ceiling(model_dir: Path, workload: Workload) -> float:
    """Offline LLM.generate throughput on the same requests, in a process of its own."""
    with tempfile.TemporaryDirectory() as scratch:
        result = Path(scratch) / "offline.json"
        subprocess.run(
            [
                sys.executable,
                "-m",
                "bench.offline",
                str(model_dir),
                str(workload.input_len),
                str(workload.output_len),
                str(workload.num_prompts),
                str(workload.concurrency),
                str(result),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=True,
        )
        return json.loads(result.read_text())["output_throughput"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny workloads, to check the harness")
    parser.add_argument("--out", type=Path, default=Path("bench/results"))
    options = parser.parse_args()
    workloads = QUICK if options.quick else FULL
    print(f"bench: {prioritize_load_clients()}", flush=True)
    model_dir = prepare_default_model()
    results: dict[str, dict[str, dict]] = {"vllm_openai": {}, "rest": {}, "grpc": {}}
    memory: dict[str, int] = {}

    baseline = VllmServe(model_dir, MODEL)
    baseline.wait_ready()
    memory["vllm_openai"] = measure(
        baseline,
        {
            f"vllm_openai/{w.name}": lambda w=w: results["vllm_openai"].__setitem__(
                w.name, vllm_bench(baseline.base_url, "/v1/completions", model_dir, w)
            )
            for w in workloads
        },
    )
    baseline.stop()

    ours = MakeServe(model_dir, MODEL)
    ours.wait_ready()
    runs = {}
    for w in workloads:
        runs[f"rest/{w.name}"] = lambda w=w: results["rest"].__setitem__(
            w.name, vllm_bench(ours.base_url, "/v2/completions", model_dir, w)
        )
        runs[f"grpc/{w.name}"] = lambda w=w: results["grpc"].__setitem__(
            w.name,
            asyncio.run(
                run_load(
                    ours.grpc_target, MODEL, same_prompts(model_dir, w), w.output_len, w.concurrency
                )
            ),
        )
    memory["ours"] = measure(ours, runs)
    ours.stop()

    ceilings = {w.name: offline_ceiling(model_dir, w) for w in workloads}
    write_report(options.out, [asdict(w) for w in workloads], results, memory, ceilings)


if __name__ == "__main__":
    main()
