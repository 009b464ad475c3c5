"""Routing behind two Envoys, as deploy/ runs them (`make bench-routing-fronts`): bench-routing's
two replicas, KV cache and workloads, with each policy's requests spread over two Envoys in
front of the same replicas (request i to Envoy i mod 2, as a Service spreads its clients), and
one Envoy with the replica picker beside them for reference. Each Envoy started as
facade.launch starts it, so each `prefix` Envoy has a picker of its own; two more `prefix`
Envoys share one picker (`--picker`, as deploy/ runs them). Reported per workload and front:
TTFT, throughput, hit rate beside the best possible, shares; medians over rounds. Results in
bench/results/routing-fronts.{json,md}.

Usage: python -m bench.routing_fronts [--rounds N] [--out DIR]
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict

from bench.routing import (
    KV_CACHE_GIB,
    POLICIES,
    WORKLOADS,
    base_parser,
    fleet_running,
    prepared,
    results_table,
    run_rounds,
    summary,
)
from facade.picker.health import CHECK_EVERY_SECONDS
from tests.processes import free_port, shared_picker

ENVOYS_PER_FRONT = 2
ONE_PICKER = "prefix, one Envoy"
SHARED = "prefix shared"
SHARED_PICKER = "prefix, two Envoys, one picker"


def envoys(picker_port: int) -> dict[str, list[str]]:
    """Two Envoys for each policy, named `policy #n`, with facade.launch's defaults, and two
    asking the picker on `picker_port`."""
    numbers = range(1, ENVOYS_PER_FRONT + 1)
    own = {f"{policy} #{n}": ["--balance", policy] for policy in POLICIES for n in numbers}
    shared = ["--balance", "prefix", "--picker", f"127.0.0.1:{picker_port}"]
    return {**own, **{f"{SHARED} #{n}": shared for n in numbers}}


def fronts() -> dict[str, list[str]]:
    """What each measured front sends requests to: two Envoys, or one picker's."""
    two = {
        f"{policy}, two Envoys": [f"{policy} #{n}" for n in range(1, ENVOYS_PER_FRONT + 1)]
        for policy in POLICIES
    }
    shared = [f"{SHARED} #{n}" for n in range(1, ENVOYS_PER_FRONT + 1)]
    return {**two, SHARED_PICKER: shared, ONE_PICKER: ["prefix #1"]}


def markdown(table: dict[str, dict[str, dict]], rounds: int) -> str:
    lines = [
        f"# Routing behind two Envoys ({rounds} rounds, medians)",
        "",
        *results_table(table, column="front"),
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    args = base_parser(__doc__, rounds=2).parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    model_dir, tokenizer, logs = prepared("bench-routing-fronts")
    measured = fronts()
    picker_port = free_port()
    with (
        fleet_running(model_dir, logs, envoys(picker_port), KV_CACHE_GIB) as fleet,
        shared_picker(
            picker_port,
            [replica.grpc_target for replica in fleet.replicas],
            logs / "shared-picker.log",
        ),
    ):
        time.sleep(CHECK_EVERY_SECONDS)  # the picker's first health checks
        results = run_rounds(
            fleet, WORKLOADS[:3], list(measured), args.rounds, tokenizer, fronts=measured
        )
    table = summary(results)
    document = {
        "settings": {
            "kv_cache_gib": KV_CACHE_GIB,
            "workloads": [asdict(w) for w in WORKLOADS[:3]],
            "rounds": args.rounds,
            "fronts": measured,
        },
        "runs": results,
        "medians": table,
    }
    (args.out / "routing-fronts.json").write_text(json.dumps(document, indent=2))
    (args.out / "routing-fronts.md").write_text(markdown(table, args.rounds))
    print(markdown(table, args.rounds))


if __name__ == "__main__":
    main()
