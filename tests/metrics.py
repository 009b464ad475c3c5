"""Reading the service's Prometheus endpoint in tests."""

from __future__ import annotations

import threading

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


class GaugeWatch:
    """Polls /metrics in a thread while a block runs: the highest value each gauge took
    (summed over its label sets, e.g. vLLM's per-engine gauges)."""

    def __init__(self, metrics_url: str, names: tuple[str, ...]) -> None:
        self.metrics_url = metrics_url
        self.names = names
        self.peaks = dict.fromkeys(names, 0.0)
        self._stop = threading.Event()

    def current(self) -> dict[str, float]:
        totals = dict.fromkeys(self.names, 0.0)
        for (name, _), value in scrape(self.metrics_url).items():
            if name in totals:
                totals[name] += value
        return totals

    def _poll(self) -> None:
        while not self._stop.is_set():
            for name, value in self.current().items():
                self.peaks[name] = max(self.peaks[name], value)
            self._stop.wait(0.05)

    def __enter__(self) -> GaugeWatch:
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()
