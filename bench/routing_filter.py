"""What keying a completion costs Envoy, by prompt length (`python -m bench.routing_filter`):
three Envoys started as facade.launch starts them in front of two replicas: `--balance prefix`
(the gRPC field extraction, routing.lua's key and path, a call to the replica picker),
`--balance prefix-hash` (the extraction and the key only) and `--balance least-request` (none of
these). No replica listens, so each request ends at the router with a 503, and the differences
between the Envoys' latencies are the keying alone. Requests go one at a time, to each Envoy
in turn; medians. Results in bench/results/routing-filter.md.

Usage: python -m bench.routing_filter [--requests N] [--out DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from bench.routing import RESULTS
from tests.processes import free_port

POLICIES = ("prefix", "prefix-hash", "least-request")
TEXT_BYTES = (1024, 16 * 1024, 128 * 1024, 256 * 1024)
TOKEN_IDS = (256, 4096, 32 * 1024)


@contextmanager
def envoys() -> Iterator[dict[str, str]]:
    """Each policy's Envoy in front of the same two addresses nothing listens on."""
    upstreams = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    processes, urls = [], {}
    try:
        for policy in POLICIES:
            http_port = free_port()
            command = [sys.executable, "-m", "facade.launch", "--balance", policy]
            command += ["--http-port", str(http_port), "--admin-port", str(free_port())]
            for upstream in upstreams:
                command += ["--upstream", upstream]
            processes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL))
            urls[policy] = f"http://127.0.0.1:{http_port}"
        for url in urls.values():
            wait_listening(url)
        yield urls
    finally:
        for process in processes:
            process.terminate()
            process.wait(timeout=30)


def wait_listening(url: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            httpx.get(f"{url}/v2/models", timeout=5)
            return
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def latency(client: httpx.Client, url: str, prompt: str | list[int]) -> float:
    body = {"model": "m", "prompt": prompt, "max_tokens": 1}
    started = time.perf_counter()
    reply = client.post(f"{url}/v2/completions", json=body)
    elapsed = time.perf_counter() - started
    if reply.status_code != 503:  # no replica: the router's answer
        raise RuntimeError(f"expected 503 from {url}, got {reply.status_code}: {reply.text[:200]}")
    return elapsed


def measure(urls: dict[str, str], prompt: str | list[int], requests: int) -> dict[str, float]:
    """Median milliseconds per request, per policy, over alternating requests."""
    seconds: dict[str, list[float]] = {policy: [] for policy in urls}
    with httpx.Client(timeout=30) as client:
        for _ in range(requests):
            for policy, url in urls.items():
                seconds[policy].append(latency(client, url, prompt))
    return {policy: 1000 * statistics.median(values) for policy, values in seconds.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    prompts: list[tuple[str, str | list[int]]] = [
        (f"{size // 1024} KiB of text", "word " * (size // 5)) for size in TEXT_BYTES
    ]
    prompts += [(f"{count} token ids", list(range(1, count + 1))) for count in TOKEN_IDS]
    lines = [
        f"# Keying a completion in Envoy: ms per request, medians of {args.requests}",
        "",
        "| prompt | " + " | ".join(POLICIES) + " |",
        "|---|" + "---|" * len(POLICIES),
    ]
    with envoys() as urls:
        measure(urls, "warm up", 20)
        for name, prompt in prompts:
            ms = measure(urls, prompt, args.requests)
            lines.append(f"| {name} | " + " | ".join(f"{ms[p]:.2f}" for p in POLICIES) + " |")
            print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing-filter.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
