"""Our REST surface returns what vLLM's own OpenAI server returns for the same request."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from llmcompletions.v2 import completions_pb2_grpc

from bench.servers import VllmOpenAIServer
from tests.conftest import MAX_MODEL_LEN, MODEL
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


@pytest.fixture(scope="module")
def vllm_server(model_dir: Path) -> Iterator[str]:
    """vLLM's own OpenAI server on the same model directory and context length, with prefix
    caching on (as ours has it) and its hits reported."""
    server = VllmOpenAIServer(
        model_dir,
        MODEL,
        max_model_len=MAX_MODEL_LEN,
        kv_cache_gib=1,
        extra_args=["--enable-prompt-tokens-details"],
        prefix_caching=True,
    )
    try:
        server.wait_ready()
        yield server.base_url
    finally:
        server.stop()


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
