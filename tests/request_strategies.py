"""Request bodies generated from the proto's descriptors, for the property tests of request
building (tests/unit/test_request_properties.py, no engine) and of a real replica
(tests/test_fuzz.py).

Every field of a request gets values of its type inside and outside the range the proto
declares for it (its `allowed` option), values the API or vLLM give a meaning to, and, with
`wrong_types`, JSON values of other types (REST only: protobuf cannot carry them). A body is
a valid base, a few fields drawn from all of the request's, and maybe one of the combinations
the API or vLLM refuse together.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf.descriptor import Descriptor, FieldDescriptor
from hypothesis import strategies as st
from llmcompletions.v2.completions_pb2 import (
    CreateChatCompletionRequest,
    CreateCompletionRequest,
    TokenizeRequest,
)

from service.api.declared_ranges import Bound, declared_ranges

Strategy = st.SearchStrategy[Any]
Body = dict[str, Any]

INTEGER_LIMITS = {
    FieldDescriptor.TYPE_INT32: (-(2**31), 2**31 - 1),
    FieldDescriptor.TYPE_INT64: (-(2**63), 2**63 - 1),
    FieldDescriptor.TYPE_UINT32: (0, 2**32 - 1),
}
FLOAT_TYPES = (FieldDescriptor.TYPE_DOUBLE, FieldDescriptor.TYPE_FLOAT)
# Fields drawn into one body besides its base: few, so that what a deep check refuses is not
# always hidden behind a shallow refusal.
MAX_DRAWN_FIELDS = 4

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
NAMED_TOOL = {"type": "function", "function": {"name": "get_weather"}}
SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
    {"type": "string", "pattern": "(a+)+$"},
    {"$ref": "#"},
    {"type": "nonsense"},
    {"enum": []},
    {},
]
# Strings the API or vLLM give a meaning to, so that generated values reach past the first
# check: roles, tool choices, formats, sides, template kwargs' names.
WORDS = [
    "system",
    "developer",
    "user",
    "assistant",
    "tool",
    "function",
    "auto",
    "none",
    "required",
    "text",
    "image_url",
    "json_object",
    "json_schema",
    "structural_tag",
    "left",
    "right",
    "never",
    "get_weather",
    "xgrammar",
]
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.sampled_from([0, -1, 1, 2**31, 2**63, 1e308, -1e308, 5e-324, 0.5])
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12)
    | st.sampled_from([*WORDS, "NaN", "Infinity"])
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=3)
        | st.dictionaries(st.text(max_size=6) | st.sampled_from(WORDS), children, max_size=3)
    ),
    max_leaves=8,
)
json_objects = st.dictionaries(
    st.text(max_size=6) | st.sampled_from(WORDS), json_values, max_size=3
)
# Values that reach deeper than a random one would, by field name (in any message).
MEANINGFUL: dict[str, list[Any]] = {
    "prompt": ["Hi", ["a", "b"], [1, 2], [[1, 2], [3]], [], ""],
    "content": [
        "hi",
        None,
        [{"type": "text", "text": "hi"}],
        [{"type": "text"}],
        [{"type": "image_url", "image_url": {"url": "x"}}],
        [{"type": "bogus"}],
        [5],
    ],
    "stop": ["\n", ["a", "b"], [], ["a"] * 5, [""], [1]],
    "tool_choice": ["auto", "none", "required", "bogus", NAMED_TOOL, {"function": {}}, [1]],
    "tools": [[TOOL], [TOOL, TOOL], [{"type": "function", "function": {"name": ""}}]],
    "guided_json": SCHEMAS,
    "schema": SCHEMAS,
    "parameters": SCHEMAS,
    "guided_regex": ["a+", "[", "(a+)+$", "(?<=a)b", ""],
    "guided_grammar": ['root ::= "a"', "root ::= root", "x"],
    "guided_choice": [["a", "b"], [], [1], [""]],
    "guided_whitespace_pattern": [" ", "[", "(a+)+$"],
    "early_stopping": [True, False, "never", "x", 1],
    "response_format": [
        {"type": "json_object"},
        {"type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMAS[0]}},
        {"type": "json_schema"},
        {"type": "structural_tag"},
        {"type": "text"},
    ],
    "chat_template_kwargs": [
        {"tokenize": True},
        {"chat_template": "x"},
        {"messages": 5},
        {"tools": 5},
        {"add_generation_prompt": "x"},
        {"enable_thinking": True},
    ],
    "documents": [[{"title": "a", "text": "b"}], [1], [{"a": 1}]],
    "chat_template": ["{{ messages }}", "{{ raise_exception('no') }}", "x"],
    "arguments": ['{"city": "Paris"}', "{not json", ""],
}
# Fields the API or vLLM refuse together (or that take paths of their own together).
COMPLETION_COMBINATIONS: list[Body] = [
    {"stream": True, "use_beam_search": True},
    {"stream": True, "best_of": 3, "n": 1},
    {"n": 4, "best_of": 2},
    {"use_beam_search": True, "n": 2, "best_of": 3, "temperature": 0.5},
    {"use_beam_search": True, "prompt_logprobs": 1},
    {"stream": True, "prompt_logprobs": 1},
    {"stream_options": {"include_usage": True}},
    {"guided_json": SCHEMAS[0], "guided_regex": "a+"},
    {"guided_choice": ["a"], "response_format": {"type": "json_object"}},
    {"guided_json": SCHEMAS[0], "guided_whitespace_pattern": "["},
    {"guided_decoding_backend": "outlines", "guided_regex": "a"},
    {"min_tokens": 5, "max_tokens": 2},
    {"echo": True, "max_tokens": 0, "logprobs": 2},
    {"truncate_prompt_tokens": 1, "truncation_side": "middle"},
    {"truncate_prompt_tokens": 10**6},
    {"temperature": 0, "n": 3},
    {"logit_bias": {"1": 100}, "allowed_token_ids": [2]},
    {"priority": 5},
    {"seed": -1, "n": 2},
    {"suffix": "x"},
]
CHAT_COMBINATIONS: list[Body] = [
    {"tool_choice": "auto"},
    {"tool_choice": "required"},
    {"tool_choice": NAMED_TOOL},
    {"tool_choice": "none", "tools": [TOOL]},
    {"tool_choice": "bogus", "tools": [TOOL]},
    {"tool_choice": {"type": "function", "function": {"name": "other"}}, "tools": [TOOL]},
    {"tool_choice": {"type": "function", "function": {}}, "tools": [TOOL]},
    {"tool_choice": NAMED_TOOL, "tools": [TOOL], "guided_regex": "a"},
    {"tool_choice": "required", "tools": [TOOL], "response_format": {"type": "json_object"}},
    {"continue_final_message": True, "add_generation_prompt": True},
    {"continue_final_message": True},
    {"top_logprobs": 3},
    {"logprobs": True, "top_logprobs": 21},
    {"stream_options": {"include_usage": True}},
    {"stream": True, "n": 3, "logprobs": True, "top_logprobs": 2},
    {"response_format": {"type": "json_object"}, "guided_choice": ["a"]},
    {"guided_json": SCHEMAS[0], "guided_whitespace_pattern": "["},
    {"min_tokens": 5, "max_completion_tokens": 2},
    {"temperature": 0, "n": 3},
    {"echo": True, "stream": True},
    {"truncate_prompt_tokens": 1},
    {"priority": 5},
    {"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]},
    {"messages": [{"role": "tool", "content": "x"}]},
    {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
    {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
    {"messages": [{"role": "user", "content": "hi"}] * 3},
]


def boundary_values(low: Bound | None, high: Bound | None, integral: bool) -> list[float]:
    """A declared range's bounds and what lies just past each."""
    step = 1 if integral else 1e-9
    values: list[float] = []
    for bound, outward in ((low, -step), (high, step)):
        if bound is not None:
            values += [bound.value, bound.value + outward]
    return [int(value) for value in values] if integral else values


def scalar_values(field: FieldDescriptor, ranges: Mapping[str, Any]) -> Strategy:
    """Values of a scalar field's own type: at and past its declared range, and anywhere."""
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.booleans()
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.sampled_from(WORDS) | st.text(max_size=12)
    integral = field.type in INTEGER_LIMITS
    bounds = boundary_values(*ranges.get(field.name, (None, None)), integral)
    if integral:
        low, high = INTEGER_LIMITS[field.type]
        typed = st.integers(low, high) | st.sampled_from([low, high, 0, -1, 1, 2])
        return typed | st.sampled_from(bounds) if bounds else typed
    typed = st.floats(-1e300, 1e300) | st.sampled_from([0.0, -1.0, 1e-300, 1e300])
    return typed | st.sampled_from(bounds) if bounds else typed


def wrong_json_types(field: FieldDescriptor) -> Strategy:
    """JSON values that protobuf's JSON mapping refuses for the field (an integer past its
    type's limits, a fraction for an integer, a string or object for a number, ...)."""
    if field.type in INTEGER_LIMITS:
        low, high = INTEGER_LIMITS[field.type]
        return st.sampled_from([low - 1, high + 1, 0.5, "x", [], {}, True])
    if field.type in FLOAT_TYPES:
        return st.sampled_from(["x", [], {}, True])
    if field.type == FieldDescriptor.TYPE_BOOL:
        return st.sampled_from([0, "yes", [], {}])
    if field.type == FieldDescriptor.TYPE_STRING:
        return st.sampled_from([1, [], {}, True])
    return st.sampled_from([1, "x", True])


def field_values(field: FieldDescriptor, ranges: Mapping[str, Any], wrong_types: bool) -> Strategy:
    """Values for one field of a message, whatever its kind (scalar, message, map, list)."""
    message = field.message_type
    if message is not None and message.GetOptions().map_entry:
        key, value = message.fields_by_name["key"], message.fields_by_name["value"]
        # The map field's declared range is its values'.
        value_range = {value.name: ranges.get(field.name, (None, None))}
        entries = st.dictionaries(
            scalar_values(key, {}).map(str), scalar_values(value, value_range), max_size=3
        )
        return entries | wrong_json_types(field) if wrong_types else entries
    if message is not None:
        one = message_values(message, wrong_types)
    else:
        one = scalar_values(field, ranges)
    if wrong_types and message is None:
        one = one | wrong_json_types(field)
    whole = st.lists(one, max_size=3) if field.is_repeated else one
    if field.name in MEANINGFUL:
        return st.sampled_from(MEANINGFUL[field.name]) | whole
    return whole


def message_values(message: Descriptor, wrong_types: bool) -> Strategy:
    if message.full_name == "google.protobuf.Value":
        return json_values
    if message.full_name == "google.protobuf.Struct":
        return json_objects
    if message.full_name == "google.protobuf.ListValue":
        return st.lists(json_values, max_size=3)
    return st.fixed_dictionaries({}, optional=fields_of(message, wrong_types))


def fields_of(message: Descriptor, wrong_types: bool) -> dict[str, Strategy]:
    ranges = declared_ranges(message)
    return {
        field.name: st.deferred(lambda field=field: field_values(field, ranges, wrong_types))
        for field in message.fields
    }


def request_bodies(
    message: Descriptor,
    base: Body,
    combinations: list[Body],
    wrong_types: bool,
    overrides: Mapping[str, Strategy] | None = None,
) -> st.SearchStrategy[Body]:
    """A valid `base`, up to MAX_DRAWN_FIELDS of the message's fields, and maybe one of
    `combinations`; `overrides` replace the values drawn for the fields they name."""
    values = {**fields_of(message, wrong_types), **(overrides or {})}
    drawn = st.lists(st.sampled_from(sorted(values)), max_size=MAX_DRAWN_FIELDS, unique=True)
    fields = drawn.flatmap(lambda names: st.fixed_dictionaries({n: values[n] for n in names}))
    combination = st.none() | st.sampled_from(combinations)
    return st.tuples(fields, combination).map(
        lambda parts: {**base, **parts[0], **(parts[1] or {})}
    )


def completion_bodies(
    model: str, wrong_types: bool, overrides: Mapping[str, Strategy] | None = None
) -> st.SearchStrategy[Body]:
    base = {"model": model, "prompt": "Hi", "max_tokens": 2}
    message = CreateCompletionRequest.DESCRIPTOR
    return request_bodies(message, base, COMPLETION_COMBINATIONS, wrong_types, overrides)


def chat_bodies(
    model: str, wrong_types: bool, overrides: Mapping[str, Strategy] | None = None
) -> st.SearchStrategy[Body]:
    base = {
        "model": model,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_completion_tokens": 2,
    }
    message = CreateChatCompletionRequest.DESCRIPTOR
    return request_bodies(message, base, CHAT_COMBINATIONS, wrong_types, overrides)


def tokenize_bodies(model: str, wrong_types: bool) -> st.SearchStrategy[Body]:
    """Conversations to tokenize (rendered as a chat request renders them), or prompts."""
    base = {"model": model, "messages": [{"role": "user", "content": "Hi"}]}
    combinations = [
        combination
        for combination in CHAT_COMBINATIONS
        if set(combination) <= set(TokenizeRequest.DESCRIPTOR.fields_by_name)
    ]
    return request_bodies(TokenizeRequest.DESCRIPTOR, base, combinations, wrong_types)
