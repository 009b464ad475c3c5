"""Keepalive with real callers: a caller that pings every 10 s (as meshes and many Go and Java
clients do) keeps a minute-long call, directly and through Envoy; a caller that vanishes
without closing has its call cancelled and its engine request aborted by the server's pings."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import grpc
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateCompletionResponse

from tests.blackhole import blackhole
from tests.conftest import GRPC_AUTH, MAX_MODEL_LEN, SERVER_KEEPALIVE_SECONDS
from tests.helpers import grpc_request
from tests.metrics import sample
from tests.processes import TestStack

# What meshes and many Go/Java clients set: a ping after 10 s of silence, with or without calls.
CLIENT_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
# grpcio's defaults ended such a call after 50 s with GOAWAY "too_many_pings".
LONG_CALL_SECONDS = 65
AT_LEAST_SECONDS = 50
MAX_ATTEMPTS = 3
UNFINISHED = "llmcompletions_engine_unfinished_requests"
COUNT = "Count from one to ten thousand, in words:"


def whole(target: str, max_tokens: int, n: int = 1) -> tuple[list[CreateCompletionResponse], float]:
    """A non-streamed call on its own channel with client keepalive; its messages and time."""
    started = time.monotonic()
    with grpc.insecure_channel(target, options=CLIENT_KEEPALIVE) as channel:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        request = grpc_request(prompt=COUNT, max_tokens=max_tokens, n=n, ignore_eos=True)
        replies = list(stub.CreateCompletion(request, timeout=600, metadata=GRPC_AUTH))
    return replies, time.monotonic() - started


def long_call(seconds: float, target: str) -> tuple[int, int]:
    """Tokens and choices (n) for two concurrent calls to take about `seconds` on this machine.
    The model's context bounds the tokens of a choice; on a machine that writes them faster
    than that lasts, more choices per call slow each step down instead."""
    longest = MAX_MODEL_LEN - 64
    for n in (1, 2, 4, 8, 16, 32):
        with ThreadPoolExecutor(2) as pool:
            timed = list(pool.map(lambda _, n=n: whole(target, 40, n), range(2)))
        tokens = int(40 / max(elapsed for _, elapsed in timed) * seconds)
        if tokens <= longest:
            return tokens, n
    return longest, n


def test_a_minute_long_call_keeps_a_caller_with_10s_keepalive(stack: TestStack) -> None:
    envoy = f"127.0.0.1:{stack.http_port}"
    max_tokens, n = long_call(LONG_CALL_SECONDS, stack.grpc_target)
    # The machine's speed is measured before the calls, and a busy host's changes: a pair that
    # ended too soon to tell proves nothing either way, and is sent again, longer.
    shortest = float(LONG_CALL_SECONDS)
    for _ in range(MAX_ATTEMPTS):
        longer = int(max_tokens * LONG_CALL_SECONDS / shortest)
        max_tokens = min(MAX_MODEL_LEN - 64, max(max_tokens, longer))
        with ThreadPoolExecutor(2) as pool:
            direct, through_envoy = pool.map(
                lambda target, tokens=max_tokens: whole(target, tokens, n),
                [stack.grpc_target, envoy],
            )
        shortest = min(direct[1], through_envoy[1])
        if shortest >= AT_LEAST_SECONDS or max_tokens >= MAX_MODEL_LEN - 64:
            break
    for replies, elapsed in (direct, through_envoy):
        assert elapsed >= AT_LEAST_SECONDS, f"the call took {elapsed:.0f}s: too short to tell"
        (reply,) = replies
        assert reply.usage.completion_tokens == max_tokens * n
        assert [choice.finish_reason for choice in reply.choices] == ["length"] * n


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
