"""What an engineer with grpcurl sees: reflection, the streaming call, and health."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.conftest import API_KEY, MODEL
from tests.helpers import CAPITAL_PROMPT
from tests.processes import TestStack

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")


def grpcurl(
    target: str, *command: str, options: tuple[str, ...] = ()
) -> subprocess.CompletedProcess[str]:
    """`grpcurl -plaintext [options] ADDRESS command...`"""
    full = [GRPCURL, "-plaintext", *options, target, *command]
    return subprocess.run(full, capture_output=True, text=True, timeout=120)


def test_grpcurl_lists_services_without_a_key(stack: TestStack) -> None:
    listed = grpcurl(stack.grpc_target, "list")
    assert listed.returncode == 0, listed.stderr
    assert set(listed.stdout.split()) >= {
        "llmcompletions.v2.CompletionService",
        "grpc.health.v1.Health",
    }


def test_grpcurl_describes_the_method_and_request(stack: TestStack) -> None:
    method = grpcurl(stack.grpc_target, "describe", "llmcompletions.v2.CompletionService")
    assert method.returncode == 0, method.stderr
    assert "returns ( stream .llmcompletions.v2.CreateCompletionResponse )" in method.stdout
    request = grpcurl(stack.grpc_target, "describe", "llmcompletions.v2.CreateCompletionRequest")
    assert "google.protobuf.Value prompt" in request.stdout
    assert "optional double temperature" in request.stdout


def test_grpcurl_streams_a_completion(stack: TestStack) -> None:
    payload = json.dumps(
        {
            "model": MODEL,
            "prompt": CAPITAL_PROMPT,
            "max_tokens": 6,
            "temperature": 0,
            "stream": True,
        }
    )
    called = grpcurl(
        stack.grpc_target,
        "llmcompletions.v2.CompletionService/CreateCompletion",
        options=("-H", f"authorization: Bearer {API_KEY}", "-d", payload),
    )
    assert called.returncode == 0, called.stderr
    messages = [
        json.loads(block) for block in called.stdout.replace("}\n{", "}\n\x00{").split("\x00")
    ]
    assert len(messages) > 1
    assert "".join(m["choices"][0]["text"] for m in messages).startswith(" Paris")


def test_grpcurl_without_a_key_is_unauthenticated(stack: TestStack) -> None:
    payload = json.dumps({"model": MODEL, "prompt": CAPITAL_PROMPT})
    called = grpcurl(
        stack.grpc_target,
        "llmcompletions.v2.CompletionService/CreateCompletion",
        options=("-d", payload),
    )
    assert called.returncode != 0
    assert "Unauthenticated" in called.stderr


def test_health_reports_serving_without_a_key(stack: TestStack) -> None:
    with grpc.insecure_channel(stack.grpc_target) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        for service in ("", "llmcompletions.v2.CompletionService"):
            reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING


def test_grpcurl_calls_every_model_and_token_rpc_through_reflection(stack: TestStack) -> None:
    auth = ("-H", f"authorization: Bearer {API_KEY}")
    calls = {
        "ListModels": {},
        "GetModelInfo": {"model": MODEL},
        "Tokenize": {"model": MODEL, "prompt": CAPITAL_PROMPT},
        "Detokenize": {"model": MODEL, "tokens": [504, 3575]},
    }
    replies = {}
    for method, payload in calls.items():
        called = grpcurl(
            stack.grpc_target,
            f"llmcompletions.v2.CompletionService/{method}",
            options=(*auth, "-d", json.dumps(payload)),
        )
        assert called.returncode == 0, (method, called.stderr)
        replies[method] = json.loads(called.stdout)
    assert [model["id"] for model in replies["ListModels"]["data"]] == [MODEL]
    assert replies["GetModelInfo"]["vocab_size"] == 49152
    assert replies["Tokenize"]["count"] == len(replies["Tokenize"]["tokens"]) > 0
    assert replies["Detokenize"]["prompt"]


def test_grpcurl_works_through_envoy_as_against_the_service(stack: TestStack) -> None:
    # Reflection is a stream the client never closes: Envoy must not wait for its end.
    through_envoy = f"127.0.0.1:{stack.http_port}"
    listed = grpcurl(through_envoy, "list")
    assert listed.returncode == 0, listed.stderr
    assert "llmcompletions.v2.CompletionService" in listed.stdout.split()
    payload = json.dumps(
        {"model": MODEL, "prompt": CAPITAL_PROMPT, "max_tokens": 4, "ignore_eos": True}
    )
    called = grpcurl(
        through_envoy,
        "llmcompletions.v2.CompletionService/CreateCompletion",
        options=("-H", f"authorization: Bearer {API_KEY}", "-d", payload),
    )
    assert called.returncode == 0, called.stderr
    assert json.loads(called.stdout)["usage"]["completion_tokens"] == 4
