"""Our REST surface returns what vLLM's own OpenAI server returns for the same request."""

from __future__ import annotations

import uuid
from typing import Any

import httpx
import pytest
from llmcompletions.v2 import completions_pb2_grpc

from tests.conftest import MODEL
from tests.helpers import CAPITAL_PROMPT, complete, grpc_complete, stream_chunks

PROMPTS = [CAPITAL_PROMPT, "def fibonacci(n):", "Once upon a time, in a small village,"]
END_TOKEN_ID = 2  # <|im_end|>, forced below so that special tokens reach the output
FIELD_VARIANTS = [
    {},
    {"logit_bias": {str(END_TOKEN_ID): 100}, "ignore_eos": True, "skip_special_tokens": False},
    {
        "logit_bias": {str(END_TOKEN_ID): 100},
        "ignore_eos": True,
        "skip_special_tokens": False,
        "spaces_between_special_tokens": False,
    },
    {"stop": ["."], "include_stop_str_in_output": True},
    {"min_tokens": 20, "stop_token_ids": [13]},
]


@pytest.mark.parametrize("prompt", PROMPTS)
@pytest.mark.parametrize("fields", FIELD_VARIANTS)
def test_greedy_text_and_usage_equal_vllm_openai_server(
    rest: httpx.Client, vllm_server: str, prompt: str, fields: dict
) -> None:
    request = {"model": MODEL, "prompt": prompt, "max_tokens": 32, "temperature": 0, **fields}
    theirs = httpx.post(f"{vllm_server}/v1/completions", json=request, timeout=120).json()
    ours = complete(rest, prompt=prompt, max_tokens=32, **fields)
    assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]
    assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert {key: ours["usage"][key] for key in counts} == {
        key: theirs["usage"][key] for key in counts
    }


def test_cached_tokens_equal_vllm_openai_server(
    rest: httpx.Client, grpc_stub: completions_pb2_grpc.CompletionServiceStub, vllm_server: str
) -> None:
    """A long prompt new to both servers, then the same prompt again: the prefix-cache hits
    both report, whole and streamed, REST and gRPC."""
    prompt = f"Request {uuid.uuid4()}: " + " ".join(f"item {i}," for i in range(120))
    request = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}

    def theirs() -> int:
        reply = httpx.post(f"{vllm_server}/v1/completions", json=request, timeout=120).json()
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    def ours_rest() -> int:
        return complete(rest, prompt=prompt, max_tokens=2)["usage"]["prompt_tokens_details"][
            "cached_tokens"
        ]

    fresh_theirs, fresh_ours = theirs(), ours_rest()
    assert fresh_ours == fresh_theirs == 0
    again_theirs, again_ours = theirs(), ours_rest()
    assert again_ours == again_theirs > 0
    streamed = stream_chunks(
        rest, prompt=prompt, max_tokens=2, stream_options={"include_usage": True}
    )
    assert streamed[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] == again_ours
    (grpc_reply,) = grpc_complete(grpc_stub, prompt=prompt, max_tokens=2)
    assert grpc_reply.usage.prompt_tokens_details.cached_tokens == again_ours


LOGPROB_TOLERANCE = 1e-4


def assert_logprobs_close(ours: dict, theirs: dict) -> None:
    assert ours["tokens"] == theirs["tokens"]
    assert ours["text_offset"] == theirs["text_offset"]
    for mine, other in zip(ours["token_logprobs"], theirs["token_logprobs"], strict=True):
        assert (mine is None) == (other is None)
        if mine is not None:
            assert mine == pytest.approx(other, abs=LOGPROB_TOLERANCE)
    for mine, other in zip(ours["top_logprobs"], theirs["top_logprobs"], strict=True):
        assert (mine is None) == (other is None)
        if mine is not None:
            assert mine.keys() == other.keys()
            for token, value in mine.items():
                assert value == pytest.approx(other[token], abs=LOGPROB_TOLERANCE)


@pytest.mark.parametrize(
    "extra",
    [
        {"logprobs": 3},
        {"logprobs": 0},
        {"logprobs": 2, "echo": True},
        {"logprobs": 1, "echo": True, "max_tokens": 0},
    ],
)
def test_greedy_logprobs_equal_vllm_openai_server(
    rest: httpx.Client, vllm_server: str, extra: dict
) -> None:
    request = {"model": MODEL, "prompt": CAPITAL_PROMPT, "max_tokens": 12, "temperature": 0}
    request.update(extra)
    theirs = httpx.post(f"{vllm_server}/v1/completions", json=request, timeout=120).json()
    ours = complete(rest, **{k: v for k, v in request.items() if k not in ("model", "temperature")})
    assert ours["choices"][0]["text"] == theirs["choices"][0]["text"]
    assert_logprobs_close(ours["choices"][0]["logprobs"], theirs["choices"][0]["logprobs"])


# ---- vLLM's completion extras: the same answers as vLLM's own server

STORY = "Once upon a time, in a small village by the sea, there lived an old fisherman who"


def theirs(vllm_server: str, **fields: Any) -> dict[str, Any]:
    request = {"model": MODEL, "temperature": 0, **fields}
    reply = httpx.post(f"{vllm_server}/v1/completions", json=request, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()


def both(rest: httpx.Client, vllm_server: str, **fields: Any) -> tuple[dict, dict]:
    """(our choice, vLLM's choice) and the usages, for the same greedy request."""
    ours = complete(rest, **fields)
    other = theirs(vllm_server, **fields)
    assert ours["usage"]["prompt_tokens"] == other["usage"]["prompt_tokens"]
    return ours["choices"][0], other["choices"][0]


def test_token_ids_equal_vllms(rest: httpx.Client, vllm_server: str) -> None:
    ours, other = both(
        rest, vllm_server, prompt=CAPITAL_PROMPT, max_tokens=12, return_token_ids=True
    )
    assert ours["token_ids"] == other["token_ids"] and len(ours["token_ids"]) > 0
    assert ours["prompt_token_ids"] == other["prompt_token_ids"]


def test_prompt_logprobs_equal_vllms(rest: httpx.Client, vllm_server: str) -> None:
    ours, other = both(rest, vllm_server, prompt=STORY, max_tokens=1, prompt_logprobs=2)
    mine, reference = ours["prompt_logprobs"], other["prompt_logprobs"]
    assert len(mine) == len(reference) > 5 and mine[0] is None and reference[0] is None
    for step, expected in zip(mine[1:], reference[1:], strict=True):
        assert step.keys() == expected.keys()
        for token_id, entry in step.items():
            assert entry["logprob"] == pytest.approx(
                expected[token_id]["logprob"], abs=LOGPROB_TOLERANCE
            )
            assert entry["rank"] == expected[token_id]["rank"]
            assert entry["decoded_token"] == expected[token_id]["decoded_token"]


@pytest.mark.parametrize(
    "fields",
    [
        {"stop": ["."]},  # a stop string: the string
        {"stop_token_ids": [13], "min_tokens": 2},  # a stop token: its id
        {"logit_bias": {str(END_TOKEN_ID): 100}},  # the end of sequence: null
        {"max_tokens": 2},  # the length limit: null
    ],
    ids=["stop string", "stop token", "eos", "length"],
)
def test_stop_reason_equals_vllms(
    rest: httpx.Client,
    vllm_server: str,
    fields: dict,
) -> None:
    request = {"prompt": CAPITAL_PROMPT, "max_tokens": 24, **fields}
    ours, other = both(rest, vllm_server, **request)
    assert ours["finish_reason"] == other["finish_reason"]
    assert ours["stop_reason"] == other["stop_reason"]
    assert ours["text"] == other["text"]


@pytest.mark.parametrize("side", ["left", "right", None])
@pytest.mark.parametrize("keep", [5, 12])
def test_truncation_equals_vllms(
    rest: httpx.Client,
    vllm_server: str,
    side: str | None,
    keep: int,
) -> None:
    fields: dict[str, Any] = {"prompt": STORY, "max_tokens": 8, "truncate_prompt_tokens": keep}
    if side is not None:
        fields["truncation_side"] = side
    ours, other = both(rest, vllm_server, **fields)
    assert ours["text"] == other["text"]
    assert complete(rest, **fields)["usage"]["prompt_tokens"] == keep


def test_logprob_tokens_as_token_ids_equal_vllms(
    rest: httpx.Client,
    vllm_server: str,
) -> None:
    fields = {"prompt": CAPITAL_PROMPT, "max_tokens": 6, "logprobs": 2}
    ours, other = both(rest, vllm_server, return_tokens_as_token_ids=True, **fields)
    assert ours["logprobs"]["tokens"] == other["logprobs"]["tokens"]
    assert all(token.startswith("token_id:") for token in ours["logprobs"]["tokens"])
    assert [set(top) for top in ours["logprobs"]["top_logprobs"]] == [
        set(top) for top in other["logprobs"]["top_logprobs"]
    ]


def test_allowed_token_ids_equal_vllms(rest: httpx.Client, vllm_server: str) -> None:
    allowed = [504, 3575, 314, 2114]
    ours, other = both(
        rest,
        vllm_server,
        prompt=CAPITAL_PROMPT,
        max_tokens=6,
        allowed_token_ids=allowed,
        return_token_ids=True,
    )
    assert ours["token_ids"] == other["token_ids"]
    assert set(ours["token_ids"]) <= set(allowed)
