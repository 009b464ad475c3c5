"""`logprobs` and `echo`: what users check of the returned log-probabilities."""

from __future__ import annotations

import math

import httpx

from tests.helpers import CAPITAL_PROMPT, complete, stream_chunks

LOGPROB_KEYS = ("tokens", "token_logprobs", "top_logprobs", "text_offset")


def test_logprobs_shape_and_offsets(rest: httpx.Client) -> None:
    choice = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=8, logprobs=3)["choices"][0]
    logprobs = choice["logprobs"]
    tokens = logprobs["tokens"]
    assert "".join(tokens) == choice["text"]
    assert len(tokens) == len(logprobs["token_logprobs"]) == len(logprobs["top_logprobs"]) == 8
    assert logprobs["text_offset"] == [len("".join(tokens[:i])) for i in range(len(tokens))]
    steps = zip(tokens, logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True)
    for token, logprob, top in steps:
        assert logprob <= 0
        assert token in top and math.isclose(top[token], logprob)
        assert 3 <= len(top) <= 4
        # Greedy: the chosen token is the most likely one.
        assert logprob == max(top.values())


def test_no_logprobs_unless_asked(rest: httpx.Client) -> None:
    choice = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=4)["choices"][0]
    assert choice.get("logprobs") is None


def test_echo_puts_prompt_tokens_first_with_a_null(rest: httpx.Client) -> None:
    choice = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=4, logprobs=1, echo=True)["choices"][
        0
    ]
    logprobs = choice["logprobs"]
    assert choice["text"].startswith(CAPITAL_PROMPT)
    assert "".join(logprobs["tokens"]) == choice["text"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(value is not None for value in logprobs["token_logprobs"][1:])
    assert len(logprobs["tokens"]) == 5 + 4


def test_streamed_logprobs_concatenate_to_the_whole(rest: httpx.Client) -> None:
    whole = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=10, logprobs=2, echo=True)
    chunks = stream_chunks(rest, prompt=CAPITAL_PROMPT, max_tokens=10, logprobs=2, echo=True)
    merged: dict[str, list] = {
        "tokens": [],
        "token_logprobs": [],
        "top_logprobs": [],
        "text_offset": [],
    }
    for chunk in chunks:
        for key in merged:
            merged[key] += chunk["choices"][0]["logprobs"][key]
    expected = whole["choices"][0]["logprobs"]
    assert merged["tokens"] == expected["tokens"]
    assert merged["text_offset"] == expected["text_offset"]
    assert merged["token_logprobs"][0] is None
    pairs = zip(merged["token_logprobs"][1:], expected["token_logprobs"][1:], strict=True)
    for streamed, plain in pairs:
        assert math.isclose(streamed, plain, abs_tol=1e-4)
