"""With tracing off (the default stack), a call that asks for a trace sends nothing: the
traced fleet's checks are in test_tracing.py."""

from __future__ import annotations

import os
import time

import grpc
import httpx
import pytest
from llmcompletions.v2 import completions_pb2_grpc

from tests.conftest import API_KEY, GRPC_AUTH
from tests.helpers import body, grpc_request
from tests.otlp import OtlpReceiver, caller_context
from tests.processes import TestStack


def test_with_tracing_off_nothing_is_sent(stack: TestStack) -> None:
    """The session's stack runs without tracing: a collector at OTLP's default address
    receives nothing of a call that asks for a trace."""
    assert not os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
    try:
        receiver = OtlpReceiver(port=4317)
    except RuntimeError:
        pytest.skip("OTLP's default port 4317 is taken on this host")
    try:
        traceparent = caller_context()[2]
        with grpc.insecure_channel(stack.grpc_target) as channel:
            stub = completions_pb2_grpc.CompletionServiceStub(channel)
            metadata = (("traceparent", traceparent), *GRPC_AUTH)
            list(stub.CreateCompletion(grpc_request(prompt="x", max_tokens=2), metadata=metadata))
        reply = httpx.post(
            f"{stack.base_url}/v2/completions",
            json=body(prompt="x", max_tokens=2),
            headers={"traceparent": traceparent, "authorization": f"Bearer {API_KEY}"},
            timeout=60,
        )
        assert reply.status_code == 200
        time.sleep(6)  # longer than any exporter's batch delay
        assert receiver.spans() == []
    finally:
        receiver.stop()
