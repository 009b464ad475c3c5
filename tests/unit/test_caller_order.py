"""A request's JSON objects keep their caller's key order (service/api/caller_order.py), read
off the wire, and reach the call's handler on a real grpc.aio server (the key_order
interceptor): the parsed message alone gives them in hash order, which differs by process."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import grpc
import pytest
from google.protobuf import json_format, struct_pb2
from grpc_health.v1 import health_pb2
from llmcompletions.json_order import ordered_bytes, struct_bytes
from llmcompletions.v2.completions_pb2 import (
    CreateChatCompletionRequest,
    CreateCompletionRequest,
)

from service.api.caller_order import holds_objects, json_object, remember
from service.api.constraints import json_value
from service.transport.key_order import KeyOrderInterceptor

# Keys in an order no hash or sort gives: the property order a schema's caller chose.
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        name: {"type": "string", "maxLength": 20}
        for name in ("zeta", "alpha", "mid", "beta", "omega", "gamma", "delta")
    },
    "required": ["zeta", "alpha"],
    "additionalProperties": False,
}


def in_order(value: dict[str, Any]) -> bytes:
    """A Struct's bytes with its entries, at every depth, in `value`'s order, as a runtime that
    keeps JSON's order (the Python client, or Envoy's transcoder) writes them."""
    return struct_bytes(value)


def chat_request_bytes(schema: dict[str, Any]) -> bytes:
    """A chat request with `schema` as its response format, entries in the schema's order."""
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}
    return ordered_bytes(
        CreateChatCompletionRequest, {"model": "m", "response_format": response_format}
    )


def keys_at_every_depth(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [[key, keys_at_every_depth(item)] for key, item in value.items()]
    if isinstance(value, list):
        return [keys_at_every_depth(item) for item in value]
    return []


def test_a_struct_is_read_off_the_wire_in_its_written_order() -> None:
    value = {"b": 1.0, "a": [True, None, "x", {"d": 2.5, "c": {}}], "c": {"z": 1.0, "y": 2.0}}
    assert json.dumps(json_object(in_order(value))) == json.dumps(value)


def test_a_repeated_key_takes_its_last_value_as_protobuf_does() -> None:
    raw = in_order({"a": 1.0, "b": 2.0}) + in_order({"a": 3.0})
    assert json_object(raw) == json_format.MessageToDict(struct_pb2.Struct.FromString(raw))


def test_the_request_schema_comes_back_in_the_callers_order() -> None:
    raw = chat_request_bytes(SCHEMA)
    request = CreateChatCompletionRequest.FromString(raw)
    remember(raw, request.DESCRIPTOR)
    ordered = json_value(request.response_format.json_schema.schema)
    assert ordered == SCHEMA
    assert keys_at_every_depth(ordered) == keys_at_every_depth(SCHEMA)


def test_an_object_the_request_did_not_hold_is_left_as_it_is() -> None:
    remember(
        CreateCompletionRequest(model="m").SerializeToString(), CreateCompletionRequest.DESCRIPTOR
    )
    other = struct_pb2.Struct()
    other.update({"b": 1, "a": 2})
    assert json_value(other) == {"b": 1, "a": 2}


@pytest.mark.parametrize("raw", [b"\x0a\xff\xff", b"\x0b"])  # truncated; a group's wire type
def test_unreadable_bytes_leave_the_order_unknown_without_failing(raw: bytes) -> None:
    remember(raw, CreateChatCompletionRequest.DESCRIPTOR)
    other = struct_pb2.Struct()
    other.update({"b": 1, "a": 2})
    assert json_value(other) == {"b": 1, "a": 2}


def test_only_requests_that_can_hold_objects_are_read_again() -> None:
    assert holds_objects(CreateChatCompletionRequest.DESCRIPTOR)
    assert holds_objects(CreateCompletionRequest.DESCRIPTOR)
    assert not holds_objects(health_pb2.HealthCheckRequest.DESCRIPTOR)
    # A prompt (a JSON value: text, or maybe 100k token ids) is not walked again.
    assert not holds_objects(struct_pb2.Value.DESCRIPTOR)
    assert not holds_objects(struct_pb2.ListValue.DESCRIPTOR)


async def served_order(raw: bytes) -> list[Any]:
    """The schema's keys as a real grpc.aio server's streaming handler sees them."""

    async def handler(request: CreateChatCompletionRequest, context: grpc.aio.ServicerContext):
        await asyncio.sleep(0)  # the order survives the handler's own awaits
        yield json.dumps(json_value(request.response_format.json_schema.schema)).encode()

    method = grpc.unary_stream_rpc_method_handler(
        handler,
        request_deserializer=CreateChatCompletionRequest.FromString,
    )
    server = grpc.aio.server(interceptors=[KeyOrderInterceptor()])
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("test.Order", {"Schema": method})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/test.Order/Schema", response_deserializer=bytes.decode)
            replies = await asyncio.gather(*(collect(call(raw)) for _ in range(8)))
    finally:
        await server.stop(None)
    return [
        keys_at_every_depth(json.loads(reply))
        for replies_of_one in replies
        for reply in replies_of_one
    ]


async def collect(call: Any) -> list[str]:
    return [reply async for reply in call]


def test_a_grpc_handler_gets_the_callers_order() -> None:
    seen = asyncio.run(served_order(chat_request_bytes(SCHEMA)))
    assert seen == [keys_at_every_depth(SCHEMA)] * 8
