"""The benchmark's workloads: random prompts, streaming, fixed output length (ignore_eos)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    name: str
    concurrency: int
    num_prompts: int
    input_len: int
    output_len: int


FULL = (
    Workload("c1", concurrency=1, num_prompts=8, input_len=64, output_len=64),
    Workload("c8", concurrency=8, num_prompts=32, input_len=64, output_len=64),
    Workload("c32", concurrency=32, num_prompts=96, input_len=64, output_len=64),
    Workload("long-prompt", concurrency=8, num_prompts=16, input_len=1000, output_len=32),
)
QUICK = (
    Workload("c1", concurrency=1, num_prompts=2, input_len=32, output_len=16),
    Workload("c8", concurrency=8, num_prompts=8, input_len=32, output_len=16),
)
