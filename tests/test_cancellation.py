"""A caller that goes away stops its engine work."""

from __future__ import annotations

import re
import time

import grpc
import httpx
from llmcompletions.v2 import completions_pb2_grpc

from facade.stack import Stack
from tests.helpers import body, grpc_request

LONG = {"prompt": "Count to ten thousand:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
ABORT_WITHIN_SECONDS = 5.0


def cancelled_request_line(stack: Stack, seen_before: int) -> str:
    """The log line of the next cancelled request, once the service has written it."""
    assert stack.service_log is not None
    deadline = time.monotonic() + ABORT_WITHIN_SECONDS
    while time.monotonic() < deadline:
        lines = stack.service_log.read_text().splitlines()[seen_before:]
        for line in lines:
            if "outcome=cancelled" in line:
                return line
        time.sleep(0.2)
    raise AssertionError("the service did not log a cancelled request")


def log_length(stack: Stack) -> int:
    assert stack.service_log is not None
    return len(stack.service_log.read_text().splitlines())


def assert_engine_idle(line: str) -> None:
    match = re.search(r"engine_unfinished=(\d+)", line)
    assert match and match.group(1) == "0", line


def test_grpc_cancel_aborts_the_engine_request(
    stack: Stack, grpc_stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    before = log_length(stack)
    call = grpc_stub.CreateCompletion(grpc_request(**LONG), timeout=120)
    for _, _ in zip(range(3), call, strict=False):
        pass
    call.cancel()
    assert call.code() == grpc.StatusCode.CANCELLED
    assert_engine_idle(cancelled_request_line(stack, before))


def test_rest_disconnect_aborts_the_engine_request(stack: Stack) -> None:
    before = log_length(stack)
    with (
        httpx.Client(base_url=stack.base_url, timeout=60) as client,
        client.stream("POST", "/v2/completions", json=body(**LONG)) as response,
    ):
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                break
    assert_engine_idle(cancelled_request_line(stack, before))
