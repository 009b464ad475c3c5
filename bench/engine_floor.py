"""The floor both frontends stand on: CPU per generated token of vLLM's in-process engine client
(engine-core messages, output processing, incremental detokenization, per-request queues) with
no transport at all.

Builds the engine exactly as our service does, runs the frontend-heavy workloads on it in this
process, and reads each stream's deltas without sending them anywhere. vLLM's OpenAI server
and ours both pay this for every token; what each pays above it is its transport (HTTP and SSE,
or gRPC and Envoy) and its own per-token code.

Usage: python -m bench.engine_floor [--out FILE]   (prints, or writes, JSON by workload name)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import uvloop
from vllm.inputs import TokensPrompt
from vllm.sampling_params import RequestOutputKind, SamplingParams
from vllm.v1.engine.async_llm import AsyncLLM

from bench.frontend_heavy import FRONTEND_HEAVY
from bench.profile import Roles
from bench.run import MODEL, same_prompts
from bench.servers import ENGINE_ARGS
from bench.tiny_model import prepare_tiny_model
from bench.workloads import Workload
from service.model.engine import start_engine
from service.settings import EngineSettings

WARMUP = Workload("warmup", concurrency=4, num_prompts=4, input_len=16, output_len=8)


async def one_stream(engine: AsyncLLM, prompt_ids: list[int], output_len: int, key: str) -> int:
    """Generate one completion as a streaming call does (deltas); return its token count."""
    params = SamplingParams(
        max_tokens=output_len, ignore_eos=True, output_kind=RequestOutputKind.DELTA
    )
    tokens = 0
    async for output in engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params, key):
        tokens += len(output.outputs[0].token_ids)
    return tokens


async def run_workload(engine: AsyncLLM, prompts: list[list[int]], workload: Workload) -> int:
    gate = asyncio.Semaphore(workload.concurrency)

    async def bounded(index: int, prompt_ids: list[int]) -> int:
        async with gate:
            return await one_stream(engine, prompt_ids, workload.output_len, f"{workload}-{index}")

    counts = await asyncio.gather(*(bounded(i, ids) for i, ids in enumerate(prompts)))
    return sum(counts)


async def measure(model_dir: Path) -> dict[str, Any]:
    settings = EngineSettings(
        model=model_dir,
        served_model_name=MODEL,
        dtype=str(ENGINE_ARGS["dtype"]),
        max_model_len=int(ENGINE_ARGS["max_model_len"]),
        kv_cache_gib=float(ENGINE_ARGS["kv_cache_gib"]),
        extra_engine_args={"enable_prefix_caching": False},
    )
    served = await asyncio.to_thread(start_engine, settings)
    encode = served.tokenizer.encode
    this_process = Roles(os.getpid())  # the engine core is its child
    results: dict[str, Any] = {}
    try:
        await run_workload(served.engine, [encode("warm up")] * WARMUP.num_prompts, WARMUP)
        for workload in FRONTEND_HEAVY:
            prompts = [encode(text) for text in same_prompts(model_dir, workload)]
            started, cpu_before = time.perf_counter(), this_process.cpu_seconds()
            tokens = await run_workload(served.engine, prompts, workload)
            cpu_after, duration = this_process.cpu_seconds(), time.perf_counter() - started
            per_token = {
                role: (cpu_after[role] - cpu_before[role]) * 1000 / max(tokens, 1)
                for role in cpu_after
            }
            results[workload.name] = {
                # As the servers' records: the one "path" here is no transport at all.
                "none": {"output_throughput": tokens / duration, "cpu_ms_per_token": per_token}
            }
            print(
                f"engine floor: {workload.name}: {per_token['frontend'] * 1000:.1f} us of "
                f"CPU per token in the engine client, {tokens / duration:.0f} tok/s",
                flush=True,
            )
    finally:
        served.engine.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, help="write the JSON here instead of printing it")
    options = parser.parse_args()
    results = uvloop.run(measure(prepare_tiny_model()))
    text = json.dumps(results, indent=2)
    if options.out is None:
        print(text)
    else:
        options.out.write_text(text)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
