"""A gRPC load generator of the same shape as vLLM's serving benchmark client: the same
prompts, streaming, a concurrency cap, and the same metric definitions."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
from google.protobuf import json_format
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateCompletionRequest, CreateCompletionResponse


@dataclass
class RequestTiming:
    failed: str = ""  # the status code of a call that failed (e.g. RESOURCE_EXHAUSTED)
    ttft: float = 0.0
    latency: float = 0.0
    output_tokens: int = 0
    output_messages: int = 0  # messages carrying output (text or not), the usage one aside
    gaps: list[float] = field(default_factory=list)


async def one_request(
    stub: completions_pb2_grpc.CompletionServiceStub, request: CreateCompletionRequest
) -> RequestTiming:
    timing = RequestTiming()
    started = time.perf_counter()
    try:
        await receive(stub.CreateCompletion(request, timeout=600), timing, started)
    except grpc.aio.AioRpcError as error:
        timing.failed = error.code().name
    timing.latency = time.perf_counter() - started
    return timing


async def receive(
    call: AsyncIterator[CreateCompletionResponse], timing: RequestTiming, started: float
) -> None:
    last = started
    async for message in call:
        now = time.perf_counter()
        # A token can arrive with no text yet (part of a character): a message all the same.
        timing.output_messages += 1 if message.choices else 0
        if message.choices and message.choices[0].text:
            if timing.ttft == 0.0:
                timing.ttft = now - started
            else:
                timing.gaps.append(now - last)
            last = now
        if message.HasField("usage"):
            timing.output_tokens = message.usage.completion_tokens


async def run_load(
    target: str | Sequence[str],
    model: str,
    prompts: list[str],
    output_len: int,
    concurrency: int,
) -> dict[str, Any]:
    """The prompts streamed, `concurrency` at a time; over several targets (a replica's
    frontends), one channel each, the requests dealt out in turn."""
    gate = asyncio.Semaphore(concurrency)
    targets = [target] if isinstance(target, str) else list(target)
    async with contextlib.AsyncExitStack() as channels:
        stubs = [
            completions_pb2_grpc.CompletionServiceStub(
                await channels.enter_async_context(grpc.aio.insecure_channel(address))
            )
            for address in targets
        ]

        async def bounded(index: int, prompt: str) -> RequestTiming:
            request = json_format.ParseDict(
                {
                    "model": model,
                    "prompt": prompt,
                    "max_tokens": output_len,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
                CreateCompletionRequest(),
            )
            async with gate:
                return await one_request(stubs[index % len(stubs)], request)

        started = time.perf_counter()
        timings = await asyncio.gather(*(bounded(i, prompt) for i, prompt in enumerate(prompts)))
        duration = time.perf_counter() - started
    return summarize(timings, duration)


def summarize(timings: list[RequestTiming], duration: float) -> dict[str, Any]:
    """The metrics vLLM's serving benchmark reports, by its definitions (milliseconds), over
    the requests that completed; the failed ones are counted, as vLLM's client counts them."""
    failed = [t for t in timings if t.failed]
    timings = [t for t in timings if not t.failed]
    ttfts = [t.ttft for t in timings] or [0.0]
    tpots = [(t.latency - t.ttft) / (t.output_tokens - 1) for t in timings if t.output_tokens > 1]
    itls = [gap for t in timings for gap in t.gaps]
    output_tokens = sum(t.output_tokens for t in timings)
    return {
        "duration": duration,
        "completed": len(timings),
        "failed": len(failed),
        "failed_codes": sorted({t.failed for t in failed}),
        "total_output_tokens": output_tokens,
        "output_throughput": output_tokens / duration,
        "median_ttft_ms": float(np.median(ttfts)) * 1000,
        "p99_ttft_ms": float(np.percentile(ttfts, 99)) * 1000,
        "median_tpot_ms": float(np.median(tpots)) * 1000 if tpots else 0.0,
        "median_itl_ms": float(np.median(itls)) * 1000 if itls else 0.0,
        "p99_itl_ms": float(np.percentile(itls, 99)) * 1000 if itls else 0.0,
        # Below 1 when deltas were merged (the engine got ahead of the stream).
        "messages_per_token": sum(t.output_messages for t in timings) / max(output_tokens, 1),
    }
