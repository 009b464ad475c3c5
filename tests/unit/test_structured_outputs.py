"""service/api/constraints.py: guided_* fields and response_format as vLLM's
StructuredOutputsParams."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from google.protobuf import json_format, struct_pb2
from unit_fakes import make_request
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams

from service.api import constraints
from service.api.caller_errors import building_request
from service.api.completions import CompletionHandler
from service.api.constraints import (
    constraint_field,
    json_constraint,
    json_value,
    restore_integers,
    structured_outputs,
)
from service.api.errors import RequestValidationError
from service.api.sampling import sampling_params
from service.settings import RequestLimits

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0},
        "score": {"type": "number", "maximum": 2.5},
        "tags": {"type": "array", "items": {"enum": [1, 2.5, "x"]}, "maxItems": 3},
    },
    "required": ["name", "age"],
}


def test_no_constraint_gives_none() -> None:
    assert structured_outputs(make_request()) is None
    assert structured_outputs(make_request(response_format={"type": "text"})) is None
    assert constraint_field(make_request(response_format={"type": "text"})) is None


def test_guided_json_is_the_schema_with_its_integers_restored() -> None:
    built = structured_outputs(make_request(guided_json=SCHEMA))
    assert built == StructuredOutputsParams(json=SCHEMA)
    assert isinstance(built.json, dict)
    properties = built.json["properties"]
    # google.protobuf.Struct stores 8 as 8.0; JSON Schema needs maxLength to be an integer.
    assert type(properties["name"]["maxLength"]) is int
    assert type(properties["tags"]["maxItems"]) is int
    assert properties["tags"]["items"]["enum"] == [1, 2.5, "x"]
    assert type(properties["score"]["maximum"]) is float


def test_guided_regex_choice_and_grammar() -> None:
    assert structured_outputs(make_request(guided_regex=r"\d{3}")) == StructuredOutputsParams(
        regex=r"\d{3}"
    )
    assert structured_outputs(make_request(guided_choice=["yes", "no"])) == (
        StructuredOutputsParams(choice=["yes", "no"])
    )
    grammar = 'root ::= answer " " answer\nanswer ::= "yes" | "no"'
    assert structured_outputs(make_request(guided_grammar=grammar)) == StructuredOutputsParams(
        grammar=grammar
    )


def test_response_formats() -> None:
    assert structured_outputs(make_request(response_format={"type": "json_object"})) == (
        StructuredOutputsParams(json_object=True)
    )
    response_format = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
    assert structured_outputs(make_request(response_format=response_format)) == (
        StructuredOutputsParams(json=SCHEMA)
    )


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({"guided_json": SCHEMA}, "guided_json"),
        ({"guided_regex": "a"}, "guided_regex"),
        ({"guided_choice": ["a"]}, "guided_choice"),
        ({"guided_grammar": "g"}, "guided_grammar"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "guided_regex"),
        ({"guided_whitespace_pattern": " "}, None),
    ],
)
def test_the_field_carrying_the_constraint(fields: dict[str, Any], field: str | None) -> None:
    assert constraint_field(make_request(**fields)) == field


def test_a_whitespace_pattern_turns_a_schema_into_an_equivalent_regex() -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    built = structured_outputs(
        make_request(guided_json=schema, guided_whitespace_pattern="[ ]{0,2}")
    )
    assert built is not None and built.json is None and built.regex is not None
    assert re.fullmatch(built.regex, '{"a":1}')
    assert re.fullmatch(built.regex, '{ "a":  12 }')
    assert not re.fullmatch(built.regex, '{"a":   1}')  # three spaces
    assert not re.fullmatch(built.regex, '{"a":\n1}')
    assert not re.fullmatch(built.regex, '{"a":"1"}')


def test_a_whitespace_pattern_applies_to_json_response_formats() -> None:
    json_object = structured_outputs(
        make_request(response_format={"type": "json_object"}, guided_whitespace_pattern="[ ]?")
    )
    assert json_object is not None and json_object.regex is not None
    assert re.fullmatch(json_object.regex, '{"k": [1, 2]}')
    assert not re.fullmatch(json_object.regex, "[1]")  # an object, not any JSON
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "n", "schema": {"type": "string", "maxLength": 2}},
    }
    schema = structured_outputs(
        make_request(response_format=response_format, guided_whitespace_pattern=" ")
    )
    assert schema is not None and schema.regex is not None
    assert re.fullmatch(schema.regex, '"ab"') and not re.fullmatch(schema.regex, '"abc"')


def test_a_whitespace_pattern_leaves_other_constraints_alone() -> None:
    built = structured_outputs(make_request(guided_regex="a+", guided_whitespace_pattern=" "))
    assert built == StructuredOutputsParams(regex="a+")
    assert json_constraint({"type": "object"}, None) == StructuredOutputsParams(
        json={"type": "object"}
    )


def test_restore_integers_walks_nested_values() -> None:
    assert restore_integers({"a": [1.0, 2.5, {"b": 3.0}], "c": True, "d": "4.0"}) == {
        "a": [1, 2.5, {"b": 3}],
        "c": True,
        "d": "4.0",
    }
    struct = json_format.ParseDict({"n": 3, "f": 0.25, "l": [0, None]}, struct_pb2.Struct())
    assert json_value(struct) == {"n": 3, "f": 0.25, "l": [0, None]}


UNCONVERTIBLE = [{"type": "foo"}, {"$ref": "#/nope"}]


@pytest.mark.parametrize("schema", UNCONVERTIBLE)
def test_an_unconvertible_schema_with_a_whitespace_pattern_is_a_validation_error(
    schema: dict[str, Any],
) -> None:
    request = make_request(guided_json=schema, guided_whitespace_pattern=" ")
    with pytest.raises(VLLMValidationError) as caught:
        sampling_params(request, {}, 1)
    assert caught.value.parameter == "guided_json"
    assert "the schema cannot be converted" in str(caught.value)


def test_an_unconvertible_response_format_schema_names_response_format() -> None:
    response_format = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "x"}}}
    request = make_request(response_format=response_format, guided_whitespace_pattern=" ")
    with pytest.raises(VLLMValidationError) as caught:
        structured_outputs(request)
    assert caught.value.parameter == "response_format"


def handler() -> CompletionHandler:
    """A handler whose model is only what engine_requests() reads."""
    config = SimpleNamespace(renderer_num_workers=1)
    model = SimpleNamespace(default_sampling={}, engine=SimpleNamespace(model_config=config))
    return CompletionHandler(model, RequestLimits(), backlog=None)  # type: ignore[arg-type]


@pytest.mark.parametrize("schema", UNCONVERTIBLE)
def test_the_handler_refuses_an_unconvertible_schema_as_invalid_argument(
    schema: dict[str, Any],
) -> None:
    request = make_request(guided_json=schema, guided_whitespace_pattern=" ", temperature=1)
    # The handler builds its engine requests inside building_request (service.api.completions).
    with pytest.raises(RequestValidationError) as caught, building_request():
        handler().engine_requests(request, "req", 1)
    assert caught.value.grpc_code == grpc.StatusCode.INVALID_ARGUMENT  # 422 through Envoy
    ((violation,),) = [caught.value.violations]
    assert (violation.loc, violation.type) == (("guided_json",), "value_error")
    assert "the schema cannot be converted" in violation.msg


def test_only_outlines_cores_refusal_becomes_a_validation_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def broken(schema: str, whitespace_pattern: str) -> str:
        raise TypeError("a bug, not a bad schema")

    monkeypatch.setattr(constraints, "build_regex_from_schema", broken)
    with pytest.raises(TypeError):
        structured_outputs(make_request(guided_json=SCHEMA, guided_whitespace_pattern=" "))
