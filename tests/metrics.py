"""Reading the service's Prometheus endpoint in tests."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families


def scrape(metrics_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample as {(name, sorted labels): value}."""
    text = httpx.get(metrics_url, timeout=10).text
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def sample(metrics_url: str, name: str, **labels: str) -> float:
    return scrape(metrics_url).get((name, tuple(sorted(labels.items()))), 0.0)


def engine_block_tokens(metrics_url: str) -> int:
    """The engine's KV-cache block size, from the configuration vLLM publishes in its metrics:
    prompts share cached tokens in whole blocks."""
    for (name, labels), _ in scrape(metrics_url).items():
        if name == "vllm:cache_config_info":
            return int(dict(labels)["block_size"])
    raise AssertionError(f"{metrics_url} publishes no vllm:cache_config_info")
