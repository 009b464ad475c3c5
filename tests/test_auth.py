"""With an API key configured, every completion call needs it, on both surfaces."""

from __future__ import annotations

import grpc
import httpx
import pytest
from llmcompletions.v2 import completions_pb2_grpc

from tests.helpers import CAPITAL_PROMPT, body, grpc_request
from tests.metrics import sample
from tests.processes import TestStack

WRONG = {"Authorization": "Bearer not-the-key"}


@pytest.mark.parametrize("headers", [{}, WRONG, {"Authorization": "Basic dGVzdA=="}])
def test_rest_without_the_key_is_a_json_401(stack: TestStack, headers: dict) -> None:
    for stream in (False, True):
        response = httpx.post(
            f"{stack.base_url}/v2/completions",
            json=body(prompt=CAPITAL_PROMPT, stream=stream),
            headers=headers,
            timeout=30,
        )
        assert response.status_code == 401
        assert response.headers["content-type"].startswith("application/json")
        assert "API key" in response.json()["detail"]


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer not-the-key"),)])
def test_grpc_without_the_key_is_unauthenticated(
    grpc_stub: completions_pb2_grpc.CompletionServiceStub, metadata: tuple
) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        list(grpc_stub.CreateCompletion(grpc_request(prompt="Hi"), metadata=metadata, timeout=30))
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_the_key_is_never_logged(stack: TestStack, rest: httpx.Client) -> None:
    from tests.conftest import API_KEY

    assert rest.post("/v2/completions", json=body(prompt="Hi", max_tokens=1)).status_code == 200
    assert stack.service_log is not None
    assert API_KEY not in stack.service_log.read_text()


def test_a_refused_call_is_counted_and_logged_once(stack: TestStack, metrics_url: str) -> None:
    refused = {"method": "CreateCompletion", "code": "UNAUTHENTICATED", "tenant": ""}
    before = sample(metrics_url, "llmcompletions_requests_total", **refused)
    response = httpx.post(
        f"{stack.base_url}/v2/completions",
        json=body(prompt="Hi"),
        headers={**WRONG, "x-request-id": "refused-call-0001"},
        timeout=30,
    )
    assert response.status_code == 401
    assert response.headers["x-request-id"] == "refused-call-0001"
    assert sample(metrics_url, "llmcompletions_requests_total", **refused) == before + 1
    assert stack.service_log is not None
    lines = [
        line for line in stack.service_log.read_text().splitlines() if "refused-call-0001" in line
    ]
    assert len(lines) == 1 and "status='UNAUTHENTICATED'" in lines[0], lines
