"""The four forms of `prompt`, and sampling controls that users check by their effect."""

from __future__ import annotations

import httpx
from transformers import PreTrainedTokenizerBase

from tests.helpers import CAPITAL_PROMPT, complete


def test_all_four_prompt_forms_give_the_same_completion(
    rest: httpx.Client, tokenizer: PreTrainedTokenizerBase
) -> None:
    token_ids = tokenizer(CAPITAL_PROMPT).input_ids
    as_text = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=6)
    as_texts = complete(rest, prompt=[CAPITAL_PROMPT, CAPITAL_PROMPT], max_tokens=6)
    as_ids = complete(rest, prompt=token_ids, max_tokens=6)
    as_id_lists = complete(rest, prompt=[token_ids, token_ids], max_tokens=6)
    expected = as_text["choices"][0]["text"]
    assert expected.startswith(" Paris")
    for result in (as_texts, as_ids, as_id_lists):
        assert {choice["text"] for choice in result["choices"]} == {expected}
    assert as_ids["usage"]["prompt_tokens"] == len(token_ids)
    assert as_id_lists["usage"]["prompt_tokens"] == 2 * len(token_ids)


def test_echo_prepends_the_prompt(rest: httpx.Client) -> None:
    plain = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=5)["choices"][0]["text"]
    echoed = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=5, echo=True)["choices"][0]["text"]
    assert echoed == CAPITAL_PROMPT + plain


def test_echo_with_max_tokens_0_returns_the_prompt_alone(rest: httpx.Client) -> None:
    result = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=0, echo=True)
    assert result["choices"][0]["text"] == CAPITAL_PROMPT
    assert result["usage"]["completion_tokens"] == 0


def test_same_seed_same_output_other_seed_other_output(rest: httpx.Client) -> None:
    def sample(seed: int) -> list[str]:
        result = complete(
            rest, prompt="Once upon a time", max_tokens=16, temperature=1.0, seed=seed, n=2
        )
        return [choice["text"] for choice in result["choices"]]

    assert sample(11) == sample(11)
    assert sample(11) != sample(12)


def test_top_k_1_is_greedy(rest: httpx.Client) -> None:
    greedy = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=10)["choices"][0]["text"]
    sampled = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=10, temperature=1.5, top_k=1, seed=5)
    assert sampled["choices"][0]["text"] == greedy


def test_stop_token_ids_end_generation(
    rest: httpx.Client, tokenizer: PreTrainedTokenizerBase
) -> None:
    greedy = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=10)["choices"][0]["text"]
    paris_id = tokenizer(" Paris", add_special_tokens=False).input_ids[0]
    result = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=10, stop_token_ids=[paris_id])
    assert result["choices"][0]["finish_reason"] == "stop"
    assert result["usage"]["completion_tokens"] == 1
    assert greedy.startswith(" Paris")


def test_min_tokens_and_ignore_eos_hold_back_the_end(rest: httpx.Client) -> None:
    prompt = "<|im_start|>user\nSay yes.<|im_end|>\n<|im_start|>assistant\n"
    short = complete(rest, prompt=prompt, max_tokens=40)
    assert short["choices"][0]["finish_reason"] == "stop", "the model should end its answer"
    ended_at = short["usage"]["completion_tokens"]
    held = complete(rest, prompt=prompt, max_tokens=40, min_tokens=ended_at + 5)
    assert held["usage"]["completion_tokens"] >= ended_at + 5
    forced = complete(rest, prompt=prompt, max_tokens=40, ignore_eos=True)
    assert forced["usage"]["completion_tokens"] == 40
    assert forced["choices"][0]["finish_reason"] == "length"


def test_penalties_change_a_repetitive_greedy_text(rest: httpx.Client) -> None:
    prompt = "apple apple apple apple apple"
    base = complete(rest, prompt=prompt, max_tokens=12)["choices"][0]["text"]
    for penalty in ({"frequency_penalty": 2}, {"presence_penalty": 2}, {"repetition_penalty": 2}):
        changed = complete(rest, prompt=prompt, max_tokens=12, **penalty)["choices"][0]["text"]
        assert changed != base, penalty


def test_top_p_and_min_p_narrow_sampling_to_the_top_token(rest: httpx.Client) -> None:
    greedy = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=8)["choices"][0]["text"]
    for narrowing in ({"top_p": 0.01}, {"min_p": 1.0}):
        sampled = complete(
            rest, prompt=CAPITAL_PROMPT, max_tokens=8, temperature=1.5, seed=9, **narrowing
        )
        assert sampled["choices"][0]["text"] == greedy, narrowing


def test_user_is_accepted(rest: httpx.Client) -> None:
    assert complete(rest, prompt=CAPITAL_PROMPT, max_tokens=2, user="user-123")["choices"]
