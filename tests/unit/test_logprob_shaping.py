"""service/api/logprobs.py: vLLM's per-position log-probabilities in the completion API's shape."""

from __future__ import annotations

import math

import pytest
from google.protobuf import json_format
from llmcompletions.v2.completions_pb2 import Logprobs
from unit_fakes import FakeTokenizer, logprob_step

from service.api.logprobs import LOGPROB_FLOOR, clamp, decoded, next_offset, token_logprobs


def shaped(logprobs: Logprobs) -> dict:
    return json_format.MessageToDict(logprobs, preserving_proto_field_name=True)


def test_chosen_token_first_then_top_k(fake_tokenizer: FakeTokenizer) -> None:
    # The chosen token (" Lyon", rank 3) is not among the top 2: vLLM lists it first anyway.
    step = logprob_step((9, -2.0), (7, -0.1), (8, -1.5))
    result = shaped(token_logprobs([9], [step], 2, fake_tokenizer, 0))
    assert result == {
        "tokens": [" Lyon"],
        "token_logprobs": [-2.0],
        "top_logprobs": [{" Lyon": -2.0, " Paris": -0.1, ".": -1.5}],
        "text_offset": [0],
    }


def test_top_k_limits_the_alternatives_to_k_plus_the_chosen(
    fake_tokenizer: FakeTokenizer,
) -> None:
    step = logprob_step((9, -2.0), (7, -0.1), (8, -1.5), (10, -3.0))
    tops = [
        shaped(token_logprobs([9], [step], k, fake_tokenizer, 0))["top_logprobs"][0]
        for k in (0, 1, 2, 5)
    ]
    # A JSON object: which tokens are in it matters, not their order.
    assert [set(top) for top in tops] == [
        {" Lyon"},
        {" Lyon", " Paris"},
        {" Lyon", " Paris", "."},
        {" Lyon", " Paris", ".", " A"},
    ]


def test_a_chosen_token_among_the_top_k_appears_once(fake_tokenizer: FakeTokenizer) -> None:
    step = logprob_step((7, -0.1), (7, -0.1), (9, -2.0))  # chosen == rank 1
    top = shaped(token_logprobs([7], [step], 2, fake_tokenizer, 0))["top_logprobs"][0]
    assert top == {" Paris": -0.1, " Lyon": -2.0}


def test_steps_without_logprobs_are_nulls_and_offsets_still_count(
    fake_tokenizer: FakeTokenizer,
) -> None:
    steps = [None, logprob_step((3, -0.5)), logprob_step((9, -0.7))]  # 4 missing from its step
    result = token_logprobs([2, 3, 4], steps, 0, fake_tokenizer, 10)
    assert list(result.tokens) == ["The", " capital", " of"]
    assert [v.WhichOneof("kind") for v in result.token_logprobs] == [
        "null_value",
        "number_value",
        "null_value",
    ]
    assert result.token_logprobs[1].number_value == -0.5
    assert [v.WhichOneof("kind") for v in result.top_logprobs] == [
        "null_value",
        "struct_value",
        "null_value",
    ]
    assert list(result.text_offset) == [10, 13, 21]
    assert next_offset(result, 10) == 24


def test_decoded_text_comes_from_vllm_or_else_the_tokenizer(
    fake_tokenizer: FakeTokenizer,
) -> None:
    with_text = logprob_step((7, -0.1))
    assert decoded(7, with_text[7], fake_tokenizer) == " Paris"
    assert fake_tokenizer.decode_calls == []
    without_text = logprob_step((7, -0.1), decoded=False)
    assert decoded(7, without_text[7], fake_tokenizer) == " Paris"
    assert decoded(15, None, fake_tokenizer) == "é"
    assert fake_tokenizer.decode_calls == [[7], [15]]


def test_offsets_count_characters_of_the_decoded_tokens(fake_tokenizer: FakeTokenizer) -> None:
    steps = [logprob_step((15, -1.0)), logprob_step((7, -1.0)), logprob_step((8, -1.0))]
    result = token_logprobs([15, 7, 8], steps, 0, fake_tokenizer, 0)
    assert list(result.text_offset) == [0, 1, 7]


def test_impossible_tokens_are_clamped_to_the_floor(fake_tokenizer: FakeTokenizer) -> None:
    assert clamp(-math.inf) == LOGPROB_FLOOR == -9999.0
    assert clamp(-12.5) == -12.5
    step = logprob_step((7, -math.inf), (9, -1e6))
    result = shaped(token_logprobs([7], [step], 1, fake_tokenizer, 0))
    assert result["token_logprobs"] == [-9999.0]
    assert result["top_logprobs"] == [{" Paris": -9999.0, " Lyon": -9999.0}]


def test_no_tokens_leave_the_offset_where_it_was(fake_tokenizer: FakeTokenizer) -> None:
    empty = token_logprobs([], [], 3, fake_tokenizer, 42)
    assert shaped(empty) == {}
    assert next_offset(empty, 42) == 42
    assert next_offset(Logprobs(), 0) == 0


def test_tokens_and_steps_must_pair_up(fake_tokenizer: FakeTokenizer) -> None:
    with pytest.raises(ValueError):
        token_logprobs([7, 8], [logprob_step((7, -0.1))], 0, fake_tokenizer, 0)
