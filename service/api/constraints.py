"""Output constraints: the request's guided_* fields and response_format as vLLM's
StructuredOutputsParams."""

from __future__ import annotations

import json
from typing import Any

from google.protobuf import json_format, struct_pb2
from llmcompletions.v2.completions_pb2 import CreateChatCompletionRequest, CreateCompletionRequest
from outlines_core.json_schema import build_regex_from_schema
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import StructuredOutputsParams

from service.api.caller_order import in_caller_order, restore_integers

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
JSON_RESPONSE_FORMATS = ("json_object", "json_schema")


def json_value(message: struct_pb2.Struct) -> dict[str, Any]:
    """A Struct of the request being served as plain JSON: whole numbers as integers again and
    keys in the order its caller wrote them (service.api.caller_order)."""
    return in_caller_order(restore_integers(json_format.MessageToDict(message)))


# Both kinds of request carry the same guided_* and response_format fields.
ConstrainedRequest = CreateCompletionRequest | CreateChatCompletionRequest


def constraint_field(request: ConstrainedRequest) -> str | None:
    """The request field that carries its output constraint, if any."""
    for name in GUIDED_FIELDS:
        if request.HasField(name):
            return name
    if (
        request.HasField("response_format")
        and request.response_format.type in JSON_RESPONSE_FORMATS
    ):
        return "response_format"
    return None


def json_constraint(
    schema: dict[str, Any], whitespace: str | None, field: str = "guided_json"
) -> StructuredOutputsParams:
    """A JSON-schema constraint. vLLM's backends ignore a whitespace pattern, so with one the
    schema becomes the equivalent regular expression, built with that pattern; a schema
    outlines-core cannot convert is a validation error on `field`, the one holding it."""
    if whitespace is None:
        return StructuredOutputsParams(json=schema)
    try:
        regex = build_regex_from_schema(json.dumps(schema), whitespace_pattern=whitespace)
    except ValueError as error:  # outlines-core's error for a schema it does not support
        raise VLLMValidationError(
            "the schema cannot be converted to a regular expression, which "
            f"guided_whitespace_pattern needs: {error}",
            parameter=field,
        ) from error
    return StructuredOutputsParams(regex=regex)


def structured_outputs(request: ConstrainedRequest) -> StructuredOutputsParams | None:
    whitespace = (
        request.guided_whitespace_pattern if request.HasField("guided_whitespace_pattern") else None
    )
    field = constraint_field(request)
    if field == "guided_json":
        return json_constraint(json_value(request.guided_json), whitespace)
    if field == "guided_regex":
        return StructuredOutputsParams(regex=request.guided_regex)
    if field == "guided_choice":
        choices = [value.string_value for value in request.guided_choice.values]
        return StructuredOutputsParams(choice=choices)
    if field == "guided_grammar":
        return StructuredOutputsParams(grammar=request.guided_grammar)
    if field == "response_format":
        response_format = request.response_format
        if response_format.type == "json_object":
            if whitespace is None:
                return StructuredOutputsParams(json_object=True)
            return json_constraint({"type": "object"}, whitespace, field)
        return json_constraint(json_value(response_format.json_schema.schema), whitespace, field)
    return None
