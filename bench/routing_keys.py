"""How long a completion's routing key should be (`make bench-routing-keys`): bench-routing's two
replicas and KV cache, behind one Envoy with least request and one with `--balance prefix` for
each key length (`--prefix-chars`), over workloads whose shared parts sit at different depths of
the prompt:

- documents: 8 documents of about 1,000 tokens open the prompt (bench-routing's S1);
- instructions, then documents: the same 150 tokens of instructions ahead of 8 documents of
  about 850 tokens;
- shorter documents: 12 documents of about 600 tokens.

A key shorter than the instructions every prompt shares gives every request the same key (one
replica takes them until the load bound spills them); a key longer than a document and its
question gives every request a key of its own (dealt out evenly, as least request would). The
key is right between the two. Reported per workload and Envoy: TTFT, throughput, hit rate
beside the best possible, shares; medians over rounds, and each workload's depths in characters.
Results in bench/results/routing-keys.{json,md}.

Usage: python -m bench.routing_keys [--rounds N] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
from dataclasses import asdict
from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from bench.routing import (
    KV_CACHE_GIB,
    RESULTS,
    Workload,
    fleet_running,
    prompts,
    results_table,
    run_rounds,
    summary,
)
from service.model.default_model import prepare_default_model

KEY_CHARS = (256, 1024, 4096)
WORKLOADS = (
    Workload("documents", prefixes=8, requests=64, concurrency=4),
    Workload(
        "instructions, then documents",
        prefixes=8,
        requests=64,
        concurrency=4,
        prefix_tokens=850,
        header_tokens=150,
    ),
    Workload("shorter documents", prefixes=12, requests=64, concurrency=4, prefix_tokens=600),
)


def key_envoys() -> dict[str, list[str]]:
    """facade.launch's balancing arguments for each Envoy, by name."""
    envoys = {"least-request": ["--balance", "least-request"]}
    for chars in KEY_CHARS:
        envoys[f"key {chars} chars"] = ["--balance", "prefix", "--prefix-chars", str(chars)]
    return envoys


def depths(workload: Workload, tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """Where a workload's prompts stop sharing, in characters (its first prompt)."""
    prompt = prompts(workload, random.Random("depths"), tokenizer)[0]
    document_start = prompt.index("Document ")
    question_start = prompt.index("\nQuestion: ")
    return {
        "shared by every prompt": document_start,
        "shared by a document's prompts": question_start,
        "whole prompt": len(prompt),
    }


def markdown(table: dict[str, dict[str, dict]], shapes: dict[str, dict], rounds: int) -> str:
    lines = [
        f"# Routing keys: how long a key should be ({rounds} rounds, medians)",
        "",
        *results_table(table, column="Envoy"),
        "",
        "Where each workload's prompts stop sharing, in characters:",
        "",
        "| workload | shared by every prompt | shared by a document's prompts | whole prompt |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {name} | " + " | ".join(map(str, d.values())) + " |" for name, d in shapes.items()
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir = prepare_default_model()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    shapes = {w.name: depths(w, tokenizer) for w in WORKLOADS}
    logs = Path(tempfile.mkdtemp(prefix="bench-routing-keys-"))
    print(f"replica logs in {logs}", flush=True)
    envoys = key_envoys()
    with fleet_running(model_dir, logs, envoys, KV_CACHE_GIB) as fleet:
        results = run_rounds(fleet, WORKLOADS, list(envoys), args.rounds)
    table = summary(results)
    document = {
        "settings": {
            "kv_cache_gib": KV_CACHE_GIB,
            "workloads": [asdict(w) for w in WORKLOADS],
            "depths": shapes,
            "rounds": args.rounds,
            "envoys": envoys,
        },
        "runs": results,
        "medians": table,
    }
    (args.out / "routing-keys.json").write_text(json.dumps(document, indent=2))
    (args.out / "routing-keys.md").write_text(markdown(table, shapes, args.rounds))
    print(markdown(table, shapes, args.rounds))


if __name__ == "__main__":
    main()
