"""Token-level controls, each shown by its effect on the output."""

from __future__ import annotations

import httpx
from transformers import PreTrainedTokenizerBase

from tests.helpers import CAPITAL_PROMPT, body, complete, post


def token_id(tokenizer: PreTrainedTokenizerBase, text: str) -> int:
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert len(ids) == 1, f"{text!r} is not one token"
    return ids[0]


def test_logit_bias_plus_100_forces_a_token(
    rest: httpx.Client, tokenizer: PreTrainedTokenizerBase
) -> None:
    banana = token_id(tokenizer, " banana")
    result = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=3, logit_bias={str(banana): 100})
    assert result["choices"][0]["text"] == " banana" * 3


def test_logit_bias_minus_100_bans_a_token(
    rest: httpx.Client, tokenizer: PreTrainedTokenizerBase
) -> None:
    paris = token_id(tokenizer, " Paris")
    result = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=3, logit_bias={str(paris): -100})
    assert not result["choices"][0]["text"].startswith(" Paris")


def test_logit_bias_keys_must_be_in_the_vocabulary(rest: httpx.Client) -> None:
    response = post(rest, body(prompt="Hi", logit_bias={"49152": 5}))
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body", "logit_bias", "49152"]
    response = post(rest, body(prompt="Hi", logit_bias={"12": 101}))
    assert response.status_code == 422


def test_include_stop_str_in_output_keeps_the_stop(rest: httpx.Client) -> None:
    cut = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=12, stop=["."])["choices"][0]
    kept = complete(
        rest, prompt=CAPITAL_PROMPT, max_tokens=12, stop=["."], include_stop_str_in_output=True
    )["choices"][0]
    assert kept["text"] == cut["text"] + "."
    assert kept["finish_reason"] == "stop"


def test_skip_special_tokens_false_shows_them(
    rest: httpx.Client, tokenizer: PreTrainedTokenizerBase
) -> None:
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    forced = {"max_tokens": 2, "logit_bias": {str(end): 100}, "ignore_eos": True}
    hidden = complete(rest, prompt=CAPITAL_PROMPT, **forced)["choices"][0]["text"]
    shown = complete(rest, prompt=CAPITAL_PROMPT, skip_special_tokens=False, **forced)
    assert hidden == ""
    # This byte-level tokenizer puts no spaces between special tokens either way; the parity
    # tests check spaces_between_special_tokens against vLLM's own server.
    assert shown["choices"][0]["text"] == "<|im_end|><|im_end|>"


def test_suffix_is_refused_as_unsupported(rest: httpx.Client) -> None:
    response = post(rest, body(prompt="Hi", suffix=" end"))
    assert response.status_code == 422
    assert "not supported" in response.json()["detail"][0]["msg"]
    assert post(rest, body(prompt="Hi", max_tokens=1, suffix="")).status_code == 200


def test_best_of_returns_the_candidate_with_the_best_mean_logprob(rest: httpx.Client) -> None:
    sampling = {"prompt": "Once upon a time", "max_tokens": 8, "temperature": 1.2, "seed": 21}
    candidates = complete(rest, n=4, logprobs=0, **sampling)["choices"]

    def mean(choice: dict) -> float:
        values = choice["logprobs"]["token_logprobs"]
        return sum(values) / len(values)

    ranked = sorted(candidates, key=mean, reverse=True)
    best = complete(rest, n=2, best_of=4, logprobs=0, **sampling)
    assert [choice["text"] for choice in best["choices"]] == [c["text"] for c in ranked[:2]]
    assert [choice["index"] for choice in best["choices"]] == [0, 1]
    assert best["usage"]["completion_tokens"] == sum(
        len(c["logprobs"]["tokens"]) for c in candidates
    )


def test_best_of_cannot_be_streamed_above_n(rest: httpx.Client) -> None:
    response = post(rest, body(prompt="Hi", best_of=3, n=1, stream=True))
    assert response.status_code == 422
    assert "cannot be streamed" in response.json()["detail"][0]["msg"]
    assert post(rest, body(prompt="Hi", best_of=0)).status_code == 422
    assert post(rest, body(prompt="Hi", best_of=21)).status_code == 422
    assert post(rest, body(prompt="Hi", n=3, best_of=2)).status_code == 422
