"""A request's bytes with its JSON objects' keys in the order the caller wrote them.

A JSON object in a request (a schema, a tool's parameters) is a google.protobuf.Struct, a map,
and protobuf's Python runtime writes a map in hash order, which changes from process to
process. The order matters to the server: a schema's properties are generated in it. The
server reads the order off the wire, so this module writes each object's entries in the order
of the dict it came from, and leaves every other field to protobuf's own serialization (a
message's fields may come in any order and concatenated messages merge, so the parts join).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf import json_format, message_factory, struct_pb2
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

STRUCT = "google.protobuf.Struct"
JSON_VALUES = frozenset({"google.protobuf.Value", "google.protobuf.ListValue"})
STRUCT_VALUE, LIST_VALUE = 5, 6  # google.protobuf.Value's fields


def ordered_bytes(message_type: type[Message], fields: Mapping[str, Any]) -> bytes:
    """What `json_format.ParseDict(fields, message_type())` serializes to, with every Struct
    it holds (at any depth outside JSON values) written in its dict's order. Fields are named
    as ParseDict takes them (JSON or proto names) and fail as it fails."""
    parts = []
    for name, value in fields.items():
        field = field_named(message_type.DESCRIPTOR, name)
        if field is not None and holds_structs(field) and written_in_order(field, value):
            items = value if field.is_repeated else [value]
            parts += [length_delimited(field.number, message_bytes(field, item)) for item in items]
        else:
            one = message_type()
            json_format.ParseDict({name: value}, one)
            parts.append(one.SerializeToString())
    return b"".join(parts)


def field_named(descriptor: Descriptor, name: str) -> FieldDescriptor | None:
    field = descriptor.fields_by_name.get(name)
    if field is None:
        field = next((f for f in descriptor.fields if f.json_name == name), None)
    return field


def holds_structs(field: FieldDescriptor, seen: frozenset[str] = frozenset()) -> bool:
    """A message field that is a Struct or holds one; maps and JSON values (a prompt, stop
    strings) are left to ParseDict."""
    kind = field.message_type
    if kind is None or kind.GetOptions().map_entry or kind.full_name in JSON_VALUES | seen:
        return False
    if kind.full_name == STRUCT:
        return True
    return any(holds_structs(inner, seen | {kind.full_name}) for inner in kind.fields)


def written_in_order(field: FieldDescriptor, value: Any) -> bool:
    """Whether `value` has the shape this module writes; any other is left to ParseDict,
    which accepts it or says what is wrong."""
    if field.is_repeated:
        return isinstance(value, list) and all(isinstance(item, dict) for item in value)
    return isinstance(value, dict)


def message_bytes(field: FieldDescriptor, value: dict[str, Any]) -> bytes:
    if field.message_type.full_name == STRUCT:
        return struct_bytes(value)
    return ordered_bytes(message_factory.GetMessageClass(field.message_type), value)


def struct_bytes(value: dict[str, Any]) -> bytes:
    """A Struct's entries (field 1, each a key and a Value) in the dict's order."""
    return b"".join(
        length_delimited(
            1, length_delimited(1, key.encode()) + length_delimited(2, value_bytes(item))
        )
        for key, item in value.items()
    )


def value_bytes(item: Any) -> bytes:
    if isinstance(item, dict):
        return length_delimited(STRUCT_VALUE, struct_bytes(item))
    if isinstance(item, list):
        return length_delimited(
            LIST_VALUE, b"".join(length_delimited(1, value_bytes(x)) for x in item)
        )
    return json_format.ParseDict(item, struct_pb2.Value()).SerializeToString()


def length_delimited(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def varint(number: int) -> bytes:
    out = bytearray()
    while True:
        low, number = number & 0x7F, number >> 7
        out.append(low | (0x80 if number else 0))
        if not number:
            return bytes(out)
