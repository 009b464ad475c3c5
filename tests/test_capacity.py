"""Capacity on real processes: the engine decides the batch, requests wait in the engine where
its scheduler orders them and its gauges show them, and only a backlog past the bounds is
refused (429 / RESOURCE_EXHAUSTED with a retry hint), at once and without harm to the rest.

The session's small engine runs a batch of 4, priority scheduling and small backlog bounds, so
that waiting, refusing and ordering show within seconds. (The default bounds, on the session
stack: tests/test_burst.py.)"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import httpx
import psutil
import pytest
from google.protobuf import json_format
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateChatCompletionRequest, CreateCompletionRequest

from service.api.errors import OverloadedError
from tests.conftest import (
    BOS_MODEL,
    MODEL,
    SMALL_BATCH,
    SMALL_QUEUED_REQS,
    SMALL_QUEUED_TOKENS,
    SmallStack,
)
from tests.metrics import GaugeWatch, scrape
from tests.processes import TestStack

BURST_PER_SURFACE = 256
# The small engine's max_num_seqs, --max-num-queued-reqs and --max-num-queued-tokens.
BATCH, QUEUED_REQS, QUEUED_TOKENS = SMALL_BATCH, SMALL_QUEUED_REQS, SMALL_QUEUED_TOKENS
RETRY_AFTER = str(OverloadedError.retry_after_seconds)
REFUSED_WITHIN_SECONDS = 1.0
RSS_GROWTH_BOUND = 128 * 1024 * 1024


def capacity(metrics_url: str) -> dict[str, float]:
    """The limits in force, as /metrics shows them."""
    return {
        dict(labels)["limit"]: value
        for (name, labels), value in scrape(metrics_url).items()
        if name == "llmcompletions_capacity"
    }


@dataclass
class Outcome:
    """How one streamed request ended, and when (time.monotonic()) it started, got its first
    token and ended."""

    status: str  # "200", "429", "OK", "RESOURCE_EXHAUSTED", ...
    started: float
    first_token_at: float | None = None
    ended: float = 0.0
    retry_after: str | None = None
    detail: str = ""
    finish_reasons: list[str] = field(default_factory=list)

    def token_arrived(self) -> None:
        if self.first_token_at is None:
            self.first_token_at = time.monotonic()


def completion(prompt: str | list[int], **fields: Any) -> dict[str, Any]:
    """A streamed completion for whichever model the surfaces serve."""
    return {"prompt": prompt, "stream": True, "ignore_eos": True, **fields}


async def rest_stream(client: httpx.AsyncClient, payload: dict[str, Any]) -> Outcome:
    outcome = Outcome("", started=time.monotonic())
    async with client.stream("POST", "/v2/completions", json=payload) as response:
        outcome.status = str(response.status_code)
        if response.status_code != 200:
            outcome.detail = (await response.aread()).decode()
            outcome.retry_after = response.headers.get("retry-after")
            outcome.ended = time.monotonic()
            return outcome
        events = []
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                outcome.token_arrived()
        assert events[-1] == "[DONE]", events[-3:]
        for event in events[:-1]:
            choices = json.loads(event)["choices"]
            outcome.finish_reasons += [
                c["finish_reason"] for c in choices if c.get("finish_reason")
            ]
    outcome.ended = time.monotonic()
    return outcome


async def grpc_stream(
    stub: completions_pb2_grpc.CompletionServiceStub,
    payload: dict[str, Any],
    metadata: tuple[tuple[str, str], ...] = (),
) -> Outcome:
    request = json_format.ParseDict(payload, CreateCompletionRequest())
    outcome = Outcome("OK", started=time.monotonic())
    try:
        async for message in stub.CreateCompletion(request, timeout=600, metadata=metadata):
            outcome.token_arrived()
            outcome.finish_reasons += [c.finish_reason for c in message.choices if c.finish_reason]
    except grpc.aio.AioRpcError as error:
        outcome.status = error.code().name
        outcome.detail = error.details() or ""
        outcome.retry_after = dict(error.trailing_metadata() or ()).get("retry-after")
    outcome.ended = time.monotonic()
    return outcome


@dataclass
class Surfaces:
    """Async clients of one stack's two surfaces."""

    rest: httpx.AsyncClient
    grpc: completions_pb2_grpc.CompletionServiceStub
    grpc_metadata: tuple[tuple[str, str], ...] = ()
    model: str = MODEL

    def rest_call(self, payload: dict[str, Any]) -> Any:
        return rest_stream(self.rest, {"model": self.model, **payload})

    def grpc_call(self, payload: dict[str, Any], metadata: tuple[tuple[str, str], ...] = ()) -> Any:
        request = {"model": self.model, **payload}
        return grpc_stream(self.grpc, request, self.grpc_metadata + metadata)


@contextlib.asynccontextmanager
async def surfaces(
    stack: TestStack,
    headers: dict[str, str],
    metadata: tuple[tuple[str, str], ...],
    model: str = MODEL,
) -> AsyncIterator[Surfaces]:
    # As many connections as requests: each REST call in flight holds one.
    limits = httpx.Limits(max_connections=2 * BURST_PER_SURFACE)
    async with (
        httpx.AsyncClient(
            base_url=stack.base_url, headers=headers, timeout=600, limits=limits
        ) as rest,
        grpc.aio.insecure_channel(stack.grpc_target) as channel,
    ):
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        yield Surfaces(rest, stub, metadata, model)


def tree_rss(pid: int) -> int:
    process = psutil.Process(pid)
    return sum(p.memory_info().rss for p in [process, *process.children(recursive=True)])


def wait_until_idle(metrics_url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while GaugeWatch(metrics_url, ("llmcompletions_engine_unfinished_requests",)).current()[
        "llmcompletions_engine_unfinished_requests"
    ]:
        assert time.monotonic() < deadline, "engine requests left running"
        time.sleep(0.2)


# ---- a small engine: a batch of 4, priority scheduling, small backlog bounds


@pytest.fixture(scope="module")
def small(small_stack: SmallStack) -> TestStack:
    """The session's small engine (tests/test_service_lifecycle.py uses it next, and stops it)."""
    return small_stack.stack


def small_metrics(small: TestStack) -> str:
    return small.metrics_url


def test_the_small_engine_shows_its_limits(small: TestStack) -> None:
    assert capacity(small_metrics(small)) == {
        "max_num_seqs": BATCH,
        "max_num_batched_tokens": 2048,
        "max_num_queued_reqs": QUEUED_REQS,
        "max_num_queued_tokens": QUEUED_TOKENS,
    }


def test_the_engine_runs_its_batch_and_no_more_and_the_rest_waits_in_view(
    small: TestStack,
) -> None:
    requests = 4 * BATCH

    async def load() -> list[Outcome]:
        async with surfaces(small, {}, (), BOS_MODEL) as on:
            payload = completion("Count to ten:", max_tokens=12)
            return await asyncio.gather(*(on.grpc_call(payload) for _ in range(requests)))

    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    with GaugeWatch(small_metrics(small), gauges) as watch:
        outcomes = asyncio.run(load())
    assert [outcome.status for outcome in outcomes] == ["OK"] * requests
    assert watch.peaks["vllm:num_requests_running"] == BATCH
    assert watch.peaks["vllm:num_requests_waiting"] >= requests - 2 * BATCH


async def gauge_reaches(metrics_url: str, name: str, value: float, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    watch = GaugeWatch(metrics_url, (name,))
    while (await asyncio.to_thread(watch.current))[name] < value:
        assert time.monotonic() < deadline, f"{name} did not reach {value}"
        await asyncio.sleep(0.05)


async def occupied_batch(
    on: Surfaces, metrics_url: str, max_tokens: int, n: int = 1, **fields: Any
) -> list[asyncio.Future[Outcome]]:
    """Requests that fill the engine's batch (one sampling n, or n of them), running once
    this returns; whatever is sent next waits behind them for `max_tokens` steps."""
    busy = completion("Count:", max_tokens=max_tokens, n=n, temperature=1.0, **fields)
    running = [asyncio.ensure_future(on.grpc_call(busy)) for _ in range(BATCH // n)]
    await gauge_reaches(metrics_url, "vllm:num_requests_running", BATCH)
    return running


async def chat_calls(on: Surfaces) -> list[Outcome]:
    """One chat request on each surface, whole: how each ended."""
    body = {"model": on.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    rest = Outcome("", started=time.monotonic())
    response = await on.rest.post("/v2/chat/completions", json=body)
    rest.status, rest.detail = str(response.status_code), response.text
    rest.retry_after, rest.ended = response.headers.get("retry-after"), time.monotonic()
    request = json_format.ParseDict(body, CreateChatCompletionRequest())
    grpc_call = Outcome("OK", started=time.monotonic())
    try:
        async for _ in on.grpc.CreateChatCompletion(request, timeout=60):
            pass
    except grpc.aio.AioRpcError as error:
        grpc_call.status, grpc_call.detail = error.code().name, error.details() or ""
        grpc_call.retry_after = dict(error.trailing_metadata() or ()).get("retry-after")
    grpc_call.ended = time.monotonic()
    return [rest, grpc_call]


def refused_at_once(outcome: Outcome) -> bool:
    return outcome.retry_after == RETRY_AFTER and outcome.ended - outcome.started < (
        REFUSED_WITHIN_SECONDS
    )


def test_past_the_backlog_bound_requests_are_refused_at_once_and_the_rest_is_served(
    small: TestStack,
) -> None:
    metrics_url = small_metrics(small)
    # The batch's call and the holders behind it, each sampling n=4: the backlog's forty sequences.
    holders = QUEUED_REQS // BATCH
    service_pid = small.processes[0].pid

    async def scenario() -> tuple[list[Outcome], list[Outcome], int]:
        async with surfaces(small, {}, (), BOS_MODEL) as on:
            # The first call fills the batch until the flood is over (a busy host makes the
            # flood take many engine steps); the holders wait behind it.
            batch = await occupied_batch(on, metrics_url, max_tokens=400, n=BATCH)
            held = completion("Tell me a story.", max_tokens=4, n=BATCH, temperature=1.0)
            holding = [asyncio.ensure_future(on.grpc_call(held)) for _ in range(holders - 1)]
            await gauge_reaches(
                metrics_url, "llmcompletions_engine_unfinished_requests", QUEUED_REQS
            )
            rss_before = tree_rss(service_pid)
            over = completion("Hi", max_tokens=2)
            refused: list[Outcome] = []
            for _ in range(5):  # a flood, 40 at a time, on both surfaces
                refused += await asyncio.gather(
                    *(on.rest_call(over) for _ in range(20)),
                    *(on.grpc_call(over) for _ in range(20)),
                )
            growth = tree_rss(service_pid) - rss_before
            refused += await chat_calls(on)
            for running in batch:  # its caller leaves: the holders' turn
                running.cancel()
            return await asyncio.gather(*holding), refused, growth

    served, refused, growth = asyncio.run(scenario())
    assert [outcome.status for outcome in served] == ["OK"] * (holders - 1)
    assert all(outcome.finish_reasons == ["length"] * BATCH for outcome in served)
    assert collections.Counter(outcome.status for outcome in refused) == {
        "429": 101,
        "RESOURCE_EXHAUSTED": 101,
    }
    assert all(refused_at_once(outcome) for outcome in refused)
    assert all("at capacity" in outcome.detail for outcome in refused)
    assert growth < RSS_GROWTH_BOUND, f"the service grew by {growth / 2**20:.0f} MiB"
    wait_until_idle(metrics_url)


def test_a_full_prefill_backlog_is_refused_until_it_drains(small: TestStack) -> None:
    metrics_url = small_metrics(small)
    long_prompt = list(range(1000, 1000 + QUEUED_TOKENS // 5))  # five of them fill the bound

    async def scenario() -> tuple[list[Outcome], Outcome, Outcome]:
        async with surfaces(small, {}, (), BOS_MODEL) as on:
            batch = await occupied_batch(on, metrics_url, max_tokens=400)
            waiting = [
                asyncio.ensure_future(on.rest_call(completion(long_prompt, max_tokens=1)))
                for _ in range(5)
            ]
            await gauge_reaches(metrics_url, "llmcompletions_queued_prompt_tokens", QUEUED_TOKENS)
            refused = await on.rest_call(completion("Hi", max_tokens=1))
            for running in batch:  # the callers leave: their engine work stops
                running.cancel()
            served = await asyncio.gather(*waiting)
            after = await on.rest_call(completion("Hi", max_tokens=1))
            return served, refused, after

    served, refused, after = asyncio.run(scenario())
    assert refused.status == "429" and refused_at_once(refused)
    assert "prompt tokens waiting to be prefilled" in refused.detail
    assert [outcome.status for outcome in served] == ["200"] * 5
    assert after.status == "200"
    wait_until_idle(metrics_url)


def test_a_high_priority_request_starts_before_earlier_low_priority_ones(
    small: TestStack,
) -> None:
    metrics_url = small_metrics(small)
    low_requests = BATCH + 24

    async def scenario() -> tuple[list[Outcome], Outcome, float, int]:
        async with surfaces(small, {}, (), BOS_MODEL) as on:
            lows = await occupied_batch(on, metrics_url, max_tokens=32, priority=10)
            low = completion("Count:", max_tokens=4, priority=10)
            lows += [asyncio.ensure_future(on.grpc_call(low)) for _ in range(low_requests - BATCH)]
            await gauge_reaches(metrics_url, "vllm:num_requests_waiting", 20)
            waiting = GaugeWatch(metrics_url, ("vllm:num_requests_waiting",)).current()
            sent_at = time.monotonic()
            high = await on.grpc_call(completion("Count:", max_tokens=16, priority=-10))
            return (
                await asyncio.gather(*lows),
                high,
                sent_at,
                int(waiting["vllm:num_requests_waiting"]),
            )

    lows, high, sent_at, waiting = asyncio.run(scenario())
    assert high.status == "OK" and all(outcome.status == "OK" for outcome in lows)
    assert waiting >= 20
    assert high.first_token_at is not None
    earlier_and_waiting = [
        outcome for outcome in lows if outcome.first_token_at and outcome.first_token_at > sent_at
    ]
    assert len(earlier_and_waiting) >= 20
    started_first = [
        outcome
        for outcome in earlier_and_waiting
        if outcome.first_token_at is not None and outcome.first_token_at < high.first_token_at
    ]
    # Only requests scheduled in the same engine step as the high-priority one may show their
    # first token a moment before it; first come, first served would start all of them first.
    assert len(started_first) <= BATCH - 1, (len(started_first), len(earlier_and_waiting))
    wait_until_idle(metrics_url)


def test_a_queued_request_is_cancelled_by_its_id_and_leaves_the_queue(small: TestStack) -> None:
    """Waiting behind a full batch, not yet started: the cancel takes it out of the engine's
    queue, its call ends CANCELLED at once, and the batch runs on."""
    metrics_url = small_metrics(small)
    request_id = f"queued-{uuid.uuid4().hex}"
    tagged = (("x-request-id", request_id),)

    async def scenario() -> tuple[list[Outcome], Outcome, int]:
        async with surfaces(small, {}, (), BOS_MODEL) as on:
            running = await occupied_batch(on, metrics_url, max_tokens=64)
            queued = asyncio.ensure_future(on.grpc_call(completion("Count:", max_tokens=8), tagged))
            await gauge_reaches(metrics_url, "vllm:num_requests_waiting", 1)
            answer = await on.rest.post(f"/v2/completions/{request_id}/cancel")
            assert answer.status_code == 200, answer.text
            cancelled = await queued
            await gauge_falls_to(metrics_url, "vllm:num_requests_waiting", 0)
            return await asyncio.gather(*running), cancelled, answer.json()["cancelled"]

    running, cancelled, count = asyncio.run(scenario())
    assert count == 1
    assert cancelled.status == "CANCELLED" and cancelled.first_token_at is None
    assert [outcome.status for outcome in running] == ["OK"] * BATCH
    wait_until_idle(metrics_url)


async def gauge_falls_to(metrics_url: str, name: str, value: float, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    watch = GaugeWatch(metrics_url, (name,))
    while (await asyncio.to_thread(watch.current))[name] > value:
        assert time.monotonic() < deadline, f"{name} did not fall to {value}"
        await asyncio.sleep(0.05)
