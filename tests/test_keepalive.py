"""Keepalive with real callers: a caller that pings every 10 s (as meshes and many Go and Java
clients do) keeps a call held for a minute, directly and through Envoy; a caller that vanishes
without closing has its call cancelled and its engine request aborted by the server's pings."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateCompletionResponse

from tests.blackhole import blackhole
from tests.conftest import GRPC_AUTH, SERVER_KEEPALIVE_SECONDS
from tests.helpers import grpc_request
from tests.metrics import sample
from tests.processes import TestStack

# What meshes and many Go/Java clients set: a ping after 10 s of silence, with or without calls.
CLIENT_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# grpcio's defaults ended a non-streamed call of a minute with GOAWAY "too_many_pings" after
# 50 s: the server counts a caller's pings while it sends nothing.
HELD_SECONDS = 65
# A caller's receive window small enough that the server's writes wait for it to read (HTTP/2
# flow control with a 1 KiB window, not grown by gRPC's bandwidth probe): a stream its caller
# stops reading sends nothing but pings, as a long non-streamed call does, without the engine
# computing for a minute.
HELD_WINDOW_BYTES = 1024
HELD = [
    *CLIENT_KEEPALIVE,
    ("grpc.http2.bdp_probe", 0),
    ("grpc.http2.lookahead_bytes", HELD_WINDOW_BYTES),
]
HELD_TOKENS = 120
COUNT = "Count from one to ten thousand, in words:"
UNFINISHED = "llmcompletions_engine_unfinished_requests"


def held_stream(target: str) -> tuple[CreateCompletionResponse, list[CreateCompletionResponse]]:
    """A stream read by a caller pinging every 10 s that stops for HELD_SECONDS after its first
    message: (that message, the rest)."""
    request = grpc_request(
        prompt=COUNT,
        max_tokens=HELD_TOKENS,
        ignore_eos=True,
        logprobs=1,
        stream=True,
        stream_options={"include_usage": True},
    )
    with grpc.insecure_channel(target, options=HELD) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        call = stub.CreateCompletion(request, timeout=600, metadata=GRPC_AUTH)
        first = next(call)
        time.sleep(HELD_SECONDS)
        return first, list(call)


def test_a_call_held_a_minute_keeps_a_caller_with_10s_keepalive(stack: TestStack) -> None:
    envoy = f"127.0.0.1:{stack.http_port}"
    with ThreadPoolExecutor(2) as pool:
        direct, through_envoy = pool.map(held_stream, [stack.grpc_target, envoy])
    for first, rest in (direct, through_envoy):
        assert rest[-1].usage.completion_tokens == HELD_TOKENS
        assert rest[-2].choices[0].finish_reason == "length"
        tokens = [len(m.choices[0].logprobs.tokens) for m in [first, *rest] if m.choices]
        assert sum(tokens) == HELD_TOKENS
        # More than the caller's window came after the pause: the stream was held, at the
        # server or at Envoy, for the whole minute, with only pings on the connection.
        assert sum(m.ByteSize() for m in rest) > 4 * HELD_WINDOW_BYTES
    # The server held its writes: vLLM merged the tokens made meanwhile into fewer messages.
    first, rest = direct
    assert len(rest) < HELD_TOKENS - 5


def wait_for_unfinished(metrics_url: str, count: int, timeout: float) -> float:
    """Seconds until the engine has `count` unfinished requests; fails after `timeout`."""
    started = time.monotonic()
    while sample(metrics_url, UNFINISHED) != count:
        assert time.monotonic() - started < timeout, f"the engine never had {count} unfinished"
        time.sleep(0.2)
    return time.monotonic() - started


def test_a_vanished_caller_has_its_engine_request_aborted(
    stack: TestStack, metrics_url: str
) -> None:
    host, port = stack.grpc_target.split(":")
    with blackhole((host, int(port))) as relay, grpc.insecure_channel(relay.address) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        request = grpc_request(prompt=COUNT, max_tokens=1500, ignore_eos=True, stream=True)
        call = stub.CreateCompletion(request, timeout=300, metadata=GRPC_AUTH)
        for _, _ in zip(range(3), call, strict=False):
            pass
        assert sample(metrics_url, UNFINISHED) == 1, "the engine should be generating"
        relay.cut()  # the caller's host is gone: no FIN, no RST, no ping answered
        # Within one keepalive interval plus the ping's timeout (and the scheduling slack of
        # a busy 2-core machine), the server drops the connection and aborts the request.
        waited = wait_for_unfinished(metrics_url, 0, timeout=2 * SERVER_KEEPALIVE_SECONDS + 5)
        call.cancel()
    assert waited > 1, "the request ended at once: the relay did not hold the connection"
