"""Beam search: `use_beam_search` with its width, `length_penalty` and `early_stopping`."""

from __future__ import annotations

import math

import httpx
import pytest

from tests.helpers import CAPITAL_PROMPT, body, complete, post

CHAT = "<|im_start|>user\nName a fruit.<|im_end|>\n<|im_start|>assistant\n"


def total_logprob(choice: dict) -> float:
    return sum(choice["logprobs"]["token_logprobs"])


def test_beams_are_distinct_best_first_and_beat_greedy(rest: httpx.Client) -> None:
    fixed_length = {"prompt": "The best fruit is", "max_tokens": 6, "ignore_eos": True}
    greedy = complete(rest, logprobs=0, **fixed_length)["choices"][0]
    beams = complete(
        rest, use_beam_search=True, n=3, best_of=4, length_penalty=0, logprobs=0, **fixed_length
    )["choices"]
    assert [choice["index"] for choice in beams] == [0, 1, 2]
    assert len({choice["text"] for choice in beams}) == 3
    scores = [total_logprob(choice) for choice in beams]
    assert scores == sorted(scores, reverse=True)
    assert scores[0] >= total_logprob(greedy) - 1e-4


def test_length_penalty_changes_which_beams_win(rest: httpx.Client) -> None:
    # 16 steps: the short winner ends by itself (13 tokens), the long one runs to the limit
    # (every step of beam search is an engine request per beam).
    request = {"prompt": CHAT, "max_tokens": 16, "use_beam_search": True, "n": 1, "best_of": 4}
    short = complete(rest, length_penalty=-2.0, **request)["usage"]["completion_tokens"]
    long = complete(rest, length_penalty=2.0, **request)["usage"]["completion_tokens"]
    assert short < long


def test_early_stopping_forms(rest: httpx.Client) -> None:
    # Each form is taken and answered; 12 steps of three beams keep it short (a step of beam
    # search is an engine request per beam).
    request = {"prompt": CHAT, "max_tokens": 12, "use_beam_search": True, "n": 2, "best_of": 3}
    lengths = {}
    for value in (True, False, "never"):
        result = complete(rest, early_stopping=value, **request)
        assert len(result["choices"]) == 2
        lengths[str(value)] = result["usage"]["completion_tokens"]
    assert lengths["True"] <= lengths["never"]
    refused = post(rest, body(prompt=CHAT, use_beam_search=True, early_stopping="sometimes"))
    assert refused.status_code == 422
    assert refused.json()["detail"][0]["loc"] == ["body", "early_stopping"]


def test_beam_search_cannot_be_streamed(rest: httpx.Client) -> None:
    response = post(rest, body(prompt=CHAT, use_beam_search=True, stream=True))
    assert response.status_code == 422
    assert "cannot be streamed" in response.json()["detail"][0]["msg"]


@pytest.mark.parametrize("logprobs", [0, 2])
def test_each_beams_tokens_are_among_their_top_logprobs(rest: httpx.Client, logprobs: int) -> None:
    beams = complete(
        rest,
        prompt="The best fruit is",
        max_tokens=6,
        ignore_eos=True,
        use_beam_search=True,
        n=3,
        best_of=3,
        logprobs=logprobs,
    )["choices"]
    # Distinct beams: all but one took a token that was not the most likely at some step.
    assert len({choice["text"] for choice in beams}) == 3
    below_the_top = 0
    for choice in beams:
        shown = choice["logprobs"]
        steps = zip(shown["tokens"], shown["token_logprobs"], shown["top_logprobs"], strict=True)
        for token, logprob, top in steps:
            assert token in top and math.isclose(top[token], logprob)
            assert max(logprobs, 1) <= len(top) <= logprobs + 1
            below_the_top += logprob < max(top.values())
    assert below_the_top > 0 or logprobs == 0  # with 0 each shows its own token alone


def test_beam_search_echo_scores_every_prompt_token_but_the_first(rest: httpx.Client) -> None:
    request = {"prompt": CAPITAL_PROMPT, "max_tokens": 3, "echo": True, "logprobs": 1}
    sampled = complete(rest, **request)["choices"][0]["logprobs"]
    result = complete(rest, use_beam_search=True, n=1, best_of=2, **request)
    (beam,) = result["choices"]
    logprobs = beam["logprobs"]
    assert beam["text"].startswith(CAPITAL_PROMPT)
    assert "".join(logprobs["tokens"]) == beam["text"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert all(value is not None for value in logprobs["token_logprobs"][1:])
    # The prompt's log-probabilities are the prompt's, however the completion is searched.
    prompt_tokens = result["usage"]["prompt_tokens"]
    assert logprobs["tokens"][:prompt_tokens] == sampled["tokens"][:prompt_tokens]
    for mine, theirs in zip(
        logprobs["token_logprobs"][1:prompt_tokens],
        sampled["token_logprobs"][1:prompt_tokens],
        strict=True,
    ):
        assert math.isclose(mine, theirs, abs_tol=1e-3)


def test_the_widest_beam_search_the_api_allows_runs(rest: httpx.Client) -> None:
    # Width 20 asks the engine for 40 log-probabilities per step, over vLLM's default cap.
    beams = complete(
        rest, prompt="Fruit:", use_beam_search=True, n=2, best_of=20, max_tokens=2, ignore_eos=True
    )["choices"]
    assert len(beams) == 2 and beams[0]["text"] != beams[1]["text"]
