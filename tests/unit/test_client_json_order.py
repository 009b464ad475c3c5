"""The client's requests (llmcompletions.json_order): the same message ParseDict builds, with
every JSON object's keys on the wire in the order the caller wrote them, as the server reads
them back (service/api/caller_order.py)."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import json_format, struct_pb2
from llmcompletions.client import build_chat_request, build_request, request_bytes
from llmcompletions.v2.completions_pb2 import CreateChatCompletionRequest, CreateCompletionRequest

from service.api.caller_order import remember
from service.api.constraints import json_value
from tests.unit.test_caller_order import keys_at_every_depth

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "zeta": {"type": "string", "maxLength": 20},
        "alpha": {"type": "integer"},
        "mid": {"type": "array", "items": {"type": "object", "properties": {"y": {}, "b": {}}}},
    },
    "required": ["zeta", "alpha"],
}
COMPLETIONS: list[dict[str, Any]] = [
    {"model": "m", "prompt": "Hi", "max_tokens": 4, "temperature": 0},
    {"model": "m", "prompt": [[1, 2], [3]], "stop": ["a"], "logit_bias": {"5": -100}},
    {"model": "m", "prompt": "A person: ", "guided_json": SCHEMA, "n": 2},
    {
        "model": "m",
        "prompt": "x",
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    },
]
CHATS: list[dict[str, Any]] = [
    {
        "model": "m",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        ],
        "tools": [
            {"type": "function", "function": {"name": "a", "parameters": SCHEMA}},
            {"type": "function", "function": {"name": "b"}},
        ],
        "chat_template_kwargs": {"z": 1, "a": {"y": True, "b": None}},
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
    },
]


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("fields", COMPLETIONS)
def test_a_completion_request_is_the_message_parsedict_builds(
    fields: dict[str, Any], stream: bool
) -> None:
    raw = request_bytes(CreateCompletionRequest, None, stream, fields)
    assert CreateCompletionRequest.FromString(raw) == build_request(stream=stream, **fields)


@pytest.mark.parametrize("fields", CHATS)
def test_a_chat_request_is_the_message_parsedict_builds(fields: dict[str, Any]) -> None:
    raw = request_bytes(CreateChatCompletionRequest, None, True, fields)
    assert CreateChatCompletionRequest.FromString(raw) == build_chat_request(stream=True, **fields)


def test_the_server_reads_every_object_in_the_callers_order() -> None:
    (chat,) = CHATS
    raw = request_bytes(CreateChatCompletionRequest, None, False, chat)
    request = CreateChatCompletionRequest.FromString(raw)
    remember(raw, request.DESCRIPTOR)
    for struct in (
        request.response_format.json_schema.schema,
        request.tools[0].function.parameters,
    ):
        assert keys_at_every_depth(json_value(struct)) == keys_at_every_depth(SCHEMA)
    assert keys_at_every_depth(json_value(request.chat_template_kwargs)) == keys_at_every_depth(
        chat["chat_template_kwargs"]
    )


def test_a_ready_made_request_is_sent_as_protobuf_serializes_it() -> None:
    given = CreateCompletionRequest(model="m", prompt=struct_pb2.Value(string_value="Hi"))
    raw = request_bytes(CreateCompletionRequest, given, True, {"max_tokens": 3})
    assert raw == build_request(given, stream=True, max_tokens=3).SerializeToString()


@pytest.mark.parametrize(
    "fields",
    [
        {"model": "m", "unknown_field": 1},
        {"model": "m", "guided_json": "not an object"},
        {"model": "m", "response_format": {"json_schema": {"schema": [1]}}},
    ],
)
def test_bad_fields_fail_as_parsedict_fails(fields: dict[str, Any]) -> None:
    with pytest.raises(json_format.ParseError) as ours:
        request_bytes(CreateCompletionRequest, None, False, fields)
    with pytest.raises(json_format.ParseError) as theirs:
        build_request(**fields)
    assert type(ours.value) is type(theirs.value)
