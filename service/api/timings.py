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
class EngineRequestTimes:
    stats: RequestStateStats  # updated in place by the engine as the request runs
    sequences: int  # the choices it samples (n of one engine request)


@dataclass
class RequestTimings:
    """Collects the engine's statistics of each engine request a call runs.

    The engine stamps its requests with `time.monotonic()` in its own process; CLOCK_MONOTONIC
    is one clock for the whole host, so those stamps compare with `received` here.
    """

    received: float = field(default_factory=time.monotonic)
    by_request: dict[str, EngineRequestTimes] = field(default_factory=dict)

    def observe(self, output: RequestOutput) -> None:
        if isinstance(output.metrics, RequestStateStats):
            sequences = max(len(output.outputs), 1)
            self.by_request[output.request_id] = EngineRequestTimes(output.metrics, sequences)

    def reply(self) -> RequestMetrics:
        """The metrics so far (at a reply or a stream's last chunk)."""
        metrics = RequestMetrics(total_time_ms=(time.monotonic() - self.received) * MS)
        timed = [t for t in self.by_request.values() if t.stats.scheduled_ts > 0]
        if not timed:
            return metrics
        scheduled = min(t.stats.scheduled_ts for t in timed)
        metrics.queue_time_ms = max(t.stats.scheduled_ts - t.stats.queued_ts for t in timed) * MS
        generated = [t for t in timed if t.stats.first_token_ts > 0]
        if not generated:
            return metrics
        first_token = min(t.stats.first_token_ts for t in generated)
        last_token = max(t.stats.last_token_ts for t in generated)
        metrics.time_to_first_token_ms = (first_token - scheduled) * MS
        metrics.generation_time_ms = (last_token - first_token) * MS
        if (itl := mean_inter_token_latency(generated)) is not None:
            metrics.mean_itl_ms = itl * MS
        if last_token > scheduled:
            tokens = sum(t.stats.num_generation_tokens for t in generated)
            metrics.tokens_per_second = tokens / (last_token - scheduled)
        return metrics


def mean_inter_token_latency(requests: list[EngineRequestTimes]) -> float | None:
    """Seconds between two tokens of one choice, over every gap of every engine request (a
    request's choices are decoded side by side: its gaps are its tokens per choice, less one)."""
    gaps = 0.0
    decoding = 0.0
    for request in requests:
        per_choice = request.stats.num_generation_tokens / request.sequences
        if per_choice > 1:
            gaps += per_choice - 1
            decoding += request.stats.last_token_ts - request.stats.first_token_ts
    return decoding / gaps if gaps else None
