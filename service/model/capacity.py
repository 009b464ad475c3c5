"""A replica's capacity: the batch the engine resolved for its device, and the backlog bounds
derived from it (vLLM's `max_num_queued_reqs` and `max_num_queued_tokens`).

Nothing here is tuned to one machine. vLLM sizes the batch from the device and the usage
context (an API server: 128 sequences on a CPU, 256 on most GPUs, 1,024 on an H100/H200); the
backlog a replica accepts is a multiple of what that batch runs, so it grows with the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the command line reads the constants below without importing vLLM
    from vllm.config import VllmConfig

# Requests waiting or running, in batches of the engine: a burst of this many times the
# batch queues in the engine (where its scheduler orders it and vllm:num_requests_waiting
# shows it) before a request is refused.
QUEUED_BATCHES = 8
# Prompt tokens not yet prefilled, in engine steps' worth of prefill (max_num_batched_tokens
# each): the TTFT budget of the last request admitted, in units of the device's own step.
QUEUED_PREFILL_STEPS = 128


@dataclass(frozen=True)
class Capacity:
    """What the engine runs at once and the backlog past which requests are refused."""

    max_num_seqs: int  # sequences running at once, over every data-parallel rank
    max_num_batched_tokens: int  # tokens one engine step processes (one rank)
    max_num_queued_reqs: int  # sequences waiting or running
    max_num_queued_tokens: int  # prompt tokens of requests not yet past prefill


def default_queued_reqs(max_num_seqs: int) -> int:
    return QUEUED_BATCHES * max_num_seqs


def default_queued_tokens(
    max_num_batched_tokens: int, data_parallel_size: int, max_model_len: int
) -> int:
    # At least one whole context, so that a request the model can take is never refused by
    # an empty backlog.
    steps = QUEUED_PREFILL_STEPS * max_num_batched_tokens * data_parallel_size
    return max(steps, max_model_len)


def resolve_capacity(config: VllmConfig) -> Capacity:
    """The capacity of an engine built from `config`, filling in the backlog bounds the
    operator left unset (vLLM leaves them unbounded) on its scheduler config, where the
    engine's own admission check reads them."""
    scheduler = config.scheduler_config
    ranks = config.parallel_config.data_parallel_size
    max_num_seqs = scheduler.max_num_seqs * ranks
    if scheduler.max_num_queued_reqs is None:
        scheduler.max_num_queued_reqs = default_queued_reqs(max_num_seqs)
    if scheduler.max_num_queued_tokens is None:
        scheduler.max_num_queued_tokens = default_queued_tokens(
            scheduler.max_num_batched_tokens, ranks, config.model_config.max_model_len
        )
    return Capacity(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=scheduler.max_num_batched_tokens,
        max_num_queued_reqs=scheduler.max_num_queued_reqs,
        max_num_queued_tokens=scheduler.max_num_queued_tokens,
    )
