"""Prometheus metrics move when requests are served."""

from __future__ import annotations

import uuid

import httpx

from tests.conftest import MODEL
from tests.helpers import CAPITAL_PROMPT, body, complete, stream_chunks
from tests.metrics import sample, scrape

OK = {"method": "CreateCompletion", "code": "OK", "tenant": ""}


def test_metrics_move_after_requests(rest: httpx.Client, metrics_url: str) -> None:
    before = scrape(metrics_url)
    complete(rest, prompt=CAPITAL_PROMPT, max_tokens=4)
    stream_chunks(rest, prompt=CAPITAL_PROMPT, max_tokens=4)
    rest.post("/v2/completions", json=body(prompt="Hi", temperature=9))
    after = scrape(metrics_url)

    def grew(name: str, **labels: str) -> float:
        key = (name, tuple(sorted(labels.items())))
        return after.get(key, 0.0) - before.get(key, 0.0)

    assert grew("llmcompletions_requests_total", **OK) == 2
    assert grew("llmcompletions_requests_total", **{**OK, "code": "INVALID_ARGUMENT"}) == 1
    assert grew("llmcompletions_request_duration_seconds_count") == 3
    assert grew("llmcompletions_time_to_first_token_seconds_count") == 2
    # One observation for the one streamed request, not one per message.
    assert grew("llmcompletions_time_per_output_token_seconds_count") == 1
    assert grew("llmcompletions_prompt_tokens_total", tenant="") == 10
    assert grew("llmcompletions_completion_tokens_total", tenant="") == 8
    assert sample(metrics_url, "llmcompletions_requests_in_flight") == 0
    assert sample(metrics_url, "llmcompletions_engine_unfinished_requests") == 0


def test_engine_metrics_are_exposed(rest: httpx.Client, metrics_url: str) -> None:
    complete(rest, prompt=CAPITAL_PROMPT, max_tokens=2)
    names = {name for name, _ in scrape(metrics_url)}
    for engine_metric in (
        "vllm:kv_cache_usage_perc",
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:time_to_first_token_seconds_count",
        "vllm:inter_token_latency_seconds_count",
        "vllm:e2e_request_latency_seconds_count",
    ):
        assert engine_metric in names, engine_metric


def test_prefix_cache_hits_are_counted(rest: httpx.Client, metrics_url: str) -> None:
    """A long prompt sent twice: the second finds it in the prefix cache, and both our count
    of cached prompt tokens and vLLM's own hit counter grow by what the reply reported."""
    prompt = f"Metrics {uuid.uuid4()}: " + " ".join(f"line {i};" for i in range(100))
    complete(rest, prompt=prompt, max_tokens=1)
    before = scrape(metrics_url)
    cached = complete(rest, prompt=prompt, max_tokens=1)["usage"]["prompt_tokens_details"]
    after = scrape(metrics_url)

    def grew(name: str) -> float:  # over every label set (vLLM labels its own by engine)
        return sum(v for (n, _), v in after.items() if n == name) - sum(
            v for (n, _), v in before.items() if n == name
        )

    assert cached["cached_tokens"] > 0
    assert grew("llmcompletions_cached_prompt_tokens_total") == cached["cached_tokens"]
    assert grew("vllm:prefix_cache_hits_total") == cached["cached_tokens"]
    assert grew("vllm:prefix_cache_queries_total") > cached["cached_tokens"]


# What a Gateway API Inference Extension endpoint picker reads (its "model server protocol"),
# under vLLM's names: the queue, the running batch and the KV-cache use, per engine.
PICKER_GAUGES = (
    "vllm:num_requests_waiting",
    "vllm:num_requests_running",
    "vllm:kv_cache_usage_perc",
)


def test_endpoint_picker_metrics_are_published(rest: httpx.Client, metrics_url: str) -> None:
    """Each gauge once (one engine), labelled with the served model and the engine as vLLM
    labels it, holding a count or a fraction; and vllm:cache_config_info, whose `block_size`
    and `num_gpu_blocks` labels a picker's prefix-cache scorer parses as integers."""
    complete(rest, prompt=CAPITAL_PROMPT, max_tokens=2)
    samples = scrape(metrics_url)

    def only_series(name: str) -> tuple[dict[str, str], float]:
        found = [(dict(labels), value) for (n, labels), value in samples.items() if n == name]
        assert len(found) == 1, f"{metrics_url} publishes {len(found)} {name} series: {found}"
        return found[0]

    values: dict[str, float] = {}
    for name in PICKER_GAUGES:
        labels, values[name] = only_series(name)
        assert labels == {"model_name": MODEL, "engine": "0"}, name
    for name in ("vllm:num_requests_waiting", "vllm:num_requests_running"):
        assert values[name] >= 0 and values[name] == int(values[name]), name
    assert 0 <= values["vllm:kv_cache_usage_perc"] <= 1

    cache_config, value = only_series("vllm:cache_config_info")
    assert value == 1
    assert cache_config["engine"] == "0"
    assert int(cache_config["block_size"]) > 0
    assert int(cache_config["num_gpu_blocks"]) > 0
