"""The routing benchmark (`make bench-routing`): two replicas on one host, each on a core of its
own, prefix caching on, behind three Envoys started as `facade.launch` starts them, with
`--balance prefix` (the default: the replica picker), `--balance prefix-hash` (Envoy's hashing
alone) and `--balance least-request`. Three workloads run through each, interleaved over rounds;
every run draws prefixes no replica has seen, so no run inherits another's cache.

- S1 cache pressure: 8 shared prefixes of about 1,000 tokens, short unique suffixes, short
  outputs; one replica's KV cache cannot hold every prefix, two can.
- S2 control: 2 shared prefixes; every replica's cache holds them all.
- S3 hot prefix: one prefix in 80% of requests, four others in the rest.
- S4 slowed replica: S1's prompts while another client sends long prompts straight to one
  replica's gRPC port (no Envoy sees them): only the replicas' load reports tell the picker.

Each workload also runs through a fourth Envoy, prefix with its picker told to ignore the
replicas' load reports (PICKER_LOAD_REPORTS=off): what the reports change.

Reported per run: TTFT p50/p90 (streamed, to the first event), output throughput, each
replica's prefix-cache hit rate (the engine's own counters) and share of requests, and the best
hit rate any routing could reach on the run's prompts; medians over rounds, and the targets.
Results in bench/results/routing.{json,md,png}.

Usage: python -m bench.routing [--rounds N] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AsyncExitStack, contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import httpx
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateChatCompletionRequest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from service.model.default_model import DEFAULT_SERVED_MODEL_NAME, prepare_default_model
from tests.metrics import engine_block_tokens, scrape
from tests.processes import TestStack, free_port, healthy_upstreams

RESULTS = Path(__file__).parent / "results"
# prefix-hash (Envoy's hashing alone) runs beside them to show what the replica picker adds.
POLICIES = ("least-request", "prefix-hash", "prefix")
# About 4.3 prefixes of 1,000 tokens per replica (46 KiB a token): 8 do not fit in one, do in
# two, with little room to spare (0.21 GiB, 4.7 prefixes, left least request holding more than
# half of them: docs/benchmarks/routing.md).
KV_CACHE_GIB = 0.19
MAX_MODEL_LEN = 2048
START_TIMEOUT = 900
PREFIX_TOKENS = 1000
SUFFIX_WORDS = 8
OUTPUT_TOKENS = 8
WORD_TEXT = (
    "river stone lantern meadow copper signal harbor orchard velvet summit canyon ember glacier "
    "mosaic pillar quartz saddle thistle violet willow anchor beacon cobalt dune falcon garnet "
    "hollow island jasper kettle lagoon marble nectar opal pepper quiver raven saffron timber "
    "umber vessel walnut yarrow zephyr"
)
WORDS = WORD_TEXT.split()


@dataclass(frozen=True)
class Workload:
    name: str
    prefixes: int
    requests: int
    concurrency: int
    hot_share: float = 0.0  # the share of requests that use the first prefix
    prefix_tokens: int = PREFIX_TOKENS
    # Instructions every prompt starts with, ahead of its prefix (0: none).
    header_tokens: int = 0
    token_ids: bool = False  # send each prompt as its token ids instead of its text
    # Another client keeps the first replica busy with long prompts meanwhile, bypassing Envoy.
    slowed: bool = False


WORKLOADS = (
    Workload("S1 cache pressure", prefixes=8, requests=64, concurrency=4),
    Workload("S2 control", prefixes=2, requests=32, concurrency=4),
    Workload("S3 hot prefix", prefixes=5, requests=64, concurrency=6, hot_share=0.8),
    Workload("S4 slowed replica", prefixes=8, requests=64, concurrency=4, slowed=True),
)
NO_REPORTS = "prefix, no load reports"
# The other client's long prompts (S4): this many at once, each of about this many tokens.
SLOWING_CALLS = 2
SLOWING_TOKENS = 1500


@dataclass
class Fleet:
    replicas: list[TestStack]
    metrics_urls: list[str]
    envoys: dict[str, subprocess.Popen[bytes]]
    base_urls: dict[str, str]
    block_tokens: int  # the engines' KV-cache block: prompts share cached blocks, whole


def words(rng: random.Random, count: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(count))


def prefix_text(
    rng: random.Random,
    tokenizer: PreTrainedTokenizerBase,
    tokens: int = PREFIX_TOKENS,
    title: str = "Document",
) -> str:
    """About `tokens` tokens of words (a document, few-shot examples, a system prompt)."""
    text = f"{title} {rng.randrange(10**9)}: "
    while len(tokenizer(text)["input_ids"]) < tokens:
        text += words(rng, 10 if tokens < 200 else 50) + ". "
    return text


def prompts(
    workload: Workload, rng: random.Random, tokenizer: PreTrainedTokenizerBase
) -> list[str]:
    shared = [prefix_text(rng, tokenizer, workload.prefix_tokens) for _ in range(workload.prefixes)]
    header = (
        prefix_text(rng, tokenizer, workload.header_tokens, "Instructions") + "\n"
        if workload.header_tokens
        else ""
    )
    chosen = []
    for _ in range(workload.requests):
        if workload.hot_share and rng.random() < workload.hot_share:
            prefix = shared[0]
        else:
            prefix = rng.choice(shared[1:] if workload.hot_share else shared)
        chosen.append(f"{header}{prefix}\nQuestion: {words(rng, SUFFIX_WORDS)}?")
    return chosen


def common_prefix_length(first: Sequence[int], second: Sequence[int]) -> int:
    length = 0
    for a, b in zip(first, second, strict=False):  # the shorter one ends the prefix
        if a != b:
            break
        length += 1
    return length


def best_hit_rate(token_ids: list[list[int]], block_tokens: int) -> float:
    """The hit rate no routing can beat for these prompts in this order: one cache that never
    evicts, where each prompt reuses the whole blocks it shares with any earlier prompt (the
    engine caches full blocks only, and always computes a prompt's last token itself)."""
    hits = 0
    for index, ids in enumerate(token_ids):
        shared = max((common_prefix_length(ids, seen) for seen in token_ids[:index]), default=0)
        hits += min(shared, len(ids) - 1) // block_tokens * block_tokens
    return hits / (sum(len(ids) for ids in token_ids) or 1)


async def one_request(
    client: httpx.AsyncClient, prompt: str | list[int], gate: asyncio.Semaphore
) -> tuple[float, int]:
    """(time to the first streamed event, completion tokens)."""
    payload = {
        "model": DEFAULT_SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": OUTPUT_TOKENS,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with gate:
        started = time.perf_counter()
        first = None
        tokens = 0
        async with client.stream("POST", "/v2/completions", json=payload) as reply:
            reply.raise_for_status()
            async for line in reply.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                first = first or time.perf_counter() - started
                chunk = json.loads(line.removeprefix("data: "))
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        return first or 0.0, tokens


async def load(
    base_urls: Sequence[str], chosen: Sequence[str | list[int]], concurrency: int
) -> dict[str, Any]:
    """The prompts at `concurrency`, each to the next of the Envoys at `base_urls` in turn."""
    gate = asyncio.Semaphore(concurrency)
    async with AsyncExitStack() as stack:
        clients = [
            await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=600))
            for url in base_urls
        ]
        started = time.perf_counter()
        results = await asyncio.gather(
            *(one_request(clients[i % len(clients)], p, gate) for i, p in enumerate(chosen))
        )
        elapsed = time.perf_counter() - started
    ttfts = sorted(ttft for ttft, _ in results)
    return {
        "ttft_p50": statistics.median(ttfts),
        "ttft_p90": ttfts[min(len(ttfts) - 1, int(0.9 * len(ttfts)))],
        "output_throughput": sum(tokens for _, tokens in results) / elapsed,
        "seconds": elapsed,
    }


def total(snapshot: dict[tuple[str, Any], float], name: str, **labels: str) -> float:
    wanted = set(labels.items())
    return sum(v for (n, ls), v in snapshot.items() if n == name and wanted <= set(ls))


def replica_counters(url: str) -> dict[str, float]:
    snapshot = scrape(url)
    return {
        "queries": total(snapshot, "vllm:prefix_cache_queries_total"),
        "hits": total(snapshot, "vllm:prefix_cache_hits_total"),
        "requests": total(
            snapshot, "llmcompletions_requests_total", method="CreateCompletion", code="OK"
        ),
    }


def per_replica(before: list[dict[str, float]], after: list[dict[str, float]]) -> dict:
    grew = [{key: a[key] - b[key] for key in a} for b, a in zip(before, after, strict=True)]
    requests = sum(g["requests"] for g in grew) or 1
    queries = sum(g["queries"] for g in grew) or 1
    return {
        "hit_rate": sum(g["hits"] for g in grew) / queries,
        "replica_hit_rates": [g["hits"] / g["queries"] if g["queries"] else 0.0 for g in grew],
        "replica_shares": [g["requests"] / requests for g in grew],
    }


def run_once(
    fleet: Fleet,
    fronts: Sequence[str],
    workload: Workload,
    chosen: list[str],
    tokenizer: PreTrainedTokenizerBase,
) -> dict:
    """The prompts through the named Envoys (`fronts`, taking requests in turn)."""
    token_ids = [tokenizer(p)["input_ids"] for p in chosen]
    best = best_hit_rate(token_ids, fleet.block_tokens)
    sent = token_ids if workload.token_ids else chosen
    before = [replica_counters(url) for url in fleet.metrics_urls]
    urls = [fleet.base_urls[front] for front in fronts]
    with slowing(fleet.replicas[0], tokenizer) if workload.slowed else contextlib.nullcontext():
        measured = asyncio.run(load(urls, sent, workload.concurrency))
    after = [replica_counters(url) for url in fleet.metrics_urls]
    return {**measured, **per_replica(before, after), "best_hit_rate": best}


@contextmanager
def slowing(replica: TestStack, tokenizer: PreTrainedTokenizerBase) -> Iterator[None]:
    """Another client sends long prompts of its own straight to `replica`'s gRPC port (chat
    calls: the replica's completion counts stay the workload's) until the block ends."""
    stop = threading.Event()

    def run(index: int) -> None:
        rng = random.Random(f"slowing {index}")
        with grpc.insecure_channel(replica.grpc_target) as channel:
            stub = completions_pb2_grpc.CompletionServiceStub(channel)
            while not stop.is_set():
                text = prefix_text(rng, tokenizer, SLOWING_TOKENS, "Report")
                request = CreateChatCompletionRequest(model=DEFAULT_SERVED_MODEL_NAME, max_tokens=1)
                request.messages.add(role="user").content.string_value = text
                list(stub.CreateChatCompletion(request, timeout=600))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(SLOWING_CALLS)]
    for thread in threads:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        for thread in threads:
            thread.join(timeout=600)


def run_rounds(
    fleet: Fleet,
    workloads: Sequence[Workload],
    names: list[str],
    rounds: int,
    tokenizer: PreTrainedTokenizerBase,
    fronts: dict[str, list[str]] | None = None,
) -> dict[str, dict[str, list[dict]]]:
    """Each workload through each named Envoy (or, with `fronts`, each name's Envoys, taking
    requests in turn), `rounds` times; which goes first alternates by round, and each run has
    prefixes of its own."""
    fronts = fronts or {name: [name] for name in names}
    results: dict[str, dict[str, list[dict]]] = {w.name: {n: [] for n in names} for w in workloads}
    for round_index in range(rounds):
        for workload in workloads:
            for name in names if round_index % 2 == 0 else names[::-1]:
                rng = random.Random(f"{round_index}/{workload.name}/{name}")
                chosen = prompts(workload, rng, tokenizer)
                run = run_once(fleet, fronts[name], workload, chosen, tokenizer)
                results[workload.name][name].append(run)
                print(
                    f"round {round_index + 1}/{rounds} {workload.name} {name}: "
                    f"TTFT p50 {run['ttft_p50']:.2f}s p90 {run['ttft_p90']:.2f}s, "
                    f"{run['output_throughput']:.1f} tok/s, hit rate {run['hit_rate']:.0%} "
                    f"(best possible {run['best_hit_rate']:.0%}), "
                    f"shares {[round(s, 2) for s in run['replica_shares']]}",
                    flush=True,
                )
    return results


def policy_envoys(balance_args: list[str]) -> dict[str, list[str]]:
    """facade.launch's balancing arguments for each policy's Envoy."""
    return {
        policy: ["--balance", policy, *([] if policy == "least-request" else balance_args)]
        for policy in POLICIES
    }


def completion_cluster(launch_args: list[str]) -> str:
    """The cluster an Envoy launched with these arguments sends completions to
    (facade/balancing.py): keyed calls have a cluster of their own."""
    least_request = launch_args[launch_args.index("--balance") + 1] == "least-request"
    return "completion_service" if least_request else "completion_service_prefix"


@contextmanager
def fleet_running(
    model_dir: Path,
    log_dir: Path,
    envoy_args: dict[str, list[str]],
    kv_cache_gib: float,
    envoy_env: dict[str, dict[str, str]] | None = None,
) -> Iterator[Fleet]:
    """Two replicas, one a core, and an Envoy for each entry of `envoy_args` (a name, and
    facade.launch's balancing arguments) in front of both, with its `envoy_env` entry added
    to its environment."""
    metrics_ports = [free_port(), free_port()]
    replicas = [
        TestStack(
            grpc_port=free_port(),
            service_args=[
                *("--model", str(model_dir), "--served-model-name", DEFAULT_SERVED_MODEL_NAME),
                *("--max-model-len", str(MAX_MODEL_LEN), "--kv-cache-gib", str(kv_cache_gib)),
                *("--cpu-cores", str(core), "--metrics-port", str(metrics_ports[core])),
            ],
            service_log=log_dir / f"replica-{core}.log",
        )
        for core in range(2)
    ]
    envoys: dict[str, subprocess.Popen[bytes]] = {}
    base_urls: dict[str, str] = {}
    admin_ports: dict[str, int] = {}
    try:
        for replica in replicas:
            replica.start(with_envoy=False)
        for name, launch_args in envoy_args.items():
            http_port, admin_ports[name] = free_port(), free_port()
            command = [sys.executable, "-m", "facade.launch", *launch_args]
            command += ["--http-port", str(http_port), "--admin-port", str(admin_ports[name])]
            for replica in replicas:
                command += ["--upstream", replica.grpc_target]
            env = {**os.environ, **(envoy_env or {}).get(name, {})}
            envoys[name] = subprocess.Popen(command, stdout=subprocess.DEVNULL, env=env)
            base_urls[name] = f"http://127.0.0.1:{http_port}"
        for replica in replicas:
            replica.wait_ready_service(START_TIMEOUT)
        hosts = {replica.grpc_target for replica in replicas}
        deadline = time.monotonic() + 60
        while not all(
            hosts
            <= healthy_upstreams(f"http://127.0.0.1:{port}", completion_cluster(envoy_args[name]))
            for name, port in admin_ports.items()
        ):
            if time.monotonic() > deadline:
                raise RuntimeError("Envoy never saw both replicas healthy")
            time.sleep(0.5)
        time.sleep(2)  # Envoy's workers get the host set (and hash ring) just after
        urls = [f"http://127.0.0.1:{port}/metrics" for port in metrics_ports]
        yield Fleet(replicas, urls, envoys, base_urls, engine_block_tokens(urls[0]))
    finally:
        for envoy in envoys.values():
            envoy.terminate()
            envoy.wait(timeout=30)
        for replica in replicas:
            replica.stop()


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(run[key] for run in runs)


def summary(results: dict[str, dict[str, list[dict]]]) -> dict[str, dict[str, dict]]:
    """Medians over rounds, per workload and policy."""
    keys = ("ttft_p50", "ttft_p90", "output_throughput", "hit_rate", "best_hit_rate")
    table: dict[str, dict[str, dict]] = {}
    for workload, by_policy in results.items():
        table[workload] = {}
        for policy, runs in by_policy.items():
            row = {key: median_of(runs, key) for key in keys}
            row["min_replica_share"] = statistics.median(min(r["replica_shares"]) for r in runs)
            row["replica_hit_rates"] = [
                statistics.median(r["replica_hit_rates"][i] for r in runs) for i in range(2)
            ]
            row["replica_shares"] = [
                statistics.median(r["replica_shares"][i] for r in runs) for i in range(2)
            ]
            table[workload][policy] = row
    return table


def targets(table: dict[str, dict[str, dict]]) -> list[dict[str, Any]]:
    """Each target, the measured value beside it, and whether it is met."""
    s1, s2, s3 = (table[w.name] for w in WORKLOADS[:3])

    def ratio(rows: dict[str, dict], key: str) -> float:
        return rows["prefix"][key] / rows["least-request"][key]

    checks: list[tuple[str, float, Callable[[float], bool]]] = [
        ("S1 hit rate, prefix / least-request (>= 2)", ratio(s1, "hit_rate"), lambda v: v >= 2),
        ("S1 TTFT p50, prefix / least-request (<= 0.5)", ratio(s1, "ttft_p50"), lambda v: v <= 0.5),
        (
            "S2 TTFT p50, prefix / least-request (<= 1.05)",
            ratio(s2, "ttft_p50"),
            lambda v: v <= 1.05,
        ),
        (
            "S2 output throughput, prefix / least-request (>= 0.95)",
            ratio(s2, "output_throughput"),
            lambda v: v >= 0.95,
        ),
        ("S3 TTFT p90, prefix / least-request (<= 1)", ratio(s3, "ttft_p90"), lambda v: v <= 1),
        (
            "S3 smallest replica share with prefix (> 0: no replica idle)",
            s3["prefix"]["min_replica_share"],
            lambda v: v > 0,
        ),
        (
            "S1 hit rate, prefix / best possible (>= 0.9)",
            s1["prefix"]["hit_rate"] / s1["prefix"]["best_hit_rate"],
            lambda v: v >= 0.9,
        ),
    ]
    return [
        {"target": name, "measured": round(value, 3), "met": bool(check(value))}
        for name, value, check in checks
    ]


def results_table(table: dict[str, dict[str, dict]], column: str = "policy") -> list[str]:
    """The medians, a row per workload and Envoy."""
    lines = [
        f"| workload | {column} | TTFT p50 s | TTFT p90 s | output tok/s | hit rate | best "
        "possible | per replica hit rate | per replica share | smaller share |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for workload, by_envoy in table.items():
        for envoy, row in by_envoy.items():
            lines.append(
                f"| {workload} | {envoy} | {row['ttft_p50']:.2f} | {row['ttft_p90']:.2f} | "
                f"{row['output_throughput']:.1f} | {row['hit_rate']:.0%} | "
                f"{row['best_hit_rate']:.0%} | "
                + " / ".join(f"{rate:.0%}" for rate in row["replica_hit_rates"])
                + " | "
                + " / ".join(f"{share:.0%}" for share in row["replica_shares"])
                + f" | {row['min_replica_share']:.0%} |"
            )
    return lines


def markdown(table: dict[str, dict[str, dict]], met: list[dict[str, Any]], rounds: int) -> str:
    lines = [
        f"# Routing: prefix affinity against least request ({rounds} rounds, medians)",
        "",
        *results_table(table),
        "",
        "| target | measured | met |",
        "|---|---|---|",
    ]
    lines += [f"| {t['target']} | {t['measured']} | {'yes' if t['met'] else 'no'} |" for t in met]
    return "\n".join([*lines, "", s1_headroom(table[WORKLOADS[0].name])]) + "\n"


def s1_headroom(s1: dict[str, dict]) -> str:
    """How close prefix came to the best any routing could do on S1, and what that best is
    against least request: the hit-rate target cannot be met above it."""
    best, reached = s1["prefix"]["best_hit_rate"], s1["prefix"]["hit_rate"]
    least = s1["least-request"]["hit_rate"]
    return (
        f"S1: the best possible hit rate on the prefix runs' prompts (one cache that never evicts) "
        f"is {best:.0%}, {best / least:.2f}x least request's measured {least:.0%}; prefix reached "
        f"{reached / best:.0%} of it."
    )


def plot(path: Path, table: dict[str, dict[str, dict]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    policies = list(table[names[0]])
    figure, (ttft, hits) = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(policies)
    for offset, policy in enumerate(policies):
        xs = [i + offset * width for i in range(len(names))]
        ttft.bar(xs, [table[n][policy]["ttft_p50"] for n in names], width, label=policy)
        hits.bar(xs, [table[n][policy]["hit_rate"] for n in names], width, label=policy)
    hits.set_ylim(0, 1.25)  # room for the legend above the bars
    for axis, label in ((ttft, "TTFT p50 (s)"), (hits, "prefix-cache hit rate")):
        axis.set_xticks([i + width for i in range(len(names))], names, fontsize=8)
        axis.set_ylabel(label)
        axis.legend()
    figure.suptitle("Two replicas, one core each: prefix affinity against least request")
    figure.tight_layout()
    figure.savefig(path, dpi=120)


def base_parser(doc: str, rounds: int) -> argparse.ArgumentParser:
    """A routing benchmark's command line: --rounds and --out."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser


def prepared(name: str) -> tuple[Path, PreTrainedTokenizerBase, Path]:
    """The default model's directory, its tokenizer, and a new directory for replica logs."""
    model_dir = prepare_default_model()
    logs = Path(tempfile.mkdtemp(prefix=f"{name}-"))
    print(f"replica logs in {logs}", flush=True)
    return model_dir, AutoTokenizer.from_pretrained(model_dir), logs


def main() -> None:
    parser = base_parser(__doc__, rounds=3)
    parser.add_argument(
        "--balance-factor", help="the keyed Envoys' load bound (default: facade.launch's)"
    )
    parser.add_argument(
        "--kv-cache-gib",
        type=float,
        default=KV_CACHE_GIB,
        help=f"each replica's KV cache (default {KV_CACHE_GIB})",
    )
    args = parser.parse_args()
    balance_args = ["--balance-factor", args.balance_factor] if args.balance_factor else []
    args.out.mkdir(parents=True, exist_ok=True)
    envoys = {**policy_envoys(balance_args), NO_REPORTS: ["--balance", "prefix", *balance_args]}
    no_reports = {NO_REPORTS: {"PICKER_LOAD_REPORTS": "off"}}
    model_dir, tokenizer, logs = prepared("bench-routing")
    with fleet_running(model_dir, logs, envoys, args.kv_cache_gib, no_reports) as fleet:
        results = run_rounds(fleet, WORKLOADS, list(envoys), args.rounds, tokenizer)
    table = summary(results)
    met = targets(table)
    document = {
        "settings": {
            "kv_cache_gib": args.kv_cache_gib,
            "prefix_tokens": PREFIX_TOKENS,
            "output_tokens": OUTPUT_TOKENS,
            "workloads": [asdict(w) for w in WORKLOADS],
            "rounds": args.rounds,
            "prefix_balance_args": balance_args,
        },
        "runs": results,
        "medians": table,
        "targets": met,
    }
    (args.out / "routing.json").write_text(json.dumps(document, indent=2))
    (args.out / "routing.md").write_text(markdown(table, met, args.rounds))
    plot(args.out / "routing.png", table)
    print(markdown(table, met, args.rounds))


if __name__ == "__main__":
    main()
