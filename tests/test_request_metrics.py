"""A caller asks for its request's timings (`return_metrics`) and gets vLLM's per-request
metrics in the reply, or on a stream's last chunk, on both surfaces and for chat too; they
agree with each other and with the wall time the caller measured."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from llmcompletions.v2 import completions_pb2_grpc

from tests.conftest import GRPC_AUTH, MODEL
from tests.helpers import body, grpc_request, post, stream_chunks

# Rounding of the engine's and the server's clock readings, in milliseconds.
SLACK_MS = 1.0
FIELDS = (
    "time_to_first_token_ms",
    "generation_time_ms",
    "queue_time_ms",
    "mean_itl_ms",
    "tokens_per_second",
    "total_time_ms",
)


def assert_consistent(
    metrics: dict[str, Any],
    completion_tokens: int | None,
    wall_ms: float,
    fields: tuple[str, ...] = FIELDS,
) -> None:
    """Each part within the whole, the whole within what the caller waited, and the rate what
    the tokens (when known) and the time give."""
    assert set(metrics) == set(fields), metrics
    assert all(metrics[name] >= 0 for name in fields)
    total = metrics["total_time_ms"]
    assert total <= wall_ms
    in_engine = metrics["time_to_first_token_ms"] + metrics["generation_time_ms"]
    assert metrics["queue_time_ms"] + in_engine <= total + SLACK_MS
    if completion_tokens is not None:
        rate = completion_tokens / in_engine * 1000
        assert metrics["tokens_per_second"] == pytest.approx(rate)


def timed_post(rest: httpx.Client, path: str, payload: dict[str, Any]) -> tuple[Any, float]:
    started = time.monotonic()
    response = rest.post(path, json=payload)
    wall_ms = (time.monotonic() - started) * 1000
    assert response.status_code == 200, response.text
    return response.json(), wall_ms


def test_a_completion_carries_its_timings_when_asked(rest: httpx.Client) -> None:
    reply, wall_ms = timed_post(
        rest, "/v2/completions", body(prompt="Timed", max_tokens=8, return_metrics=True)
    )
    tokens = reply["usage"]["completion_tokens"]
    assert_consistent(reply["metrics"], tokens, wall_ms)
    metrics = reply["metrics"]
    assert metrics["mean_itl_ms"] == pytest.approx(metrics["generation_time_ms"] / (tokens - 1))
    assert "metrics" not in post(rest, body(prompt="Not timed", max_tokens=2)).json()


def test_several_choices_are_timed_as_one_request(rest: httpx.Client) -> None:
    reply, wall_ms = timed_post(
        rest,
        "/v2/completions",
        body(prompt=["One", "Two"], max_tokens=6, n=2, temperature=1, return_metrics=True),
    )
    assert_consistent(reply["metrics"], reply["usage"]["completion_tokens"], wall_ms)


@pytest.mark.parametrize("include_usage", [False, True])
def test_a_stream_carries_the_timings_on_its_last_chunk(
    rest: httpx.Client, include_usage: bool
) -> None:
    started = time.monotonic()
    chunks = stream_chunks(
        rest,
        prompt="Streamed and timed",
        max_tokens=6,
        return_metrics=True,
        stream_options={"include_usage": include_usage},
    )
    wall_ms = (time.monotonic() - started) * 1000
    *before, last = chunks
    assert not any("metrics" in chunk for chunk in before)
    assert last["choices"] == []
    assert ("usage" in last) == include_usage
    tokens = last["usage"]["completion_tokens"] if include_usage else None
    assert_consistent(last["metrics"], tokens, wall_ms)


def test_a_chat_reply_and_stream_carry_their_timings(rest: httpx.Client) -> None:
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Time me"}],
        "max_tokens": 5,
        "temperature": 0,
        "return_metrics": True,
    }
    reply, wall_ms = timed_post(rest, "/v2/chat/completions", chat)
    assert_consistent(reply["metrics"], reply["usage"]["completion_tokens"], wall_ms)
    started = time.monotonic()
    with rest.stream("POST", "/v2/chat/completions", json={**chat, "stream": True}) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    wall_ms = (time.monotonic() - started) * 1000
    assert events[-1] == "[DONE]"
    *before, last = [json.loads(event) for event in events[:-1]]
    assert not any("metrics" in chunk for chunk in before)
    assert any(choice["delta"].get("content") for c in before for choice in c["choices"])
    assert last["choices"] == [] and "usage" not in last
    assert_consistent(last["metrics"], None, wall_ms)


def test_a_grpc_caller_asks_for_the_same_timings(
    grpc_stub: completions_pb2_grpc.CompletionServiceStub,
) -> None:
    started = time.monotonic()
    (reply,) = grpc_stub.CreateCompletion(
        grpc_request(prompt="Timed over gRPC", max_tokens=4, return_metrics=True),
        metadata=GRPC_AUTH,
    )
    wall_ms = (time.monotonic() - started) * 1000
    assert reply.HasField("metrics")
    assert 0 < reply.metrics.total_time_ms <= wall_ms
    assert reply.metrics.tokens_per_second > 0


def test_beam_search_is_timed_over_all_its_steps(rest: httpx.Client) -> None:
    reply, wall_ms = timed_post(
        rest,
        "/v2/completions",
        body(prompt="Beams", max_tokens=4, n=2, use_beam_search=True, return_metrics=True),
    )
    # Each step's engine requests generate one token: no time between two tokens of one.
    single_steps = tuple(name for name in FIELDS if name != "mean_itl_ms")
    tokens = reply["usage"]["completion_tokens"]
    assert_consistent(reply["metrics"], tokens, wall_ms, single_steps)
