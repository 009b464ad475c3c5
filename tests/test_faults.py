"""Deadlines, mid-stream engine failures and size limits: every request ends with a result or
a clear error, and no engine work is left running."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import openai
import pytest
from llmcompletions.v2 import completions_pb2_grpc

from tests.conftest import GRPC_AUTH, MODEL
from tests.fault_injection import fault_request_id
from tests.helpers import CAPITAL_PROMPT, body, grpc_request, post
from tests.metrics import sample
from tests.test_cancellation import assert_engine_drains

FAULT_AFTER_3 = {"x-request-id": fault_request_id(3)}
LONG = {"prompt": "Count:", "max_tokens": 1500, "ignore_eos": True}


def test_grpc_deadline_aborts_the_engine_request_and_is_recorded_as_expired(
    grpc_stub: completions_pb2_grpc.CompletionServiceStub, metrics_url: str
) -> None:
    expired = {"method": "CreateCompletion", "code": "DEADLINE_EXCEEDED", "tenant": ""}
    before = sample(metrics_url, "llmcompletions_requests_total", **expired)
    with pytest.raises(grpc.RpcError) as raised:
        list(grpc_stub.CreateCompletion(grpc_request(**LONG), timeout=1.0, metadata=GRPC_AUTH))
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert_engine_drains(metrics_url)
    # The server records the call once its cancellation has run, a moment after the client's.
    deadline = time.monotonic() + 10
    while sample(metrics_url, "llmcompletions_requests_total", **expired) < before + 1:
        assert time.monotonic() < deadline, "the expired call was not recorded as expired"
        time.sleep(0.2)
    assert sample(metrics_url, "llmcompletions_requests_total", **expired) == before + 1


def test_rest_deadline_is_a_504(rest: httpx.Client, metrics_url: str) -> None:
    # A REST caller may set a gRPC deadline through Envoy with the grpc-timeout header.
    response = rest.post("/v2/completions", json=body(**LONG), headers={"grpc-timeout": "1S"})
    assert response.status_code == 504
    assert response.headers["content-type"].startswith("application/json")
    assert_engine_drains(metrics_url)


def test_rest_mid_stream_failure_is_an_error_event_not_a_truncation(
    rest: httpx.Client, metrics_url: str
) -> None:
    events = []
    with rest.stream(
        "POST", "/v2/completions", json=body(stream=True, **LONG), headers=FAULT_AFTER_3
    ) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert len(events) == 4, events
    assert all("choices" in json.loads(event) for event in events[:3])
    error = json.loads(events[-1])
    assert list(error) == ["error"]
    assert error["error"]["status_code"] == 500
    assert "engine" in error["error"]["content"]["error"]
    assert error["error"]["content"]["timestamp"]
    assert_engine_drains(metrics_url)


def test_openai_sdk_raises_on_a_mid_stream_failure(openai_client: openai.OpenAI) -> None:
    stream = openai_client.completions.create(
        model=MODEL,
        prompt=LONG["prompt"],
        max_tokens=LONG["max_tokens"],
        stream=True,
        extra_headers=FAULT_AFTER_3,
        extra_body={"ignore_eos": True},
    )
    with pytest.raises(openai.APIError):
        for _ in stream:
            pass


def test_grpc_mid_stream_failure_ends_with_an_error_message_and_status(
    grpc_stub: completions_pb2_grpc.CompletionServiceStub,
) -> None:
    call = grpc_stub.CreateCompletion(
        grpc_request(stream=True, **LONG),
        timeout=60,
        metadata=(*GRPC_AUTH, ("x-request-id", fault_request_id(3))),
    )
    messages = []
    with pytest.raises(grpc.RpcError) as raised:
        for message in call:
            messages.append(message)
    assert raised.value.code() == grpc.StatusCode.INTERNAL
    assert [bool(m.choices) for m in messages] == [True, True, True, False]
    assert messages[-1].error.status_code == 500


def test_failure_before_output_is_a_plain_500(rest: httpx.Client) -> None:
    response = rest.post(
        "/v2/completions",
        json=body(prompt="Hi", stream=True),
        headers={"x-request-id": fault_request_id(0)},
    )
    assert response.status_code == 500
    detail = response.json()["detail"]
    assert "engine" in detail and "Traceback" not in detail


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"prompt": ["a"] * 65}, "prompt"),
        ({"prompt": ["a"] * 20, "n": 13, "temperature": 1}, "n"),
        ({"prompt": "Hi", "guided_regex": "a" * 70000}, "guided_regex"),
        ({"prompt": "Hi", "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({"prompt": "word " * 70000}, "prompt"),
    ],
)
def test_size_limits_are_clear_422s(rest: httpx.Client, fields: dict, loc: str) -> None:
    response = post(rest, body(**fields))
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", loc]
    assert "at most" in response.json()["detail"][0]["msg"]


def test_body_over_the_limit_is_a_json_413(rest: httpx.Client) -> None:
    response = post(rest, body(prompt="x" * (5 * 1024 * 1024)))
    assert response.status_code == 413
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["detail"]


def test_grpc_message_over_the_limit_is_resource_exhausted(
    grpc_stub: completions_pb2_grpc.CompletionServiceStub,
) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        list(
            grpc_stub.CreateCompletion(
                grpc_request(prompt="x" * (17 * 1024 * 1024)), timeout=60, metadata=GRPC_AUTH
            )
        )
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_service_still_answers_after_faults(rest: httpx.Client, metrics_url: str) -> None:
    response = post(rest, body(prompt=CAPITAL_PROMPT, max_tokens=4))
    assert response.status_code == 200
    assert response.json()["choices"][0]["text"].startswith(" Paris")
    assert sample(metrics_url, "llmcompletions_requests_in_flight") == 0
