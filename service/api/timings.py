"""A request's timings, for callers who ask for them (`return_metrics`): the fields of vLLM's
per-request metrics, from the engine's own timestamps of each engine request a call runs, and
the whole time since this replica received the call."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from llmcompletions.v2.completions_pb2 import RequestMetrics
from vllm.outputs import RequestOutput
from vllm.v1.metrics.stats import RequestStateStats

MS = 1000.0


@dataclass
class RequestTimings:
    """Collects the engine's statistics of each engine request a call runs (a request sampling
    n > 1 choices runs as n engine requests, each with statistics of its own).

    The engine stamps its requests with `time.monotonic()` in its own process; CLOCK_MONOTONIC
    is one clock for the whole host, so those stamps compare with `received` here.
    """

    received: float = field(default_factory=time.monotonic)
    # By identity: updated in place by the engine as each request runs.
    seen: dict[int, RequestStateStats] = field(default_factory=dict)

    def observe(self, output: RequestOutput) -> None:
        if isinstance(output.metrics, RequestStateStats):
            self.seen[id(output.metrics)] = output.metrics

    def reply(self, completion_tokens: int) -> RequestMetrics:
        """The metrics so far (at a reply or a stream's last chunk), for the call's generated
        tokens (its usage)."""
        metrics = RequestMetrics(total_time_ms=(time.monotonic() - self.received) * MS)
        timed = [stats for stats in self.seen.values() if stats.scheduled_ts > 0]
        if not timed:
            return metrics
        scheduled = min(stats.scheduled_ts for stats in timed)
        metrics.queue_time_ms = max(stats.scheduled_ts - stats.queued_ts for stats in timed) * MS
        generated = [stats for stats in timed if stats.first_token_ts > 0]
        if not generated:
            return metrics
        first_token = min(stats.first_token_ts for stats in generated)
        last_token = max(stats.last_token_ts for stats in generated)
        metrics.time_to_first_token_ms = (first_token - scheduled) * MS
        metrics.generation_time_ms = (last_token - first_token) * MS
        if (itl := mean_inter_token_latency(generated)) is not None:
            metrics.mean_itl_ms = itl * MS
        if last_token > scheduled:
            metrics.tokens_per_second = completion_tokens / (last_token - scheduled)
        return metrics


def mean_inter_token_latency(requests: list[RequestStateStats]) -> float | None:
    """Seconds between two tokens of one choice, over every gap of every engine request."""
    decoded = [stats for stats in requests if stats.num_generation_tokens > 1]
    gaps = sum(stats.num_generation_tokens - 1 for stats in decoded)
    decoding = sum(stats.last_token_ts - stats.first_token_ts for stats in decoded)
    return decoding / gaps if gaps else None
