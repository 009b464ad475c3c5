"""The default bounds on real processes: a burst far past what the frontend used to admit is
served in full on both surfaces, the engine running its whole batch and the rest waiting in its
queue, in view. (A small engine's batch, backlog bounds and priorities: tests/test_capacity.py,
whose helpers this module shares.)"""

from __future__ import annotations

import asyncio
import collections

from tests.conftest import API_KEY, AUTH_HEADERS
from tests.metrics import GaugeWatch
from tests.processes import TestStack
from tests.test_capacity import (
    BURST_PER_SURFACE,
    Outcome,
    capacity,
    completion,
    surfaces,
    wait_until_idle,
)

OLD_FRONTEND_LIMIT = 32 + 128  # what the frontend used to admit and hold, whatever the engine


def test_a_burst_far_past_the_old_limits_is_served_in_full_on_both_surfaces(
    stack: TestStack, metrics_url: str
) -> None:
    limits = capacity(metrics_url)
    assert limits["max_num_seqs"] == 128  # vLLM's batch for an API server on a CPU
    assert limits["max_num_queued_reqs"] >= 2 * BURST_PER_SURFACE

    async def burst() -> list[Outcome]:
        async with surfaces(stack, AUTH_HEADERS, (("authorization", f"Bearer {API_KEY}"),)) as on:
            payload = completion("Once upon a time", max_tokens=4)
            calls = [on.rest_call(payload) for _ in range(BURST_PER_SURFACE)]
            calls += [on.grpc_call(payload) for _ in range(BURST_PER_SURFACE)]
            return await asyncio.gather(*calls)

    gauges = ("vllm:num_requests_running", "vllm:num_requests_waiting")
    with GaugeWatch(metrics_url, gauges) as watch:
        outcomes = asyncio.run(burst())
    statuses = collections.Counter(outcome.status for outcome in outcomes)
    assert statuses == {"200": BURST_PER_SURFACE, "OK": BURST_PER_SURFACE}
    assert 2 * BURST_PER_SURFACE > OLD_FRONTEND_LIMIT
    assert all(outcome.finish_reasons == ["length"] for outcome in outcomes)
    # The engine ran its whole batch, and the rest waited in its queue, in view. The gauge is
    # sampled after a step, when the requests that just finished have left the batch and
    # those that replace them may not have arrived yet: a full batch shows as within a few.
    peak = watch.peaks["vllm:num_requests_running"]
    assert limits["max_num_seqs"] - 8 <= peak <= limits["max_num_seqs"]
    assert watch.peaks["vllm:num_requests_waiting"] > 0
    wait_until_idle(metrics_url)
