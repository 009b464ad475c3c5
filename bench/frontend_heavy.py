"""The frontend-heavy workloads and their report: serving CPU per token against vLLM's.

Serving CPU is the frontend's plus Envoy's (vLLM's OpenAI server has no Envoy); the engine
core's is reported beside it but is not part of it. Each round's ratios are to vLLM measured in
the same round; the report gives their median over rounds and the spread (min-max).
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from bench.workloads import Workload

FRONTEND_HEAVY = tuple(
    Workload(f"fh-c{concurrency}", concurrency, num_prompts=256, input_len=32, output_len=128)
    for concurrency in (64, 256)
)
# What each round measures: label -> (server, path) in the round's record.
RUNS = {
    "vLLM REST": ("vllm_openai", "rest"),
    "ours REST (Envoy)": ("ours", "rest"),
    "ours gRPC": ("ours", "grpc"),
}
RATIOS = (
    ("REST serving CPU", "rest", "serving"),
    ("gRPC serving CPU", "grpc", "serving"),
    ("REST output tok/s", "rest", "output_throughput"),
    ("gRPC output tok/s", "grpc", "output_throughput"),
)


def figures(run: dict[str, Any]) -> dict[str, float]:
    """Output tok/s and CPU ms per output token by role, serving = frontend + Envoy."""
    cpu_ms = run["cpu_ms_per_token"]
    envoy = cpu_ms.get("envoy", 0.0)
    return {
        "output_throughput": run["output_throughput"],
        "frontend": cpu_ms["frontend"],
        "envoy": envoy,
        "serving": cpu_ms["frontend"] + envoy,
        "engine": cpu_ms["engine"],
    }


def round_ratios(measured_round: dict[str, Any], workload: str) -> dict[str, float]:
    """Ours over vLLM's, both measured in this round."""
    baseline = figures(measured_round["vllm_openai"][workload]["rest"])
    ours = measured_round["ours"][workload]
    return {
        label: figures(ours[path])[key] / baseline[key] if baseline[key] else float("nan")
        for label, path, key in RATIOS
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def absolute(rounds: Sequence[dict[str, Any]], workload: str) -> dict[str, dict[str, float]]:
    """Each run's figures, median over rounds."""
    medians = {}
    for label, (server, path) in RUNS.items():
        per_round = [figures(measured[server][workload][path]) for measured in rounds]
        medians[label] = {
            key: statistics.median(run[key] for run in per_round) for key in per_round[0]
        }
    return medians


def summarize(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per workload: each ratio's median and spread over rounds, and median absolute figures."""
    summary = {}
    for workload in FRONTEND_HEAVY:
        per_round = [round_ratios(measured, workload.name) for measured in rounds]
        summary[workload.name] = {
            "ratios": {label: spread([r[label] for r in per_round]) for label, _, _ in RATIOS},
            "absolute": absolute(rounds, workload.name),
        }
    return summary


def record(
    rounds: Sequence[dict[str, Any]], model: dict[str, Any], round_seconds: Sequence[float]
) -> dict[str, Any]:
    return {
        "model": model,
        "workloads": [asdict(workload) for workload in FRONTEND_HEAVY],
        "round_seconds": list(round_seconds),
        "summary": summarize(rounds),
        "rounds": list(rounds),
    }


def ratio_cell(ratio: dict[str, float]) -> str:
    return f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"


def markdown(summary: dict[str, Any], rounds: int) -> str:
    workload = FRONTEND_HEAVY[0]
    concurrencies = " and ".join(str(each.concurrency) for each in FRONTEND_HEAVY)
    lines = [
        f"Frontend-heavy: a one-layer random-weight model, concurrency {concurrencies}, "
        f"{workload.num_prompts} prompts, {workload.input_len} in / {workload.output_len} out "
        "tokens, streaming, "
        f"{rounds} round(s), vLLM then ours in each.",
        "Serving CPU = frontend + Envoy, ms per output token; ratios are ours / vLLM "
        "in the same round, median (min-max) over rounds.",
        "",
        "| workload | " + " | ".join(f"{label} (x vLLM)" for label, _, _ in RATIOS) + " |",
        "|---|" + "---|" * len(RATIOS),
    ]
    for name, figures_of in summary.items():
        cells = [ratio_cell(figures_of["ratios"][label]) for label, _, _ in RATIOS]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Absolute, median over rounds (CPU in ms per output token; engine core not serving):",
        "",
        "| workload | run | output tok/s | frontend | Envoy | serving | engine core |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, figures_of in summary.items():
        for label, run in figures_of["absolute"].items():
            envoy = f"{run['envoy']:.3f}" if RUNS[label][0] == "ours" else "-"
            lines.append(
                f"| {name} | {label} | {run['output_throughput']:.0f} | {run['frontend']:.3f} "
                f"| {envoy} | {run['serving']:.3f} | {run['engine']:.3f} |"
            )
    return "\n".join(lines) + "\n"
