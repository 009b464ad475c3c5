"""Bounded soak: hundreds of mixed requests at high concurrency through Envoy. Every request
is accounted for, the engine ends with no unfinished requests, and the service's resident
memory stays within RSS_GROWTH_BOUND of where it started."""

from __future__ import annotations

import asyncio
import collections
import time

import httpx
import psutil

from service.api.errors import OverloadedError
from tests.conftest import AUTH_HEADERS
from tests.helpers import body
from tests.metrics import sample
from tests.processes import TestStack

REQUESTS = 320
CONCURRENCY = 40  # well within the default backlog bounds: nothing may be refused
RETRY_AFTER_SECONDS = OverloadedError.retry_after_seconds
MAX_ATTEMPTS = 60
RSS_GROWTH_BOUND = 256 * 1024 * 1024
KINDS = ("plain", "stream", "cancelled", "invalid")


def tree_rss(pid: int) -> int:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


async def with_retries(client: httpx.AsyncClient, kind: str, refusals: list[int]) -> str:
    """Like a well-behaved client: on 429, wait as the retry hint says, and try again."""
    for _ in range(MAX_ATTEMPTS):
        outcome = await one_request(client, kind)
        if outcome != "refused":
            return outcome
        refusals.append(1)
        await asyncio.sleep(RETRY_AFTER_SECONDS)
    return "refused"


async def one_request(client: httpx.AsyncClient, kind: str) -> str:
    """How the request ended: ok, refused (429 with a retry hint), rejected (422), cancelled."""
    payload = body(prompt="Tell me a story.", max_tokens=8, temperature=0.7)
    if kind == "invalid":
        payload["temperature"] = 9
    if kind in ("stream", "cancelled"):
        payload["stream"] = True
    async with client.stream("POST", "/v2/completions", json=payload) as response:
        if response.status_code == 429:
            assert response.headers["retry-after"] == str(RETRY_AFTER_SECONDS)
            return "refused"
        if response.status_code == 422:
            return "rejected"
        assert response.status_code == 200, await response.aread()
        events = []
        async for line in response.aiter_lines():
            if line:
                events.append(line)
                if kind == "cancelled":
                    return "cancelled"  # leaving the block drops the connection
        if kind == "stream":
            assert events[-1] == "data: [DONE]"
        return "ok"


async def soak(stack: TestStack, refusals: list[int]) -> collections.Counter[tuple[str, str]]:
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(
        base_url=stack.base_url, headers=AUTH_HEADERS, timeout=300, limits=limits
    ) as client:
        gate = asyncio.Semaphore(CONCURRENCY)

        async def run(index: int) -> tuple[str, str]:
            kind = KINDS[index % len(KINDS)]
            async with gate:
                return kind, await with_retries(client, kind, refusals)

        return collections.Counter(await asyncio.gather(*(run(i) for i in range(REQUESTS))))


def test_soak_accounts_for_every_request(stack: TestStack, metrics_url: str) -> None:
    service_pid = stack.processes[0].pid
    rss_before = tree_rss(service_pid)
    started = time.monotonic()
    refusals: list[int] = []
    outcomes = asyncio.run(soak(stack, refusals))
    elapsed = time.monotonic() - started
    print(
        f"soak: {REQUESTS} requests in {elapsed:.1f}s at concurrency {CONCURRENCY}, "
        f"{len(refusals)} refusals (429) retried: {dict(outcomes)}"
    )

    assert sum(outcomes.values()) == REQUESTS
    expected = {"plain": "ok", "stream": "ok", "cancelled": "cancelled", "invalid": "rejected"}
    assert outcomes == {
        (kind, outcome): REQUESTS // len(KINDS) for kind, outcome in expected.items()
    }
    assert not refusals, "requests were refused at a load the default backlog bounds admit"

    deadline = time.monotonic() + 10
    while sample(metrics_url, "llmcompletions_engine_unfinished_requests") != 0:
        assert time.monotonic() < deadline, "engine requests left running after the soak"
        time.sleep(0.2)
    assert sample(metrics_url, "llmcompletions_requests_in_flight") == 0
    assert sample(metrics_url, "llmcompletions_requests_preparing") == 0
    rss_after = tree_rss(service_pid)
    print(f"soak: service RSS {rss_before / 2**20:.0f} MiB -> {rss_after / 2**20:.0f} MiB")
    assert rss_after - rss_before < RSS_GROWTH_BOUND
