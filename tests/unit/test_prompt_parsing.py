"""service/api/prompts.py: the four forms of `prompt`, what is refused and where, and turning
prompts into token ids and echo text (with a small word-level tokenizer)."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import json_format, struct_pb2
from unit_fakes import BOS, VOCAB_SIZE, FakeTokenizer

from service.api.prompts import (
    PreparedPrompt,
    PromptFormError,
    PromptInput,
    parse_prompt,
    prepare_prompts,
)


def value(json_value: Any) -> struct_pb2.Value:
    return json_format.ParseDict(json_value, struct_pb2.Value())


def parse(json_value: Any) -> list[PromptInput]:
    return parse_prompt(value(json_value), VOCAB_SIZE)


def problem(json_value: Any) -> tuple[tuple, str, str]:
    with pytest.raises(PromptFormError) as caught:
        parse(json_value)
    return caught.value.loc, caught.value.type, caught.value.msg


def test_a_string_is_one_text_prompt() -> None:
    assert parse("Hello there") == [PromptInput(text="Hello there")]


def test_a_list_of_strings_is_one_prompt_each() -> None:
    assert parse(["a", "b c"]) == [PromptInput(text="a"), PromptInput(text="b c")]


def test_a_list_of_token_ids_is_one_token_prompt() -> None:
    assert parse([2, 3, 99]) == [PromptInput(token_ids=(2, 3, 99))]


def test_whole_floats_are_token_ids() -> None:
    # JSON numbers arrive as doubles through google.protobuf.Value.
    assert parse([2.0, 0]) == [PromptInput(token_ids=(2, 0))]


def test_a_list_of_token_id_lists_is_one_prompt_each() -> None:
    assert parse([[2, 3], [4]]) == [PromptInput(token_ids=(2, 3)), PromptInput(token_ids=(4,))]


@pytest.mark.parametrize("missing", [None, "null"])
def test_a_missing_prompt_is_required(missing: str | None) -> None:
    prompt = None if missing is None else value(None)
    with pytest.raises(PromptFormError) as caught:
        parse_prompt(prompt, VOCAB_SIZE)
    assert (caught.value.loc, caught.value.type, caught.value.msg) == (
        (),
        "missing",
        "prompt is required",
    )


@pytest.mark.parametrize(
    ("prompt", "loc", "type_"),
    [
        ("", (), "string_too_short"),
        ([], (), "too_short"),
        (["a", ""], (1,), "string_too_short"),
        (["a", 1], (1,), "type_error"),
        (["a", ["b"]], (1,), "type_error"),
        ([1, "a"], (1,), "int_type"),
        ([1, 2.5], (1,), "int_type"),
        ([1, [2]], (1,), "int_type"),
        ([[1], 2], (1,), "type_error"),
        ([[1], []], (1,), "too_short"),
        ([[1], [2, "x"]], (1, 1), "int_type"),
        ([True], (0,), "type_error"),
        ([{"a": 1}], (0,), "type_error"),
        ([None], (0,), "type_error"),
        (5, (), "type_error"),
        (True, (), "type_error"),
        ({"text": "hi"}, (), "type_error"),
    ],
)
def test_forms_outside_the_reference_are_refused_where_they_are(
    prompt: Any, loc: tuple, type_: str
) -> None:
    assert problem(prompt)[:2] == (loc, type_)


@pytest.mark.parametrize(
    ("prompt", "loc", "bad"),
    [([VOCAB_SIZE], (0,), VOCAB_SIZE), ([1, -1], (1,), -1), ([[5], [5, 1000]], (1, 1), 1000)],
)
def test_token_ids_outside_the_vocabulary_are_refused(prompt: Any, loc: tuple, bad: int) -> None:
    assert problem(prompt) == (
        loc,
        "value_error",
        f"token id must be in [0, {VOCAB_SIZE - 1}] (the model's vocabulary), got {bad}",
    )


def test_vocabulary_edges_are_accepted() -> None:
    assert parse([0, VOCAB_SIZE - 1]) == [PromptInput(token_ids=(0, VOCAB_SIZE - 1))]


def test_the_error_is_a_value_error_with_its_message() -> None:
    error = PromptFormError("bad", "type_error", (3,))
    assert isinstance(error, ValueError)
    assert str(error) == "bad"
    assert PromptFormError("plain").type == "value_error"
    assert PromptFormError("plain").loc == ()


def test_text_prompts_are_tokenized_with_or_without_special_tokens(
    fake_tokenizer: FakeTokenizer,
) -> None:
    prompts = [PromptInput(text="The capital of France is")]
    assert prepare_prompts(prompts, fake_tokenizer, add_special_tokens=True) == [
        PreparedPrompt(token_ids=[BOS, 2, 3, 4, 5, 6], text="The capital of France is")
    ]
    assert prepare_prompts(prompts, fake_tokenizer, add_special_tokens=False) == [
        PreparedPrompt(token_ids=[2, 3, 4, 5, 6], text="The capital of France is")
    ]


def test_token_prompts_are_decoded_for_echo_and_keep_their_ids(
    fake_tokenizer: FakeTokenizer,
) -> None:
    prepared = prepare_prompts(
        [PromptInput(token_ids=(BOS, 2, 3)), PromptInput(text="Hi")],
        fake_tokenizer,
        add_special_tokens=False,
    )
    # add_special_tokens concerns text only: token prompts are passed through untouched.
    assert prepared == [
        PreparedPrompt(token_ids=[BOS, 2, 3], text="<s>The capital"),
        PreparedPrompt(token_ids=[14], text="Hi"),
    ]
    assert isinstance(prepared[0].token_ids, list)


def test_parse_then_prepare_keeps_the_order_of_prompts(fake_tokenizer: FakeTokenizer) -> None:
    parsed = parse(["Hi", "The capital", "Hi Paris"])
    prepared = prepare_prompts(parsed, fake_tokenizer, add_special_tokens=True)
    assert [p.token_ids for p in prepared] == [[BOS, 14], [BOS, 2, 3], [BOS, 14, 7]]
    assert [p.text for p in prepared] == ["Hi", "The capital", "Hi Paris"]
