"""Our REST surface returns what vLLM's own OpenAI server returns for the same request."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from bench.servers import VllmOpenAIServer
from tests.conftest import MAX_MODEL_LEN, MODEL
from tests.helpers import CAPITAL_PROMPT, complete

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
    """vLLM's own OpenAI server on the same model directory and context length."""
    server = VllmOpenAIServer(model_dir, MODEL, max_model_len=MAX_MODEL_LEN, kv_cache_gib=1)
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
    assert ours["usage"] == {
        key: theirs["usage"][key] for key in ("prompt_tokens", "completion_tokens", "total_tokens")
    }


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
