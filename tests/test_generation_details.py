"""vLLM's completion extras on the real stack, beside their parity with vLLM's own server
(tests/test_vllm_parity.py): streamed token ids that add up to the whole reply's, every invalid
value refused on both surfaces, truncation past the context refused, and a priority refused by a
first-come server with the option that enables it named."""

from __future__ import annotations

import grpc
import httpx
import pytest
from llmcompletions.v2 import completions_pb2_grpc

from tests.conftest import GRPC_AUTH
from tests.helpers import CAPITAL_PROMPT, body, complete, grpc_request, post, stream_chunks

STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def test_streamed_token_ids_add_up_to_the_whole_replys(rest: httpx.Client) -> None:
    fields = {"prompt": STORY, "max_tokens": 16, "return_token_ids": True}
    whole = complete(rest, **fields)["choices"][0]
    chunks = stream_chunks(rest, **fields)
    streamed = [token for chunk in chunks for token in chunk["choices"][0]["token_ids"]]
    assert streamed == whole["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in chunk["choices"][0] for chunk in chunks[1:])


INVALID = [
    ({"prompt_logprobs": 6}, "prompt_logprobs"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
    ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
    ({"truncation_side": "middle"}, "truncation_side"),
    ({"allowed_token_ids": [49152]}, "allowed_token_ids"),
]


@pytest.mark.parametrize(("fields", "field"), INVALID)
def test_invalid_extras_are_refused_on_rest(rest: httpx.Client, fields: dict, field: str) -> None:
    refused = post(rest, body(prompt=CAPITAL_PROMPT, max_tokens=1, **fields))
    assert refused.status_code == 422, refused.text
    assert refused.json()["detail"][0]["loc"][:2] == ["body", field]


@pytest.mark.parametrize(("fields", "field"), INVALID)
def test_invalid_extras_are_refused_on_grpc(
    grpc_stub: completions_pb2_grpc.CompletionServiceStub, fields: dict, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        list(
            grpc_stub.CreateCompletion(
                grpc_request(prompt=CAPITAL_PROMPT, max_tokens=1, **fields),
                timeout=60,
                metadata=GRPC_AUTH,
            )
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert field in refused.value.details()


def test_truncation_to_more_than_the_context_is_a_bad_request(rest: httpx.Client) -> None:
    refused = post(rest, body(prompt=CAPITAL_PROMPT, max_tokens=1, truncate_prompt_tokens=10**6))
    assert refused.status_code == 400
    assert "truncate_prompt_tokens" in refused.json()["detail"]


def test_a_priority_on_a_first_come_server_is_refused_naming_the_option(
    rest: httpx.Client, grpc_stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    assert post(rest, body(prompt="Hi", max_tokens=1, priority=0)).status_code == 200
    refused = post(rest, body(prompt="Hi", max_tokens=1, priority=5))
    assert refused.status_code == 400
    assert "--scheduling-policy priority" in refused.json()["detail"]
    with pytest.raises(grpc.RpcError) as raised:
        list(
            grpc_stub.CreateCompletion(
                grpc_request(prompt="Hi", max_tokens=1, priority=-1), timeout=60, metadata=GRPC_AUTH
            )
        )
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
