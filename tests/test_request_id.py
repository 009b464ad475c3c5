"""x-request-id follows a request through Envoy, the service, the engine and the log line,
and comes back to the caller."""

from __future__ import annotations

import time
import uuid

import httpx
from llmcompletions.v2 import completions_pb2_grpc

from tests.conftest import GRPC_AUTH
from tests.helpers import CAPITAL_PROMPT, body, grpc_request
from tests.processes import TestStack


def logged_line(stack: TestStack, request_id: str) -> str:
    assert stack.service_log is not None
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for line in stack.service_log.read_text().splitlines():
            if f"request_id='{request_id}'" in line:
                return line
        time.sleep(0.1)
    raise AssertionError(f"no log line for request {request_id}")


def test_rest_request_id_round_trip(stack: TestStack, rest: httpx.Client) -> None:
    request_id = f"test-{uuid.uuid4()}"
    for stream in (False, True):
        response = rest.post(
            "/v2/completions",
            json=body(prompt=CAPITAL_PROMPT, max_tokens=2, stream=stream),
            headers={"x-request-id": request_id},
        )
        assert response.status_code == 200
        assert response.headers["x-request-id"] == request_id
    line = logged_line(stack, request_id)
    assert "status='OK'" in line and "prompt_tokens=5" in line and "completion_tokens=2" in line


def test_rest_request_id_is_generated_when_absent(rest: httpx.Client) -> None:
    first = rest.post("/v2/completions", json=body(prompt="Hi", max_tokens=1))
    second = rest.post("/v2/completions", json=body(prompt="Hi", max_tokens=1))
    assert first.headers["x-request-id"] and second.headers["x-request-id"]
    assert first.headers["x-request-id"] != second.headers["x-request-id"]


def test_rest_error_carries_the_request_id(rest: httpx.Client) -> None:
    response = rest.post(
        "/v2/completions", json=body(prompt="Hi", temperature=9), headers={"x-request-id": "bad-1"}
    )
    assert response.status_code == 422
    assert response.headers["x-request-id"] == "bad-1"


def test_grpc_request_id_round_trip(
    stack: TestStack, grpc_stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    request_id = f"grpc-{uuid.uuid4()}"
    call = grpc_stub.CreateCompletion(
        grpc_request(prompt=CAPITAL_PROMPT, max_tokens=2),
        metadata=(*GRPC_AUTH, ("x-request-id", request_id)),
        timeout=60,
    )
    assert len(list(call)) == 1
    assert ("x-request-id", request_id) in tuple(call.initial_metadata())
    assert "status='OK'" in logged_line(stack, request_id)
