"""Cancel by request id on one replica behind Envoy: a caller stops its own completion or chat
(streamed or whole) by the x-request-id it sent, from another connection, on either surface;
the call ends CANCELLED (a stream with an error event first) and the engine stops its work. An
unknown id is a 404, another caller's request a 403, and nothing is stopped then."""

from __future__ import annotations

import json
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import httpx
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CancelCompletionRequest

from tests.conftest import API_KEY, AUTH_HEADERS, GRPC_AUTH, MODEL, OTHER_API_KEY
from tests.helpers import body, grpc_request
from tests.metrics import sample
from tests.processes import TestStack
from tests.test_cancellation import assert_engine_drains

LONG = {"prompt": "Count to ten thousand:", "max_tokens": 1500, "ignore_eos": True}
UNFINISHED = "llmcompletions_engine_unfinished_requests"
OTHER_HEADERS = {"Authorization": f"Bearer {OTHER_API_KEY}"}


def new_id() -> str:
    return f"cancel-test-{uuid.uuid4().hex}"


def wait_running(metrics_url: str, count: int = 1, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while sample(metrics_url, UNFINISHED) < count:
        assert time.monotonic() < deadline, "the request never reached the engine"
        time.sleep(0.05)


def cancel(stack: TestStack, request_id: str, key: str = API_KEY) -> httpx.Response:
    """A cancel through Envoy's REST surface, on a connection of its own."""
    headers = {"Authorization": f"Bearer {key}"}
    with httpx.Client(base_url=stack.base_url, timeout=30, headers=headers) as client:
        return client.post(f"/v2/completions/{request_id}/cancel")


def test_a_rest_stream_cancelled_by_its_id_ends_with_an_error_event(
    stack: TestStack, rest: httpx.Client, metrics_url: str
) -> None:
    request_id = new_id()
    events: list[str] = []
    with rest.stream(
        "POST",
        "/v2/completions",
        json=body(stream=True, **LONG),
        headers={"x-request-id": request_id},
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if not line:
                continue
            events.append(line.removeprefix("data: "))
            if len(events) == 3:
                answer = cancel(stack, request_id)
                assert answer.status_code == 200, answer.text
                assert answer.json() == {
                    "request_id": request_id,
                    "object": "completion.cancelled",
                    "cancelled": 1,
                }
    error = json.loads(events[-1])["error"]
    assert error["status_code"] == 499
    assert "cancelled" in error["content"]["error"]
    assert 3 <= len(events) < 100  # stopped, not run to its 1,500 tokens
    assert_engine_drains(metrics_url)


def test_a_whole_grpc_completion_cancelled_by_its_id_ends_cancelled(
    grpc_stub: completions_pb2_grpc.CompletionServiceStub, stack: TestStack, metrics_url: str
) -> None:
    request_id = new_id()
    metadata = (*GRPC_AUTH, ("x-request-id", request_id))
    with ThreadPoolExecutor(1) as pool:
        call = pool.submit(
            lambda: list(
                grpc_stub.CreateCompletion(grpc_request(**LONG), timeout=120, metadata=metadata)
            )
        )
        wait_running(metrics_url)
        cancelled = grpc_stub.CancelCompletion(
            CancelCompletionRequest(request_id=request_id), timeout=30, metadata=GRPC_AUTH
        )
        assert cancelled.cancelled == 1
        try:
            call.result(timeout=30)
            raise AssertionError("the cancelled call succeeded")
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.CANCELLED
            assert request_id in (error.details() or "")
    assert_engine_drains(metrics_url)


def test_a_streamed_chat_cancelled_by_its_id_ends_with_an_error_event(
    stack: TestStack, rest: httpx.Client, metrics_url: str
) -> None:
    request_id = new_id()
    chat = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Count to ten thousand."}],
        "max_tokens": 1500,
        "ignore_eos": True,
        "stream": True,
    }
    events: list[str] = []
    with rest.stream(
        "POST", "/v2/chat/completions", json=chat, headers={"x-request-id": request_id}
    ) as response:
        for line in response.iter_lines():
            if not line:
                continue
            events.append(line.removeprefix("data: "))
            if len(events) == 3:
                assert cancel(stack, request_id).status_code == 200
    assert json.loads(events[-1])["error"]["status_code"] == 499
    assert len(events) < 100
    assert_engine_drains(metrics_url)


def test_an_unknown_id_is_a_404_and_stops_nothing(stack: TestStack, metrics_url: str) -> None:
    answer = cancel(stack, new_id())
    assert answer.status_code == 404
    assert "No completion with the request id" in answer.text


def test_another_callers_request_is_not_theirs_to_cancel(
    stack: TestStack, rest: httpx.Client, metrics_url: str
) -> None:
    request_id = new_id()
    outcome: dict[str, Any] = {}

    def run() -> None:
        response = rest.post(
            "/v2/completions",
            json=body(**{**LONG, "max_tokens": 64}),
            headers={"x-request-id": request_id},
        )
        outcome["status"] = response.status_code

    caller = threading.Thread(target=run)
    caller.start()
    wait_running(metrics_url)
    refused = cancel(stack, request_id, key=OTHER_API_KEY)
    assert refused.status_code == 403
    assert "another caller" in refused.text
    unauthenticated = httpx.post(f"{stack.base_url}/v2/completions/{request_id}/cancel")
    assert unauthenticated.status_code == 401
    caller.join(timeout=120)
    assert outcome["status"] == 200  # served in full
    assert_engine_drains(metrics_url)


def test_a_cancel_without_an_id_is_refused(
    grpc_stub: completions_pb2_grpc.CompletionServiceStub,
) -> None:
    try:
        grpc_stub.CancelCompletion(CancelCompletionRequest(), timeout=30, metadata=GRPC_AUTH)
        raise AssertionError("a cancel without an id was accepted")
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "request_id" in (error.details() or "")


def test_the_headers_other_callers_use_are_accepted(rest: httpx.Client) -> None:
    """Both keys of the server are callers: the second one is served like the first."""
    response = rest.post(
        "/v2/completions", json=body(prompt="Hi", max_tokens=2), headers=OTHER_HEADERS
    )
    assert response.status_code == 200, response.text
    assert AUTH_HEADERS != OTHER_HEADERS
