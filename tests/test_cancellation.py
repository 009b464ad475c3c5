"""A caller that goes away stops its engine work: the engine's count of unfinished requests
(read from the service's metrics) drops back to zero within two seconds."""

from __future__ import annotations

import time

import grpc
import httpx
from llmcompletions.v2 import completions_pb2_grpc

from tests.conftest import AUTH_HEADERS, GRPC_AUTH
from tests.helpers import body, grpc_request
from tests.metrics import sample
from tests.processes import TestStack

LONG = {"prompt": "Count to ten thousand:", "max_tokens": 1500, "ignore_eos": True, "stream": True}
ABORT_WITHIN_SECONDS = 2.0
UNFINISHED = "llmcompletions_engine_unfinished_requests"


def assert_engine_drains(metrics_url: str) -> None:
    deadline = time.monotonic() + ABORT_WITHIN_SECONDS
    while sample(metrics_url, UNFINISHED) != 0:
        assert time.monotonic() < deadline, "the engine still runs the abandoned request"
        time.sleep(0.1)


def test_grpc_cancel_aborts_the_engine_request(
    grpc_stub: completions_pb2_grpc.CompletionServiceStub, metrics_url: str
) -> None:
    call = grpc_stub.CreateCompletion(grpc_request(**LONG), timeout=120, metadata=GRPC_AUTH)
    for _, _ in zip(range(3), call, strict=False):
        pass
    assert sample(metrics_url, UNFINISHED) == 1, "the engine should be generating"
    call.cancel()
    assert call.code() == grpc.StatusCode.CANCELLED
    assert_engine_drains(metrics_url)


def test_rest_disconnect_aborts_the_engine_request(stack: TestStack, metrics_url: str) -> None:
    with (
        httpx.Client(base_url=stack.base_url, timeout=60, headers=AUTH_HEADERS) as client,
        client.stream("POST", "/v2/completions", json=body(**LONG)) as response,
    ):
        events = 0
        for line in response.iter_lines():
            events += line.startswith("data: ")
            if events == 3:
                assert sample(metrics_url, UNFINISHED) == 1, "the engine should be generating"
                break  # leaving the stream closes the connection
    assert_engine_drains(metrics_url)
