"""bench/routing.py's arithmetic: hit rates and shares from the replicas' counters, medians over
rounds, the targets, and the workloads' prompts (no engine, no Envoy)."""

from __future__ import annotations

import random

import pytest

from bench import routing, routing_keys
from facade.balancing import PrefixAffinity


class WordCount:
    """A tokenizer stand-in: one token a word."""

    def __call__(self, text: str) -> dict[str, list[int]]:
        return {"input_ids": [0] * len(text.split())}


def counters(queries: float, hits: float, requests: float) -> dict[str, float]:
    return {"queries": queries, "hits": hits, "requests": requests}


def test_hit_rates_and_shares_come_from_what_each_replica_counted() -> None:
    before = [counters(100, 50, 10), counters(0, 0, 0)]
    after = [counters(1100, 950, 40), counters(1000, 100, 10)]
    measured = routing.per_replica(before, after)
    assert measured["hit_rate"] == pytest.approx(1000 / 2000)
    assert measured["replica_hit_rates"] == [pytest.approx(0.9), pytest.approx(0.1)]
    assert measured["replica_shares"] == [pytest.approx(0.75), pytest.approx(0.25)]


def run(ttft: float, hit_rate: float, throughput: float = 10.0) -> dict:
    return {
        "ttft_p50": ttft,
        "ttft_p90": 2 * ttft,
        "output_throughput": throughput,
        "hit_rate": hit_rate,
        "best_hit_rate": 0.95,
        "replica_hit_rates": [hit_rate, hit_rate],
        "replica_shares": [0.6, 0.4],
    }


def results(prefix: dict, least: dict) -> dict:
    return {
        w.name: {"least-request": [least] * 3, "prefix": [prefix] * 3} for w in routing.WORKLOADS
    }


def test_the_targets_compare_prefix_with_least_request() -> None:
    met = routing.targets(routing.summary(results(run(0.5, 0.9), run(2.0, 0.3))))
    assert all(t["met"] for t in met), met
    hit_ratio, ttft_ratio = (t["measured"] for t in met[:2])
    assert (hit_ratio, ttft_ratio) == (3.0, 0.25)
    assert met[-1]["target"].startswith("S1 hit rate, prefix / best possible")
    assert met[-1]["measured"] == round(0.9 / 0.95, 3)
    missed = routing.targets(routing.summary(results(run(2.0, 0.3), run(1.0, 0.3))))
    assert [t["met"] for t in missed] == [False, False, False, True, False, True, False]


def test_medians_over_rounds() -> None:
    table = routing.summary(
        {
            "w": {
                policy: [run(1.0, 0.1), run(3.0, 0.5), run(2.0, 0.9)] for policy in routing.POLICIES
            }
        }
    )
    assert table["w"]["prefix"]["ttft_p50"] == 2.0
    assert table["w"]["prefix"]["hit_rate"] == 0.5
    assert table["w"]["prefix"]["min_replica_share"] == 0.4


def test_each_prompt_is_a_shared_prefix_and_a_suffix_of_its_own() -> None:
    workload = routing.Workload("w", prefixes=3, requests=30, concurrency=2)
    chosen = routing.prompts(workload, random.Random(1), WordCount())
    prefixes = {prompt.split("\nQuestion:")[0] for prompt in chosen}
    assert len(prefixes) == 3
    assert all(len(prefix.split()) >= routing.PREFIX_TOKENS for prefix in prefixes)
    assert len(set(chosen)) == len(chosen)


def test_a_hot_prefix_takes_its_share() -> None:
    workload = routing.Workload("hot", prefixes=5, requests=400, concurrency=2, hot_share=0.8)
    chosen = routing.prompts(workload, random.Random(2), WordCount())
    heads = [prompt.split("\nQuestion:")[0] for prompt in chosen]
    hottest = max(set(heads), key=heads.count)
    assert 0.75 < heads.count(hottest) / len(heads) < 0.85


def test_the_best_possible_hit_rate_reuses_whole_shared_blocks_of_earlier_prompts() -> None:
    document, other = list(range(10)), list(range(100, 110))
    token_ids = [
        [*document, 50],  # first sight: nothing to reuse
        [*document, 51, 52],  # shares 10 tokens: two whole blocks of 4
        [*other, 60],  # a new document
        [*document, 53],  # shares 10 tokens with the first two
        list(range(7)),  # shares all 7 with the document, but its last token is computed: 1 block
    ]
    total = 11 + 12 + 11 + 11 + 7
    assert routing.best_hit_rate(token_ids, block_tokens=4) == pytest.approx((8 + 8 + 4) / total)
    assert routing.best_hit_rate(token_ids, block_tokens=16) == 0.0


def test_the_report_says_how_close_prefix_came_to_the_best_possible_on_s1() -> None:
    table = routing.summary(results(run(0.5, 0.76), run(2.0, 0.38)))
    line = routing.markdown(table, routing.targets(table), rounds=3).splitlines()[-1]
    assert line.startswith("S1: the best possible hit rate")
    assert "is 95%, 2.50x least request's measured 38%; prefix reached 80% of it." in line


def test_a_header_opens_every_prompt_ahead_of_its_document() -> None:
    workload = routing.Workload(
        "w", prefixes=4, requests=20, concurrency=2, prefix_tokens=300, header_tokens=50
    )
    chosen = routing.prompts(workload, random.Random(3), WordCount())
    headers = {prompt.split("\nDocument ")[0] for prompt in chosen}
    assert len(headers) == 1
    (header,) = headers
    assert header.startswith("Instructions ") and 50 <= len(header.split()) < 70
    documents = {prompt.split("\nQuestion:")[0].removeprefix(header) for prompt in chosen}
    assert len(documents) == 4
    assert all(300 <= len(document.split()) < 360 for document in documents)


def test_each_envoy_gets_its_balancing_and_is_watched_on_its_completion_cluster() -> None:
    envoys = routing.policy_envoys(["--balance-factor", "150"])
    assert envoys == {
        "least-request": ["--balance", "least-request"],
        "prefix-hash": ["--balance", "prefix-hash", "--balance-factor", "150"],
        "prefix": ["--balance", "prefix", "--balance-factor", "150"],
    }
    clusters = {name: routing.completion_cluster(args) for name, args in envoys.items()}
    assert clusters == {
        "least-request": "completion_service",
        "prefix-hash": "completion_service_prefix",
        "prefix": "completion_service_prefix",
    }


@pytest.mark.parametrize("sent_as", ["", ", as token ids"])
def test_the_long_instructions_reach_past_the_default_key(sent_as: str) -> None:
    (workload,) = [
        w for w in routing_keys.WORKLOADS if w.name == f"long instructions, then documents{sent_as}"
    ]
    shared = routing_keys.depths(workload, WordCount())["shared by every prompt"]
    key = PrefixAffinity().tokens if workload.token_ids else PrefixAffinity().chars
    assert shared > key
