"""The frontend-heavy workloads and their report: serving CPU per token against vLLM's.

Serving CPU is the frontend's plus Envoy's (vLLM's OpenAI server has no Envoy); the engine
core's is reported beside it but is not part of it. Each round's ratios are to vLLM measured in
the same round (and, with an earlier commit of ours measured too, between the two of ours); the
report gives their median over rounds and the spread (min-max).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from bench.workloads import Workload

FRONTEND_HEAVY = tuple(
    Workload(f"fh-c{concurrency}", concurrency, num_prompts=256, input_len=32, output_len=128)
    for concurrency in (64, 256)
)
# Our stack as this checkout, and as an earlier commit when a before/after comparison is asked
# for (`--before REF`): the server keys in a round's record.
VLLM = "vllm_openai"
OURS = "ours"
BEFORE = "ours_before"
# bench/engine_floor.py: vLLM's engine client alone, no transport (its one path is "none").
FLOOR = "engine_floor"
PATHS = {"REST": "rest", "gRPC": "grpc"}
RATIOS = (
    ("REST serving CPU", "rest", "serving"),
    ("gRPC serving CPU", "grpc", "serving"),
    ("REST output tok/s", "rest", "output_throughput"),
    ("gRPC output tok/s", "grpc", "output_throughput"),
)


def runs(servers: Sequence[str]) -> dict[str, tuple[str, str]]:
    """What each round measured: label -> (server, path) in the round's record."""
    labels = {OURS: "ours", BEFORE: "ours before"}
    found = {"vLLM REST": (VLLM, "rest")}
    for server in (BEFORE, OURS):
        if server in servers:
            found.update(
                {f"{labels[server]} {name}": (server, path) for name, path in PATHS.items()}
            )
    if FLOOR in servers:
        found["engine client alone"] = (FLOOR, "none")
    return found


def above_floor(rounds: Sequence[dict[str, Any]], workload: str) -> dict[str, float]:
    """The floor's CPU per token and what each server spends above it, medians of each
    round's differences (ms per output token)."""
    paths = {"vLLM": (VLLM, "rest"), "ours gRPC": (OURS, "grpc"), "ours REST": (OURS, "rest")}
    found = {
        "floor": statistics.median(figures(r[FLOOR][workload]["none"])["frontend"] for r in rounds)
    }
    for label, (server, path) in paths.items():
        found[label] = statistics.median(
            figures(r[server][workload][path])["serving"]
            - figures(r[FLOOR][workload]["none"])["frontend"]
            for r in rounds
        )
    return found


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
        # Counted by our gRPC client only (REST: not counted).
        "messages_per_token": run.get("messages_per_token") or math.nan,
    }


def round_ratios(
    measured_round: dict[str, Any], workload: str, server: str = OURS, baseline: str = VLLM
) -> dict[str, float]:
    """`server` over `baseline`, both measured in this round (vLLM's server: REST only)."""
    base = measured_round[baseline][workload]
    ours = measured_round[server][workload]
    ratios = {}
    for label, path, key in RATIOS:
        reference = figures(base.get(path, base["rest"]))[key]
        ratios[label] = figures(ours[path])[key] / reference if reference else float("nan")
    return ratios


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def absolute(rounds: Sequence[dict[str, Any]], workload: str) -> dict[str, dict[str, float]]:
    """Each run's figures, median over rounds."""
    medians = {}
    for label, (server, path) in runs(list(rounds[0])).items():
        per_round = [figures(measured[server][workload][path]) for measured in rounds]
        medians[label] = {
            key: statistics.median(run[key] for run in per_round) for key in per_round[0]
        }
    return medians


# The comparisons a report holds: (title, server, baseline) for round_ratios.
COMPARISONS = (
    ("ours / vLLM", OURS, VLLM),
    ("ours before / vLLM", BEFORE, VLLM),
    ("ours / ours before", OURS, BEFORE),
)


def summarize(rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Per workload: each comparison's ratios (median and spread over rounds), and median
    absolute figures."""
    summary = {}
    comparisons = [
        (title, server, baseline)
        for title, server, baseline in COMPARISONS
        if server in rounds[0] and baseline in rounds[0]
    ]
    for workload in FRONTEND_HEAVY:
        ratios = {}
        for title, server, baseline in comparisons:
            per_round = [
                round_ratios(measured, workload.name, server, baseline) for measured in rounds
            ]
            ratios[title] = {label: spread([r[label] for r in per_round]) for label, _, _ in RATIOS}
        summary[workload.name] = {"ratios": ratios, "absolute": absolute(rounds, workload.name)}
        if FLOOR in rounds[0]:
            summary[workload.name]["above_floor"] = above_floor(rounds, workload.name)
    return summary


def record(
    rounds: Sequence[dict[str, Any]],
    model: dict[str, Any],
    round_seconds: Sequence[float],
    before: str | None = None,
) -> dict[str, Any]:
    return {
        "model": model,
        "before": before,
        "workloads": [asdict(workload) for workload in FRONTEND_HEAVY],
        "round_seconds": list(round_seconds),
        "summary": summarize(rounds),
        "rounds": list(rounds),
    }


def per_token(messages: float) -> str:
    return "-" if math.isnan(messages) else f"{messages:.2f}"


def ratio_cell(ratio: dict[str, float]) -> str:
    return f"{ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f})"


def markdown(summary: dict[str, Any], rounds: int, before: str | None = None) -> str:
    workload = FRONTEND_HEAVY[0]
    concurrencies = " and ".join(str(each.concurrency) for each in FRONTEND_HEAVY)
    order = "vLLM, ours at " + before + ' ("before"), then ours' if before else "vLLM then ours"
    lines = [
        f"Frontend-heavy: a one-layer random-weight model, concurrency {concurrencies}, "
        f"{workload.num_prompts} prompts, {workload.input_len} in / {workload.output_len} out "
        "tokens, streaming, "
        f"{rounds} round(s), {order} in each.",
        "Serving CPU = frontend + Envoy, ms per output token; ratios are between runs "
        "in the same round, median (min-max) over rounds.",
        "",
        "| workload | ratio | " + " | ".join(label for label, _, _ in RATIOS) + " |",
        "|---|---|" + "---|" * len(RATIOS),
    ]
    for name, figures_of in summary.items():
        for title, ratios in figures_of["ratios"].items():
            cells = [ratio_cell(ratios[label]) for label, _, _ in RATIOS]
            lines.append(f"| {name} | {title} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Absolute, median over rounds (CPU in ms per output token; engine core not serving):",
        "",
        "| workload | run | output tok/s | frontend | Envoy | serving | engine core "
        "| messages per token |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, figures_of in summary.items():
        for label, run in figures_of["absolute"].items():
            envoy = f"{run['envoy']:.3f}" if label.startswith("ours") else "-"
            lines.append(
                f"| {name} | {label} | {run['output_throughput']:.0f} | {run['frontend']:.3f} "
                f"| {envoy} | {run['serving']:.3f} | {run['engine']:.3f} "
                f"| {per_token(run['messages_per_token'])} |"
            )
    lines += floor_lines(summary)
    return "\n".join(lines) + "\n"


def floor_lines(summary: dict[str, Any]) -> list[str]:
    """What each server spends per token above vLLM's engine client alone, if it was run."""
    if not all("above_floor" in figures_of for figures_of in summary.values()):
        return []
    lines = [
        "",
        "Above the floor: vLLM's engine client alone (no transport) in ms of CPU per output "
        "token, and each server's serving CPU above it (medians of each round's difference):",
        "",
        "| workload | engine client alone | vLLM above it | ours gRPC above it "
        "| ours REST above it (Envoy included) |",
        "|---|---|---|---|---|",
    ]
    for name, figures_of in summary.items():
        found = figures_of["above_floor"]
        lines.append(
            f"| {name} | {found['floor']:.3f} | {found['vLLM']:.3f} | {found['ours gRPC']:.3f} "
            f"| {found['ours REST']:.3f} |"
        )
    return lines
