"""The REST facade at its limits, through the real Envoy: whole replies larger than the request
limit, error messages that quote long request values, and no internal headers for clients."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import grpc
import httpx
import pytest
from llmcompletions.client import CompletionClient
from llmcompletions.v2 import completions_pb2_grpc

from facade.render import DEFAULT_MAX_REQUEST_BYTES
from service.api.errors import MAX_QUOTED_NAME_CHARS
from tests.conftest import API_KEY, AUTH_HEADERS, GRPC_AUTH, MODEL
from tests.helpers import body, grpc_request, post
from tests.processes import TestStack, free_port, stop_helpers

# A token that decodes to 80 characters: echoing a prompt of it makes a large reply cheaply.
WIDE_TOKEN = 45855
WIDE_TOKEN_TEXT = "#" * 80
LONG = 100_000
# An error's JSON body and its gRPC metadata stay small whatever the request quoted.
MAX_ERROR_BODY_BYTES = 2048
MAX_ERROR_METADATA_BYTES = 8192
SMALL_REPLY_LIMIT = 200_000
# Prompt lengths one past a multiple of the KV-cache block (16 on a GPU, 128 on the CPU build):
# every choice after the first then finds the whole prompt in the prefix cache and computes one
# token. At 1000 tokens each of 64 choices recomputed its last 104, and on the CPU build attention
# over a cached prefix is slow: that call took 21 s, at 1025 it takes about 1 s.
WIDE_PROMPT_TOKENS = 1025
NARROW_PROMPT_TOKENS = 513


def wide_echo(prompt_tokens: int, n: int) -> dict[str, object]:
    """A request whose reply is the prompt's text, n times: about 80 bytes per token each."""
    return body(prompt=[WIDE_TOKEN] * prompt_tokens, echo=True, max_tokens=0, n=n)


@dataclass
class DebugEnvoy:
    """A second Envoy in front of the same service: a small reply limit, debug headers on."""

    base_url: str
    admin_url: str


@pytest.fixture(scope="module")
def debug_envoy(stack: TestStack) -> Iterator[DebugEnvoy]:
    http_port, admin_port = free_port(), free_port()
    command = [
        *(sys.executable, "-m", "facade.launch", "--upstream", stack.grpc_target),
        *("--http-port", str(http_port), "--admin-port", str(admin_port)),
        *("--max-reply-bytes", str(SMALL_REPLY_LIMIT), "--debug-headers"),
    ]
    envoy = subprocess.Popen(command)
    probe = TestStack(grpc_port=stack.grpc_port, admin_port=admin_port, processes=[envoy])
    try:
        probe.wait_until(probe.envoy_ready, timeout=60)
        yield DebugEnvoy(f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{admin_port}")
    finally:
        stop_helpers([envoy])


def retries(admin_url: str) -> int:
    stats = httpx.get(f"{admin_url}/stats?filter=upstream_rq_retry$", timeout=5).text
    return sum(int(line.rsplit(":", 1)[1]) for line in stats.splitlines() if line.strip())


def test_a_whole_reply_larger_than_the_request_limit_arrives_whole(rest: httpx.Client) -> None:
    response = post(rest, wide_echo(WIDE_PROMPT_TOKENS, 64))
    assert response.status_code == 200, response.text[:500]
    assert len(response.content) > DEFAULT_MAX_REQUEST_BYTES
    reply = response.json()
    assert [choice["index"] for choice in reply["choices"]] == list(range(64))
    assert all(
        choice["text"] == WIDE_TOKEN_TEXT * WIDE_PROMPT_TOKENS for choice in reply["choices"]
    )
    assert reply["usage"]["prompt_tokens"] == WIDE_PROMPT_TOKENS


def test_a_reply_over_the_facade_limit_is_a_clear_error_and_streams_fine(
    debug_envoy: DebugEnvoy,
) -> None:
    with httpx.Client(base_url=debug_envoy.base_url, headers=AUTH_HEADERS, timeout=120) as client:
        refused = post(client, wide_echo(NARROW_PROMPT_TOKENS, 8))
        assert refused.status_code == 400, refused.text[:500]
        assert refused.headers["content-type"].startswith("application/json")
        detail = refused.json()["detail"]
        assert f"{SMALL_REPLY_LIMIT}-byte limit" in detail and "`stream`" in detail
        streamed = client.post(
            "/v2/completions", json={**wide_echo(NARROW_PROMPT_TOKENS, 8), "stream": True}
        )
        assert streamed.status_code == 200
        events = [line for line in streamed.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]"
        texts = "".join(json.loads(e[6:])["choices"][0]["text"] for e in events[:-1])
        assert texts == WIDE_TOKEN_TEXT * NARROW_PROMPT_TOKENS * 8


def test_the_same_large_reply_reaches_the_typed_grpc_client_as_one_message(
    stack: TestStack,
) -> None:
    with CompletionClient(stack.grpc_target, api_key=API_KEY) as client:
        reply = client.complete(**wide_echo(WIDE_PROMPT_TOKENS, 64))
    assert reply.ByteSize() > DEFAULT_MAX_REQUEST_BYTES
    assert [choice.text for choice in reply.choices] == [WIDE_TOKEN_TEXT * WIDE_PROMPT_TOKENS] * 64


LONG_VALUES = {
    "model": ({"model": "m" * LONG}, 404, grpc.StatusCode.NOT_FOUND),
    "stop": ({"stop": "s" * LONG}, 422, grpc.StatusCode.INVALID_ARGUMENT),
    "stop (multi-byte)": ({"stop": ["\u4e2d" * LONG]}, 422, grpc.StatusCode.INVALID_ARGUMENT),
    "guided_regex": ({"guided_regex": "(" * LONG}, 422, grpc.StatusCode.INVALID_ARGUMENT),
    "guided_decoding_backend": (
        {"guided_decoding_backend": "b" * LONG},
        422,
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
}


@pytest.mark.parametrize("fields", LONG_VALUES.values(), ids=LONG_VALUES.keys())
def test_a_long_value_gets_a_clean_bounded_error_on_rest(
    rest: httpx.Client, fields: tuple[dict[str, object], int, grpc.StatusCode]
) -> None:
    values, status, _ = fields
    response = post(rest, {**body(prompt="Hi", max_tokens=1), **values})
    assert response.status_code == status, response.text[:500]
    assert response.headers["content-type"].startswith("application/json")
    assert len(response.content) <= MAX_ERROR_BODY_BYTES
    detail = response.json()["detail"]
    text = detail if isinstance(detail, str) else " ".join(item["msg"] for item in detail)
    assert text


@pytest.mark.parametrize("fields", LONG_VALUES.values(), ids=LONG_VALUES.keys())
def test_a_long_value_gets_a_clean_bounded_status_on_grpc(
    grpc_stub: completions_pb2_grpc.CompletionServiceStub,
    fields: tuple[dict[str, object], int, grpc.StatusCode],
) -> None:
    values, _, code = fields
    request = grpc_request(prompt="Hi", max_tokens=1, **values)
    with pytest.raises(grpc.RpcError) as raised:
        list(grpc_stub.CreateCompletion(request, timeout=60, metadata=GRPC_AUTH))
    assert raised.value.code() == code
    metadata = raised.value.trailing_metadata() or ()
    size = sum(len(key) + len(value) for key, value in metadata)
    assert size + len(raised.value.details()) <= MAX_ERROR_METADATA_BYTES


def test_the_404_for_a_long_model_quotes_it_clipped(rest: httpx.Client) -> None:
    response = post(rest, {**body(prompt="Hi"), "model": "m" * LONG})
    detail = response.json()["detail"]
    shown = MAX_QUOTED_NAME_CHARS  # shorter than other quoted values: the served names follow
    assert "m" * shown + "\u2026" in detail and "m" * (shown + 1) not in detail
    assert f"({LONG} characters)" in detail and f"`{MODEL}`" in detail


def test_a_failure_any_replica_would_share_is_not_retried(
    debug_envoy: DebugEnvoy,
) -> None:
    before = retries(debug_envoy.admin_url)
    with httpx.Client(base_url=debug_envoy.base_url, headers=AUTH_HEADERS, timeout=60) as client:
        for values, status, _ in LONG_VALUES.values():
            assert post(client, {**body(prompt="Hi", max_tokens=1), **values}).status_code == status
    assert retries(debug_envoy.admin_url) == before


def internal_headers(headers: httpx.Headers) -> list[str]:
    prefixes = ("x-upstream", "x-envoy", "grpc-", "x-response-framing", "x-http-status")
    return [name for name in headers if name.lower().startswith(prefixes)]


def test_default_rest_replies_carry_no_internal_headers(rest: httpx.Client) -> None:
    whole = post(rest, body(prompt="Hi", max_tokens=2))
    streamed = post(rest, body(prompt="Hi", max_tokens=2, stream=True))
    refused = post(rest, {**body(prompt="Hi"), "model": "nope"})
    unparsable = rest.post(
        "/v2/completions", content=b"{", headers={"content-type": "application/json"}
    )
    assert [r.status_code for r in (whole, streamed, refused, unparsable)] == [200, 200, 404, 422]
    for response in (whole, streamed, refused, unparsable):
        assert internal_headers(response.headers) == [], response.headers
        assert response.headers["x-request-id"]


def test_debug_headers_name_the_replica_when_the_operator_asks(
    stack: TestStack, debug_envoy: DebugEnvoy
) -> None:
    with httpx.Client(base_url=debug_envoy.base_url, headers=AUTH_HEADERS, timeout=60) as client:
        response = post(client, body(prompt="Hi", max_tokens=1))
    assert response.status_code == 200
    assert response.headers["x-upstream-host"] == stack.grpc_target
    assert int(response.headers["x-upstream-service-time"]) >= 0
