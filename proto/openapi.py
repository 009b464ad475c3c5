"""Build the OpenAPI 3.1 document of the REST surface from the proto's descriptor set.

Field names, types, presence (nullable) and descriptions come from the proto and its comments;
the JSON unions that the proto holds as google.protobuf.Value get the forms the reference
lists. proto/generate.py writes the result to facade/openapi.json, which Envoy serves at
GET /openapi.json.
"""

from __future__ import annotations

import re
from typing import Any

from google.api import annotations_pb2
from google.protobuf import descriptor_pb2

# Registers the `allowed` field option, so that it parses out of the descriptor set.
from llmcompletions.v2 import completions_pb2

FieldProto = descriptor_pb2.FieldDescriptorProto
JsonSchema = dict[str, Any]

PROTO_FILE = "llmcompletions/v2/completions.proto"
PACKAGE_PREFIX = ".llmcompletions.v2."
MESSAGE_PATH = 4  # FileDescriptorProto.message_type
FIELD_PATH = 2  # DescriptorProto.field

SCALARS: dict[int, JsonSchema] = {
    FieldProto.TYPE_STRING: {"type": "string"},
    FieldProto.TYPE_BOOL: {"type": "boolean"},
    FieldProto.TYPE_DOUBLE: {"type": "number"},
    FieldProto.TYPE_INT32: {"type": "integer", "format": "int32"},
    FieldProto.TYPE_UINT32: {"type": "integer", "format": "int32", "minimum": 0},
    FieldProto.TYPE_INT64: {"type": "integer", "format": "int64"},
    FieldProto.TYPE_BYTES: {"type": "string", "format": "byte"},
}
INTEGERS = (FieldProto.TYPE_INT32, FieldProto.TYPE_UINT32, FieldProto.TYPE_INT64)
# Annotations of the proto, not part of the REST surface.
NOT_IN_DOCUMENT = {"NumericRange"}
TOKEN_IDS: JsonSchema = {"type": "array", "items": {"type": "integer"}}
STRINGS: JsonSchema = {"type": "array", "items": {"type": "string"}}
# The reference's JSON unions and free-form values, which the proto holds as well-known types.
PROMPT: JsonSchema = {
    "oneOf": [{"type": "string"}, STRINGS, TOKEN_IDS, {"type": "array", "items": TOKEN_IDS}]
}
VALUE_FIELDS: dict[str, JsonSchema] = {
    "CreateCompletionRequest.prompt": PROMPT,
    "TokenizeRequest.prompt": PROMPT,
    "Model.parent": {"type": ["string", "null"]},
    "GetModelInfoResponse.parent": {"type": ["string", "null"]},
    "CreateCompletionRequest.stop": {
        "oneOf": [{"type": "string"}, {**STRINGS, "maxItems": 4}, {"type": "null"}]
    },
    "CreateCompletionRequest.early_stopping": {
        "oneOf": [{"type": "boolean"}, {"const": "never"}, {"type": "null"}]
    },
    "CreateCompletionRequest.guided_choice": {
        "type": ["array", "null"],
        "items": {"type": "string"},
    },
    "Choice.stop_reason": {"type": ["string", "integer", "null"]},
    "Choice.token_ids": {**TOKEN_IDS, "type": ["array", "null"]},
    "Choice.prompt_token_ids": {**TOKEN_IDS, "type": ["array", "null"]},
    "Choice.prompt_logprobs": {
        "type": ["array", "null"],
        "items": {
            "type": ["object", "null"],
            "additionalProperties": {
                "type": "object",
                "properties": {
                    "logprob": {"type": "number"},
                    "rank": {"type": ["integer", "null"]},
                    "decoded_token": {"type": ["string", "null"]},
                },
            },
        },
    },
    "CreateChatCompletionRequest.stop": {
        "oneOf": [{"type": "string"}, {**STRINGS, "maxItems": 4}, {"type": "null"}]
    },
    "CreateChatCompletionRequest.guided_choice": {
        "type": ["array", "null"],
        "items": {"type": "string"},
    },
    "CreateChatCompletionRequest.tool_choice": {
        "oneOf": [
            {"enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "properties": {
                    "type": {"const": "function"},
                    "function": {"type": "object", "properties": {"name": {"type": "string"}}},
                },
            },
            {"type": "null"},
        ]
    },
    "CreateChatCompletionRequest.documents": {
        "type": ["array", "null"],
        "items": {"type": "object", "additionalProperties": {"type": "string"}},
    },
    "ChatMessage.content": {
        "oneOf": [
            {"type": "string"},
            {
                "type": "array",
                "items": {
                    "oneOf": [
                        {
                            "type": "object",
                            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
                        },
                        {
                            "type": "object",
                            "properties": {
                                "type": {"const": "image_url"},
                                "image_url": {
                                    "type": "object",
                                    "properties": {"url": {"type": "string"}},
                                },
                            },
                        },
                    ]
                },
            },
            {"type": "null"},
        ]
    },
    "ChatChoice.stop_reason": {"type": ["string", "integer", "null"]},
    "ChatChoice.token_ids": {**TOKEN_IDS, "type": ["array", "null"]},
    "CreateChatCompletionResponse.prompt_token_ids": {**TOKEN_IDS, "type": ["array", "null"]},
    "Logprobs.token_logprobs": {"type": "array", "items": {"type": ["number", "null"]}},
    "Logprobs.top_logprobs": {
        "type": "array",
        "items": {"type": ["object", "null"], "additionalProperties": {"type": "number"}},
    },
}
STRUCT = ".google.protobuf.Struct"
REQUIRED = {
    "CreateCompletionRequest": ["model", "prompt"],
    "CreateChatCompletionRequest": ["model", "messages"],
    "ChatMessage": ["role"],
    "ChatFunction": ["name"],
    "JsonSchema": ["name"],
}
ERROR_SCHEMAS: dict[str, JsonSchema] = {
    "ValidationError": {
        "type": "object",
        "required": ["loc", "msg", "type"],
        "properties": {
            "loc": {"type": "array", "items": {"oneOf": [{"type": "string"}, {"type": "integer"}]}},
            "msg": {"type": "string"},
            "type": {"type": "string"},
        },
    },
    "HTTPValidationError": {
        "type": "object",
        "properties": {
            "detail": {"type": "array", "items": {"$ref": "#/components/schemas/ValidationError"}}
        },
    },
    "ErrorDetail": {"type": "object", "properties": {"detail": {"type": "string"}}},
}


def leading_comments(file: descriptor_pb2.FileDescriptorProto) -> dict[tuple[int, ...], str]:
    return {
        tuple(location.path): " ".join(location.leading_comments.split())
        for location in file.source_code_info.location
        if location.leading_comments
    }


def range_keywords(field: FieldProto) -> JsonSchema:
    """minimum/maximum (or their exclusive forms) from the field's `allowed` option."""
    if not field.options.HasExtension(completions_pb2.allowed):
        return {}
    allowed = field.options.Extensions[completions_pb2.allowed]
    number = int if field.type in INTEGERS else float
    keywords: JsonSchema = {}
    if allowed.HasField("min"):
        keywords["exclusiveMinimum" if allowed.min_exclusive else "minimum"] = number(allowed.min)
    if allowed.HasField("max"):
        keywords["exclusiveMaximum" if allowed.max_exclusive else "maximum"] = number(allowed.max)
    return keywords


def field_schema(message: str, field: FieldProto, maps: dict[str, FieldProto]) -> JsonSchema:
    key = f"{message}.{field.name}"
    if key in VALUE_FIELDS:
        return dict(VALUE_FIELDS[key])
    if field.type_name in maps:
        value = {**SCALARS[maps[field.type_name].type], **range_keywords(field)}
        return {"type": ["object", "null"], "additionalProperties": value}
    if field.type_name == STRUCT:
        schema: JsonSchema = {"type": ["object", "null"]}
    elif field.type == FieldProto.TYPE_MESSAGE:
        schema = {"$ref": f"#/components/schemas/{field.type_name.removeprefix(PACKAGE_PREFIX)}"}
    else:
        schema = {**SCALARS[field.type], **range_keywords(field)}
    if field.label == FieldProto.LABEL_REPEATED:
        return {"type": "array", "items": schema}
    if field.proto3_optional:
        schema["type"] = [schema["type"], "null"]
    return schema


def message_schemas(file: descriptor_pb2.FileDescriptorProto) -> dict[str, JsonSchema]:
    docs = leading_comments(file)
    maps = {
        f"{PACKAGE_PREFIX}{message.name}.{nested.name}": nested.field[1]
        for message in file.message_type
        for nested in message.nested_type
        if nested.options.map_entry
    }
    schemas: dict[str, JsonSchema] = {}
    for message_index, message in enumerate(file.message_type):
        if message.name in NOT_IN_DOCUMENT:
            continue
        properties = {}
        for field_index, field in enumerate(message.field):
            schema = field_schema(message.name, field, maps)
            doc = docs.get((MESSAGE_PATH, message_index, FIELD_PATH, field_index))
            if doc:
                schema["description"] = doc
            properties[field.json_name] = schema
        schemas[message.name] = {"type": "object", "properties": properties}
        if message.name in REQUIRED:
            schemas[message.name]["required"] = REQUIRED[message.name]
        if doc := docs.get((MESSAGE_PATH, message_index)):
            schemas[message.name]["description"] = doc
    return schemas


def json_response(schema: str, description: str) -> JsonSchema:
    return {
        "description": description,
        "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{schema}"}}},
    }


def streamed_reply(output: str) -> JsonSchema:
    """What differs for a streaming method from the plain JSON reply of its output message."""
    return {
        "description": "The whole reply (stream false), or server-sent events of chunks ending"
        " with `data: [DONE]` (stream true).",
        "content": {
            "application/json": {"schema": {"$ref": f"#/components/schemas/{output}"}},
            "text/event-stream": {"schema": {"type": "string"}},
        },
    }


ERROR_REPLIES: JsonSchema = {
    "400": json_response("ErrorDetail", "A request this server cannot serve (e.g. too long)."),
    "401": json_response("ErrorDetail", "Missing or wrong API key."),
    "404": json_response("ErrorDetail", "The model is not served here."),
    "422": json_response("HTTPValidationError", "Validation Error"),
    "429": json_response("ErrorDetail", "Too many requests in flight."),
    "503": json_response("ErrorDetail", "The engine is not ready."),
}
SERVICE_PATH = 6  # FileDescriptorProto.service
METHOD_PATH = 2  # ServiceDescriptorProto.method
PATH_PARAMETER = re.compile(r"\{(\w+)(=[^}]*)?\}")


def operation(
    method: descriptor_pb2.MethodDescriptorProto, rule: Any, summary: str
) -> tuple[str, str, JsonSchema]:
    """(path, verb, operation) of one method's google.api.http binding."""
    verb = next(v for v in ("get", "post", "put", "delete", "patch") if getattr(rule, v))
    path = PATH_PARAMETER.sub(r"{\1}", getattr(rule, verb))
    output = method.output_type.removeprefix(PACKAGE_PREFIX)
    reply = streamed_reply(output) if method.server_streaming else json_response(output, "OK")
    found: JsonSchema = {
        "operationId": method.name[0].lower() + method.name[1:],
        "summary": summary,
        "responses": {"200": reply, **ERROR_REPLIES},
    }
    parameters = [
        {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
        for name, _ in PATH_PARAMETER.findall(getattr(rule, verb))
    ]
    if parameters:
        found["parameters"] = parameters
    if rule.body == "*":
        schema = {"$ref": f"#/components/schemas/{method.input_type.removeprefix(PACKAGE_PREFIX)}"}
        found["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    return path, verb, found


def paths(file: descriptor_pb2.FileDescriptorProto) -> JsonSchema:
    """Every REST route, from the methods' google.api.http annotations."""
    docs = leading_comments(file)
    found: JsonSchema = {}
    for service_index, service in enumerate(file.service):
        for method_index, method in enumerate(service.method):
            if not method.options.HasExtension(annotations_pb2.http):
                continue
            summary = docs.get((SERVICE_PATH, service_index, METHOD_PATH, method_index), "")
            rule = method.options.Extensions[annotations_pb2.http]
            path, verb, described = operation(method, rule, summary.split(". ")[0].rstrip("."))
            found.setdefault(path, {})[verb] = described
    return found


def openapi_document(descriptor_set: bytes, version: str) -> JsonSchema:
    files = descriptor_pb2.FileDescriptorSet.FromString(descriptor_set)
    file = next(f for f in files.file if f.name == PROTO_FILE)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "LLM completions",
            "version": version,
            "description": "Scale LLM Engine's POST /v2/completions and POST"
            " /v2/chat/completions, served by vLLM over gRPC, with model listing and"
            " tokenization.",
        },
        "paths": paths(file),
        "components": {"schemas": {**message_schemas(file), **ERROR_SCHEMAS}},
    }
