"""The same greedy request gives the same completion on every surface users call."""

from __future__ import annotations

import grpc
import httpx
import openai
from google.protobuf import json_format
from llmcompletions.v2 import completions_pb2_grpc

from tests.conftest import MODEL
from tests.helpers import CAPITAL_PROMPT, complete, grpc_complete

MAX_TOKENS = 20


def test_grpc_rest_and_openai_sdk_agree(
    rest: httpx.Client,
    grpc_stub: completions_pb2_grpc.CompletionServiceStub,
    openai_client: openai.OpenAI,
) -> None:
    rest_result = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=MAX_TOKENS)
    expected = rest_result["choices"][0]["text"]
    assert expected.startswith(" Paris")

    grpc_messages = grpc_complete(grpc_stub, prompt=CAPITAL_PROMPT, max_tokens=MAX_TOKENS)
    assert len(grpc_messages) == 1, "stream=false sends exactly one message"
    assert grpc_messages[0].choices[0].text == expected
    assert grpc_messages[0].usage.completion_tokens == rest_result["usage"]["completion_tokens"]

    sdk_result = openai_client.completions.create(
        model=MODEL, prompt=CAPITAL_PROMPT, max_tokens=MAX_TOKENS, temperature=0
    )
    assert sdk_result.choices[0].text == expected
    assert sdk_result.usage.completion_tokens == rest_result["usage"]["completion_tokens"]

    sdk_stream = openai_client.completions.create(
        model=MODEL, prompt=CAPITAL_PROMPT, max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    assert "".join(chunk.choices[0].text for chunk in sdk_stream) == expected


def test_grpc_stream_sends_deltas_without_rest_framing(
    grpc_stub: completions_pb2_grpc.CompletionServiceStub,
) -> None:
    whole = grpc_complete(grpc_stub, prompt=CAPITAL_PROMPT, max_tokens=MAX_TOKENS)[0]
    chunks = grpc_complete(
        grpc_stub,
        prompt=CAPITAL_PROMPT,
        max_tokens=MAX_TOKENS,
        stream=True,
        stream_options={"include_usage": True},
    )
    *deltas, usage_chunk = chunks
    assert "".join(chunk.choices[0].text for chunk in deltas) == whole.choices[0].text
    assert len({chunk.id for chunk in chunks}) == 1
    assert not usage_chunk.choices and usage_chunk.usage.total_tokens == whole.usage.total_tokens
    # No empty end-of-events message: that framing is for REST only.
    assert all(json_format.MessageToDict(chunk) for chunk in chunks)


def test_grpc_validation_error_carries_field_violations(
    grpc_stub: completions_pb2_grpc.CompletionServiceStub,
) -> None:
    from google.rpc import error_details_pb2
    from grpc_status import rpc_status

    try:
        grpc_complete(grpc_stub, prompt=CAPITAL_PROMPT, temperature=3, top_p=0)
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        status = rpc_status.from_call(error)
        bad_request = error_details_pb2.BadRequest()
        assert status.details[0].Unpack(bad_request)
        fields = [violation.field for violation in bad_request.field_violations]
        assert fields == ["temperature", "top_p"]
    else:
        raise AssertionError("temperature 3 must be refused")


def test_grpc_unknown_model_is_not_found(
    grpc_stub: completions_pb2_grpc.CompletionServiceStub,
) -> None:
    try:
        grpc_complete(grpc_stub, prompt=CAPITAL_PROMPT, model="no-such-model")
    except grpc.RpcError as error:
        assert error.code() == grpc.StatusCode.NOT_FOUND
    else:
        raise AssertionError("an unknown model must be refused")
