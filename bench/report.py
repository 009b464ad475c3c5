"""Turn benchmark results into ratios against vLLM's OpenAI server: JSON, markdown and a plot."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

METRICS = (
    ("output_throughput", "output tok/s"),
    ("median_ttft_ms", "median TTFT ms"),
    ("p99_ttft_ms", "p99 TTFT ms"),
    ("median_tpot_ms", "median TPOT ms"),
    ("median_itl_ms", "median ITL ms"),
)
SERVERS = (("vllm_openai", "(a) vLLM OpenAI"), ("rest", "(b) REST via Envoy"), ("grpc", "(c) gRPC"))


def ratio(value: float, baseline: float) -> float | None:
    return value / baseline if baseline else None


def ratios(results: dict[str, dict[str, dict]], workload: str) -> dict[str, dict[str, Any]]:
    baseline = results["vllm_openai"][workload]
    return {
        server: {key: ratio(results[server][workload][key], baseline[key]) for key, _ in METRICS}
        for server in ("rest", "grpc")
    }


def markdown(
    workloads: list[dict], results: dict, memory: dict[str, int], ceilings: dict[str, float]
) -> str:
    lines = []
    for workload in workloads:
        name = workload["name"]
        lines += [
            f"### {name}: concurrency {workload['concurrency']}, {workload['num_prompts']} "
            f"prompts, {workload['input_len']} in / {workload['output_len']} out tokens",
            "",
            "| server | " + " | ".join(label for _, label in METRICS) + " |",
            "|---|" + "---|" * len(METRICS),
        ]
        relative = ratios(results, name)
        for server, label in SERVERS:
            cells = []
            for key, _ in METRICS:
                value = results[server][name][key]
                share = relative.get(server, {}).get(key)
                cells.append(f"{value:.1f}" + (f" ({share:.2f}x)" if share else ""))
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        ceiling = ceilings[name]
        grpc_share = results["grpc"][name]["output_throughput"] / ceiling
        lines += [
            f"| offline `LLM.generate` ceiling | {ceiling:.1f} | | | | |",
            "",
            f"(c) served throughput is {grpc_share:.2f} of the offline ceiling.",
            "",
        ]
    mib = {server: value / 2**20 for server, value in memory.items()}
    lines += [
        "### Peak resident memory (all processes of each server)",
        "",
        f"| (a) vLLM OpenAI | {mib['vllm_openai']:.0f} MiB | 1.00x |",
        "|---|---|---|",
        f"| ours (service + engine + Envoy) | {mib['ours']:.0f} MiB | "
        f"{mib['ours'] / mib['vllm_openai']:.2f}x |",
        "",
    ]
    return "\n".join(lines)


def plot(path: Path, workloads: list[dict], results: dict, ceilings: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w["name"] for w in workloads]
    width = 0.2
    figure, axis = plt.subplots(figsize=(8, 4))
    for offset, (server, label) in enumerate(SERVERS):
        values = [results[server][name]["output_throughput"] for name in names]
        axis.bar([i + offset * width for i in range(len(names))], values, width, label=label)
    axis.bar(
        [i + 3 * width for i in range(len(names))],
        [ceilings[n] for n in names],
        width,
        label="offline ceiling",
        color="lightgrey",
    )
    axis.set_xticks([i + 1.5 * width for i in range(len(names))], names)
    axis.set_ylabel("output tokens/s")
    axis.set_title("Output throughput, same model and engine settings")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def write_report(
    out: Path,
    workloads: list[dict],
    results: dict,
    memory: dict[str, int],
    ceilings: dict[str, float],
) -> None:
    out.mkdir(parents=True, exist_ok=True)
    document = {
        "workloads": workloads,
        "results": results,
        "ratios_to_vllm_openai": {w["name"]: ratios(results, w["name"]) for w in workloads},
        "offline_ceiling_output_throughput": ceilings,
        "peak_rss_bytes": memory,
    }
    (out / "results.json").write_text(json.dumps(document, indent=2, default=str) + "\n")
    (out / "results.md").write_text(markdown(workloads, results, memory, ceilings))
    plot(out / "results.png", workloads, results, ceilings)
    print((out / "results.md").read_text())
