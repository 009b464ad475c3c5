"""Where prompts part, and whether routing follows (`make bench-routing-keys`): bench-routing's
two replicas and KV cache, behind three Envoys: least request, `--balance prefix-hash` (Envoy's
hashing of one key, the leading `--prefix-chars` bytes or `--prefix-tokens` ids: also what
`prefix` falls back to without its picker) and `--balance prefix` (the replica picker, following
each prompt's path), over workloads whose shared parts sit at different depths of the prompt:

- documents: 8 documents of about 1,000 tokens open the prompt (bench-routing's S1);
- instructions, then documents: the same 150 tokens of instructions ahead of 8 documents of
  about 850 tokens;
- long instructions, then documents: 400 tokens of instructions (past the key) ahead of 8
  documents of about 600 tokens;
- shorter documents: 12 documents of about 600 tokens;
- the last two again, sent as token ids.

One key cannot fit every workload: one shorter than the instructions every prompt shares gives
every request the same key (one replica takes them until the load bound spills them), one
longer than a document and its question gives every request a key of its own (spread as least
request would spread them). The picker's path has no length to choose. Reported per workload and
Envoy: TTFT, throughput, hit rate beside the best possible, shares; medians over rounds, and
where each workload's prompts part, in bytes or ids. Results in
bench/results/routing-keys.{json,md}.

Usage: python -m bench.routing_keys [--rounds N] [--out DIR]
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict

from transformers import PreTrainedTokenizerBase

from bench.routing import (
    KV_CACHE_GIB,
    Workload,
    base_parser,
    fleet_running,
    policy_envoys,
    prepared,
    prompts,
    results_table,
    run_rounds,
    summary,
)

INSTRUCTIONS = {"prefix_tokens": 850, "header_tokens": 150}
LONG_INSTRUCTIONS = {"prefix_tokens": 600, "header_tokens": 400}
SHORTER = {"prefixes": 12, "prefix_tokens": 600}
WORKLOADS = (
    Workload("documents", prefixes=8, requests=64, concurrency=4),
    Workload(
        "instructions, then documents", prefixes=8, requests=64, concurrency=4, **INSTRUCTIONS
    ),
    Workload(
        "long instructions, then documents",
        prefixes=8,
        requests=64,
        concurrency=4,
        **LONG_INSTRUCTIONS,
    ),
    Workload("shorter documents", requests=64, concurrency=4, **SHORTER),
    Workload(
        "long instructions, then documents, as token ids",
        prefixes=8,
        requests=64,
        concurrency=4,
        token_ids=True,
        **LONG_INSTRUCTIONS,
    ),
    Workload(
        "shorter documents, as token ids", requests=64, concurrency=4, token_ids=True, **SHORTER
    ),
)


def depths(workload: Workload, tokenizer: PreTrainedTokenizerBase) -> dict[str, int]:
    """Where a workload's prompts stop sharing (its first prompt), in what its key counts:
    bytes of text, or token ids."""
    prompt = prompts(workload, random.Random("depths"), tokenizer)[0]

    def length(text: str) -> int:
        return len(tokenizer(text)["input_ids"]) if workload.token_ids else len(text.encode())

    return {
        "shared by every prompt": length(prompt[: prompt.index("Document ")]),
        "shared by a document's prompts": length(prompt[: prompt.index("\nQuestion: ")]),
        "whole prompt": length(prompt),
    }


def markdown(table: dict[str, dict[str, dict]], shapes: dict[str, dict], rounds: int) -> str:
    lines = [
        f"# Routing keys: one key against the prompt's path ({rounds} rounds, medians)",
        "",
        *results_table(table, column="Envoy"),
        "",
        "Where each workload's prompts stop sharing, in bytes (token ids for token-id prompts):",
        "",
        "| workload | shared by every prompt | shared by a document's prompts | whole prompt |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {name} | " + " | ".join(map(str, d.values())) + " |" for name, d in shapes.items()
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = base_parser(__doc__, rounds=2).parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, tokenizer, logs = prepared("bench-routing-keys")
    shapes = {w.name: depths(w, tokenizer) for w in WORKLOADS}
    envoys = policy_envoys([])  # each policy with the default key and load bound
    with fleet_running(model_dir, logs, envoys, KV_CACHE_GIB) as fleet:
        results = run_rounds(fleet, WORKLOADS, list(envoys), args.rounds, tokenizer)
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
