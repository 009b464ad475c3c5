"""service/api/validation.py: every limit of the contract, all violations of a request reported
together, and the size limits of RequestLimits."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
from llmcompletions.v2.completions_pb2 import CreateCompletionRequest
from unit_fakes import MODEL, OMIT, VOCAB_SIZE, make_request

from service.api.declared_ranges import Bound
from service.api.errors import RequestValidationError
from service.api.prompts import PromptInput
from service.api.validation import (
    NUMERIC_RANGES,
    describe_range,
    range_violation,
    validate_request,
)
from service.settings import RequestLimits

BACKEND = "xgrammar"


def validate(request: CreateCompletionRequest, limits: RequestLimits | None = None) -> Any:
    if limits is None:
        return validate_request(request, VOCAB_SIZE, BACKEND)
    return validate_request(request, VOCAB_SIZE, BACKEND, limits)


def violations(request: CreateCompletionRequest, limits: RequestLimits | None = None) -> list:
    with pytest.raises(RequestValidationError) as caught:
        validate(request, limits)
    return caught.value.violations


def refused(limits: RequestLimits | None = None, **fields: Any) -> list[tuple[tuple, str]]:
    """(loc, type) of each violation of a request with `fields`, in order."""
    return [(v.loc, v.type) for v in violations(make_request(**fields), limits)]


def test_a_plain_request_gives_its_prompt() -> None:
    assert validate(make_request()) == [PromptInput(text="The capital of France is")]


def test_the_error_is_invalid_argument_naming_the_field() -> None:
    with pytest.raises(RequestValidationError) as caught:
        validate(make_request(temperature=3))
    assert caught.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
    assert "temperature" in caught.value.message


# (field, a value just inside the limit, a value just outside it, the broken bound's type)
LIMITS: list[tuple[str, float, float, str]] = [
    ("max_tokens", 0, -1, "greater_than_equal"),
    ("min_tokens", 0, -1, "greater_than_equal"),
    ("temperature", 0, -0.01, "greater_than_equal"),
    ("temperature", 2, 2.01, "less_than_equal"),
    ("top_p", 0.01, 0, "greater_than"),
    ("top_p", 1, 1.01, "less_than_equal"),
    ("top_k", -1, -2, "greater_than_equal"),
    ("top_k", 1000, -5, "greater_than_equal"),
    ("min_p", 0, -0.1, "greater_than_equal"),
    ("min_p", 1, 1.5, "less_than_equal"),
    ("frequency_penalty", -2, -2.5, "greater_than_equal"),
    ("frequency_penalty", 2, 2.5, "less_than_equal"),
    ("presence_penalty", -2, -2.01, "greater_than_equal"),
    ("presence_penalty", 2, 2.01, "less_than_equal"),
    ("repetition_penalty", 0.01, 0, "greater_than"),
    ("repetition_penalty", 1e6, -1, "greater_than"),
    ("n", 1, 0, "greater_than_equal"),
    ("n", 128, 129, "less_than_equal"),
    ("logprobs", 0, -1, "greater_than_equal"),
    ("logprobs", 5, 6, "less_than_equal"),
    ("prompt_logprobs", 0, -1, "greater_than_equal"),
    ("prompt_logprobs", 5, 6, "less_than_equal"),
    ("truncate_prompt_tokens", -1, -2, "greater_than_equal"),
]


@pytest.mark.parametrize(("field", "inside", "outside", "type_"), LIMITS)
def test_numeric_limit_on_both_sides(field: str, inside: float, outside: float, type_: str) -> None:
    assert validate(make_request(**{field: inside}))
    found = violations(make_request(**{field: outside}))
    assert [(v.loc, v.type) for v in found] == [((field,), type_)]
    assert found[0].msg.startswith(f"{field} must be ")
    assert found[0].msg.endswith(f"got {outside:g}")


def test_every_ranged_field_is_covered_here() -> None:
    unbounded = {"length_penalty"}  # any finite number
    assert {field for field, *_ in LIMITS} | unbounded == set(NUMERIC_RANGES)


@pytest.mark.parametrize(
    ("field", "message"),
    [
        ("temperature", "temperature must be in [0, 2], got 3"),
        ("min_p", "min_p must be in [0, 1], got 3"),
        ("top_p", "top_p must be in (0, 1], got 3"),
        ("repetition_penalty", None),
        ("n", None),
        ("max_tokens", None),
    ],
)
def test_range_messages_name_the_range(field: str, message: str | None) -> None:
    request = make_request(**{field: 3})
    if message is None:
        assert validate(request)  # 3 is fine for these
    else:
        assert [v.msg for v in violations(request)] == [message]


def test_unbounded_sides_are_described() -> None:
    assert describe_range(Bound(0), None) == ">= 0"
    assert describe_range(Bound(0, inclusive=False), None) == "> 0"
    assert describe_range(None, Bound(2, inclusive=False)) == "< 2"
    assert describe_range(None, None) == "a finite number"
    assert range_violation(2, None, Bound(2, inclusive=False)) == "less_than"
    assert range_violation(1.5, None, Bound(2, inclusive=False)) is None
    assert [v.msg for v in violations(make_request(max_tokens=-1))] == [
        "max_tokens must be >= 0, got -1"
    ]
    assert [v.msg for v in violations(make_request(n=200))] == ["n must be in [1, 128], got 200"]
    assert [v.msg for v in violations(make_request(repetition_penalty=0))] == [
        "repetition_penalty must be > 0, got 0"
    ]


@pytest.mark.parametrize("value", ["NaN", "Infinity", "-Infinity"])
@pytest.mark.parametrize(
    "field", ["temperature", "top_p", "min_p", "frequency_penalty", "length_penalty"]
)
def test_non_finite_numbers_are_refused(field: str, value: str) -> None:
    assert refused(**{field: value}) == [((field,), "finite_number")]


@pytest.mark.parametrize("value", [-1e6, -2.5, 0, 1, 7.5])
def test_length_penalty_takes_any_finite_number(value: float) -> None:
    assert validate(make_request(length_penalty=value))


def test_min_tokens_may_reach_max_tokens_but_not_pass_it() -> None:
    assert validate(make_request(max_tokens=3, min_tokens=3))
    found = violations(make_request(max_tokens=3, min_tokens=4))
    assert [(v.loc, v.type, v.msg) for v in found] == [
        (("min_tokens",), "less_than_equal", "min_tokens must be <= max_tokens (3), got 4")
    ]
    # max_tokens defaults to 16
    assert validate(make_request(min_tokens=16))
    assert refused(min_tokens=17) == [(("min_tokens",), "less_than_equal")]


@pytest.mark.parametrize(("n", "best_of"), [(1, 1), (2, 2), (1, 20), (5, 20)])
def test_best_of_between_n_and_20_is_accepted(n: int, best_of: int) -> None:
    assert validate(make_request(n=n, best_of=best_of))


@pytest.mark.parametrize(("n", "best_of"), [(2, 1), (None, 21), (1, 0), (3, 2)])
def test_best_of_outside_n_to_20_is_refused(n: int | None, best_of: int) -> None:
    fields: dict[str, Any] = {"best_of": best_of}
    if n is not None:
        fields["n"] = n
    found = violations(make_request(**fields))
    assert [v.loc for v in found] == [("best_of",)]
    assert f"(n is {n or 1}), got {best_of}" in found[0].msg


# ---- stop


@pytest.mark.parametrize("stop", ["\n", ["a"], ["a", "b", "c", "d"], None])
def test_stop_forms_of_the_reference_are_accepted(stop: Any) -> None:
    assert validate(make_request(stop=stop))


@pytest.mark.parametrize(
    ("stop", "expected"),
    [
        ("", [(("stop",), "string_too_short")]),
        ([], [(("stop",), "too_short")]),
        (["a", "b", "c", "d", "e"], [(("stop",), "too_long")]),
        (["a", ""], [(("stop", 1), "string_type")]),
        (["a", 3], [(("stop", 1), "string_type")]),
        ([1, "", "x"], [(("stop", 0), "string_type"), (("stop", 1), "string_type")]),
        (
            ["", "", "", "", ""],
            [(("stop",), "too_long")] + [(("stop", i), "string_type") for i in range(5)],
        ),
        (7, [(("stop",), "type_error")]),
        (True, [(("stop",), "type_error")]),
        ({"a": "b"}, [(("stop",), "type_error")]),
    ],
)
def test_stop_forms_outside_the_reference_are_refused(stop: Any, expected: list) -> None:
    assert refused(stop=stop) == expected


# ---- token ids: stop_token_ids and logit_bias


def test_token_ids_in_the_vocabulary_are_accepted() -> None:
    request = make_request(
        stop_token_ids=[0, VOCAB_SIZE - 1], logit_bias={"0": -100, str(VOCAB_SIZE - 1): 100}
    )
    assert validate(request)


def test_stop_token_ids_out_of_the_vocabulary_are_refused_each() -> None:
    found = violations(make_request(stop_token_ids=[5, VOCAB_SIZE, -1]))
    assert [v.loc for v in found] == [("stop_token_ids", 1), ("stop_token_ids", 2)]
    assert found[0].msg == (
        f"stop_token_ids: token id must be in [0, {VOCAB_SIZE - 1}] (the model's vocabulary), "
        f"got {VOCAB_SIZE}"
    )


@pytest.mark.parametrize(
    ("bias", "type_"),
    [(100.5, "less_than_equal"), (-101, "greater_than_equal"), ("Infinity", "finite_number")],
)
def test_logit_bias_values_outside_plus_minus_100_are_refused(bias: Any, type_: str) -> None:
    found = violations(make_request(logit_bias={"5": bias, "6": 100, "7": -100}))
    assert [(v.loc, v.type) for v in found] == [(("logit_bias", "5"), type_)]
    assert "logit_bias values must be in [-100, 100]" in found[0].msg


def test_logit_bias_key_and_value_problems_are_both_reported() -> None:
    found = violations(make_request(logit_bias={str(VOCAB_SIZE): 500}))
    assert [(v.loc, v.type) for v in found] == [
        (("logit_bias", str(VOCAB_SIZE)), "value_error"),
        (("logit_bias", str(VOCAB_SIZE)), "less_than_equal"),
    ]
    assert found[0].msg.startswith("logit_bias key: token id must be in [0, 99]")


# ---- beam search's early_stopping


@pytest.mark.parametrize("value", [True, False, "never", None])
def test_early_stopping_true_false_or_never(value: Any) -> None:
    assert validate(make_request(use_beam_search=True, early_stopping=value))


@pytest.mark.parametrize("value", ["sometimes", "Never", 1, [True], {"a": 1}])
def test_other_early_stopping_values_are_refused(value: Any) -> None:
    assert refused(early_stopping=value) == [(("early_stopping",), "literal_error")]


# ---- output constraints and response_format

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize(
    "fields",
    [
        {"guided_json": SCHEMA},
        {"guided_regex": "[a-z]+"},
        {"guided_choice": ["yes", "no"]},
        {"guided_grammar": 'root ::= "yes" | "no"'},
        {"response_format": {"type": "text"}},
        {"response_format": {"type": "json_object"}},
        {
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "a", "schema": SCHEMA},
            }
        },
        {"guided_json": SCHEMA, "response_format": {"type": "text"}},
        {"guided_regex": "x", "guided_decoding_backend": BACKEND},
        {"guided_regex": "x", "guided_decoding_backend": ""},
    ],
)
def test_one_constraint_is_accepted(fields: dict[str, Any]) -> None:
    assert validate(make_request(**fields))


@pytest.mark.parametrize(
    ("fields", "loc", "listed"),
    [
        ({"guided_json": SCHEMA, "guided_regex": "x"}, "guided_regex", "guided_json, guided_regex"),
        (
            {"guided_choice": ["a"], "guided_grammar": "root ::= x"},
            "guided_grammar",
            "guided_choice, guided_grammar",
        ),
        (
            {"guided_regex": "x", "response_format": {"type": "json_object"}},
            "response_format",
            "guided_regex, response_format json_object",
        ),
    ],
)
def test_at_most_one_constraint(fields: dict[str, Any], loc: str, listed: str) -> None:
    found = violations(make_request(**fields))
    assert [(v.loc, v.msg) for v in found] == [
        ((loc,), f"at most one output constraint may be given, got {listed}")
    ]


def test_guided_choice_must_be_non_empty_strings() -> None:
    assert refused(guided_choice=[]) == [(("guided_choice",), "too_short")]
    assert refused(guided_choice=["a", 1, None]) == [
        (("guided_choice", 1), "string_type"),
        (("guided_choice", 2), "string_type"),
    ]


@pytest.mark.parametrize("regex", ["(", "[a-", "a{2,1}", "*"])
def test_guided_regex_must_compile(regex: str) -> None:
    found = violations(make_request(guided_regex=regex))
    assert [(v.loc, v.type) for v in found] == [(("guided_regex",), "value_error")]
    assert found[0].msg.startswith("guided_regex does not compile: ")


def test_another_backend_is_refused_naming_the_running_one() -> None:
    found = violations(make_request(guided_regex="x", guided_decoding_backend="outlines"))
    assert [(v.loc, v.type) for v in found] == [(("guided_decoding_backend",), "literal_error")]
    assert "outlines" in found[0].msg
    assert found[0].msg.endswith("is not available; this server runs: xgrammar")


@pytest.mark.parametrize(
    ("response_format", "expected"),
    [
        ({"type": "yaml"}, [(("response_format", "type"), "literal_error")]),
        ({"type": ""}, [(("response_format", "type"), "literal_error")]),
        ({"type": "json_schema"}, [(("response_format", "json_schema"), "missing")]),
        (
            {"type": "json_schema", "json_schema": {"name": "bad name", "schema": SCHEMA}},
            [(("response_format", "json_schema", "name"), "string_pattern_mismatch")],
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "x" * 65, "schema": SCHEMA}},
            [(("response_format", "json_schema", "name"), "string_pattern_mismatch")],
        ),
        (
            {"type": "json_schema", "json_schema": {"schema": SCHEMA}},
            [(("response_format", "json_schema", "name"), "string_pattern_mismatch")],
        ),
        (
            {"type": "json_schema", "json_schema": {"name": "ok"}},
            [(("response_format", "json_schema", "schema"), "missing")],
        ),
    ],
)
def test_response_format_rules(response_format: dict, expected: list) -> None:
    assert refused(response_format=response_format) == expected


@pytest.mark.parametrize("name", ["a", "x" * 64, "Name_with-dash_09"])
def test_schema_names_of_the_pattern_are_accepted(name: str) -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMA}}
    assert validate(make_request(response_format=response_format))


# ---- streaming, suffix, model


def test_streaming_rules() -> None:
    assert validate(make_request(stream=True, n=2, best_of=2))
    assert validate(make_request(stream=True, stream_options={"include_usage": True}))
    assert refused(stream=True, n=2, best_of=3) == [(("stream",), "value_error")]
    assert refused(stream=True, use_beam_search=True) == [(("stream",), "value_error")]
    assert refused(stream_options={"include_usage": True}) == [(("stream_options",), "value_error")]
    assert refused(stream=False, stream_options={}) == [(("stream_options",), "value_error")]


def test_suffix_is_refused_unless_empty() -> None:
    assert validate(make_request(suffix=""))
    found = violations(make_request(suffix="after"))
    assert [v.loc for v in found] == [("suffix",)]
    assert "not supported" in found[0].msg


def test_model_is_required() -> None:
    assert refused(model=OMIT) == [(("model",), "missing")]
    assert refused(model="") == [(("model",), "missing")]


def test_prompt_errors_are_located_under_prompt() -> None:
    assert refused(prompt=OMIT) == [(("prompt",), "missing")]
    assert refused(prompt=["a", ""]) == [(("prompt", 1), "string_too_short")]
    assert refused(prompt=[[1, 2], [3, VOCAB_SIZE]]) == [(("prompt", 1, 1), "value_error")]


def test_every_violation_of_a_request_is_reported_together_in_order() -> None:
    request = make_request(
        model=OMIT,
        prompt=[],
        temperature=3,
        top_p=0,
        n=0,
        stop="",
        stop_token_ids=[VOCAB_SIZE],
        early_stopping="maybe",
        guided_regex="(",
        guided_decoding_backend="guidance",
        stream_options={"include_usage": True},
        suffix="x",
    )
    assert [(v.loc, v.type) for v in violations(request)] == [
        (("model",), "missing"),
        (("prompt",), "too_short"),
        (("temperature",), "less_than_equal"),
        (("top_p",), "greater_than"),
        (("n",), "greater_than_equal"),
        (("stop",), "string_too_short"),
        (("stop_token_ids", 0), "value_error"),
        (("early_stopping",), "literal_error"),
        (("guided_regex",), "value_error"),
        (("guided_decoding_backend",), "literal_error"),
        (("stream_options",), "value_error"),
        (("suffix",), "value_error"),
    ]


def test_the_message_summarises_each_violation_by_field_path() -> None:
    with pytest.raises(RequestValidationError) as caught:
        validate(make_request(temperature=3, stop=["a", ""]))
    message = caught.value.message
    assert message.startswith("invalid request")
    assert "temperature: temperature must be in [0, 2], got 3" in message
    assert "stop[1]: each stop must be a non-empty string" in message


# ---- RequestLimits


def test_default_limits_are_the_documented_ones() -> None:
    limits = RequestLimits()
    assert (
        limits.max_prompts,
        limits.max_choices,
        limits.max_prompt_tokens,
        limits.max_constraint_bytes,
        limits.max_logit_bias,
    ) == (64, 256, 65536, 65536, 1024)


def test_max_prompts() -> None:
    assert len(validate(make_request(prompt=["Hi"] * 64))) == 64
    found = violations(make_request(prompt=["Hi"] * 65))
    assert [(v.loc, v.type, v.msg) for v in found] == [
        (("prompt",), "too_long", "at most 64 prompts per request, got 65")
    ]
    assert refused(RequestLimits(max_prompts=2), prompt=[[1], [2], [3]]) == [
        (("prompt",), "too_long")
    ]


def test_max_choices_counts_prompts_times_n_or_best_of() -> None:
    assert validate(make_request(prompt=["Hi", "Hi"], n=128))
    found = violations(make_request(prompt=["Hi"] * 3, n=100))
    assert [(v.loc, v.msg) for v in found] == [
        (("n",), "prompts x n is 300; at most 256 per request")
    ]
    found = violations(make_request(prompt=["Hi"] * 13, best_of=20))
    assert [(v.loc, v.msg) for v in found] == [
        (("n",), "prompts x best_of is 260; at most 256 per request")
    ]
    limits = RequestLimits(max_choices=4)
    assert validate(make_request(prompt=["Hi", "Hi"], n=2), limits)
    assert refused(limits, prompt=["Hi", "Hi"], best_of=3) == [(("n",), "too_long")]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("guided_regex", "a" * 11),
        ("guided_grammar", 'root ::= "x"'),
        ("guided_choice", ["yes", "no"]),
        ("guided_json", {"type": "object"}),
    ],
)
def test_max_constraint_bytes(field: str, value: Any) -> None:
    limits = RequestLimits(max_constraint_bytes=10)
    found = violations(make_request(**{field: value}), limits)
    assert [(v.loc, v.type) for v in found] == [((field,), "too_long")]
    assert found[0].msg.endswith("bytes; at most 10")
    assert validate(make_request(**{field: value}), RequestLimits(max_constraint_bytes=100))


def test_max_constraint_bytes_counts_the_response_format_schema_and_utf8_bytes() -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}}
    assert refused(RequestLimits(max_constraint_bytes=10), response_format=response_format) == [
        (("response_format",), "too_long")
    ]
    found = violations(make_request(guided_regex="é" * 6), RequestLimits(max_constraint_bytes=10))
    assert found[0].msg == "guided_regex is 12 bytes; at most 10"
    assert validate(make_request(guided_regex="a" * 65536))
    assert refused(guided_regex="a" * 65537) == [(("guided_regex",), "too_long")]


def test_max_logit_bias_entries() -> None:
    limits = RequestLimits(max_logit_bias=2)
    assert validate(make_request(logit_bias={"1": 1, "2": 2}), limits)
    found = violations(make_request(logit_bias={"1": 1, "2": 2, "3": 3}), limits)
    assert [(v.loc, v.msg) for v in found] == [
        (("logit_bias",), "at most 2 logit_bias entries, got 3")
    ]


def test_the_model_name_is_not_checked_here() -> None:
    # An unknown model is a 404 decided by the handler, not a validation error.
    assert validate(make_request(model="another-model")) == [
        PromptInput(text="The capital of France is")
    ]
    assert MODEL != "another-model"


def test_max_prompt_tokens_counts_all_prompts_after_tokenization() -> None:
    # Checked by the handler once prompts are tokens (text prompts have no count before).
    from service.api.completions import check_prompt_tokens
    from service.api.prompts import PreparedPrompt

    limit = RequestLimits().max_prompt_tokens
    half = PreparedPrompt(token_ids=[5] * (limit // 2), text="")
    check_prompt_tokens([half, half], limit)
    with pytest.raises(RequestValidationError) as caught:
        check_prompt_tokens([half, half, PreparedPrompt(token_ids=[5], text="")], limit)
    assert [(v.loc, v.type, v.msg) for v in caught.value.violations] == [
        (
            ("prompt",),
            "too_long",
            "the prompts hold 65537 tokens; at most 65536 are allowed per request",
        )
    ]


def test_max_constraint_bytes_covers_the_whitespace_pattern() -> None:
    assert refused(guided_json=SCHEMA, guided_whitespace_pattern=" " * 65537) == [
        (("guided_whitespace_pattern",), "too_long")
    ]


# ---- vLLM's completion extras


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"truncate_prompt_tokens": 0}, [(("truncate_prompt_tokens",), "value_error")]),
        ({"truncation_side": "middle"}, [(("truncation_side",), "literal_error")]),
        ({"prompt_logprobs": 1, "stream": True}, [(("prompt_logprobs",), "value_error")]),
        (
            {"prompt_logprobs": 1, "use_beam_search": True, "n": 2},
            [(("prompt_logprobs",), "value_error")],
        ),
        (
            {"allowed_token_ids": [5, VOCAB_SIZE, -1]},
            [(("allowed_token_ids", 1), "value_error"), (("allowed_token_ids", 2), "value_error")],
        ),
    ],
)
def test_bad_extras_are_refused_naming_the_field(fields: dict, expected: list) -> None:
    assert refused(**fields) == expected


def test_the_extras_vllm_accepts_pass() -> None:
    assert validate(
        make_request(
            return_token_ids=True,
            return_tokens_as_token_ids=True,
            prompt_logprobs=2,
            truncate_prompt_tokens=-1,
            truncation_side="right",
            priority=-3,
            allowed_token_ids=[0, VOCAB_SIZE - 1],
        )
    )


def test_truncation_messages_say_what_is_allowed() -> None:
    (zero,) = violations(make_request(truncate_prompt_tokens=0))
    assert "at least 1, or -1" in zero.msg
    (side,) = violations(make_request(truncation_side="up"))
    assert "left" in side.msg and "right" in side.msg
