"""JSON objects in the order the caller wrote their keys.

A request's JSON objects (a schema, a tool's parameters) arrive as google.protobuf.Struct, a map,
and protobuf's Python runtime keeps a map's entries in hash order, which changes from process to
process. The order is part of what the caller asked for: the structured-output backends write a
schema's properties in it (a reply of {"city", "people"} came back as {"people", "city"}, unlike
vLLM's own server), and a tool's parameters reach the chat template in it. The wire keeps the
caller's order (Envoy's transcoder writes a REST body's keys as they come), so each request's
bytes are read once more for the objects it holds, and `in_caller_order` puts their keys back.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator
from contextvars import ContextVar
from dataclasses import dataclass
from functools import cache, cached_property
from typing import Any

from google.protobuf.descriptor import Descriptor

STRUCT = "google.protobuf.Struct"
# JSON values (a prompt, stop strings) are not read again: no caller of `in_caller_order` asks
# for an object inside one, and a prompt of token ids would cost a walk over every token.
OPAQUE = frozenset({"google.protobuf.Value", "google.protobuf.ListValue"})
VARINT, FIXED64, LENGTH_DELIMITED, FIXED32 = 0, 1, 2, 5


@dataclass
class RequestBytes:
    """The bytes of the call's request, read for its objects only when one is asked for: after
    validation, which refuses an oversized object before it costs a walk here."""

    raw: bytes
    descriptor: Descriptor

    @cached_property
    def objects(self) -> dict[str, dict[str, Any]]:
        """Each JSON object of the request, in its caller's order, by its content (objects of
        the same content share the order of the last)."""
        try:
            return {
                content_key(value): value for value in objects_on_wire(self.raw, self.descriptor)
            }
        except (ValueError, IndexError, struct.error, UnicodeDecodeError):
            return {}  # bytes it cannot read leave the order unknown


_request: ContextVar[RequestBytes | None] = ContextVar("caller_order", default=None)


def remember(raw: bytes, descriptor: Descriptor) -> None:
    """Keeps the request of the call being served (`raw`, a message of type `descriptor`), for
    `in_caller_order`."""
    _request.set(RequestBytes(raw, descriptor))


def in_caller_order(value: dict[str, Any]) -> dict[str, Any]:
    """`value`, a JSON object of the request being served, with its keys (at every depth) in
    the order its caller wrote them, when the request held it; else `value` itself."""
    request = _request.get()
    if request is None:
        return value
    return request.objects.get(content_key(value), value)


def content_key(value: dict[str, Any]) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"))


@cache
def holds_objects(descriptor: Descriptor, seen: frozenset[str] = frozenset()) -> bool:
    """Whether a message of this type can hold a Struct field, at any depth (JSON values not
    counted)."""
    if descriptor.full_name in OPAQUE:
        return False
    for field in descriptor.fields:
        kind = field.message_type
        if kind is None or kind.full_name in seen:
            continue
        if kind.full_name == STRUCT or holds_objects(kind, seen | {descriptor.full_name}):
            return True
    return False


def objects_on_wire(raw: bytes, descriptor: Descriptor) -> Iterator[dict[str, Any]]:
    """Every Struct field's value in a message's bytes, at any depth, as a JSON object."""
    for number, wire_type, payload in wire_fields(raw):
        field = descriptor.fields_by_number.get(number)
        if field is None or field.message_type is None or wire_type != LENGTH_DELIMITED:
            continue
        assert isinstance(payload, bytes)
        if field.message_type.full_name == STRUCT:
            yield restore_integers(json_object(payload))
        elif holds_objects(field.message_type):
            yield from objects_on_wire(payload, field.message_type)


def json_object(raw: bytes) -> dict[str, Any]:
    """A Struct's bytes as a JSON object, its entries in wire order (the last of a repeated key
    wins, as protobuf's does)."""
    value: dict[str, Any] = {}
    for number, _, entry in wire_fields(raw):
        if number == 1 and isinstance(entry, bytes):
            key, item = "", None
            for part, _, payload in wire_fields(entry):
                if part == 1 and isinstance(payload, bytes):
                    key = payload.decode()
                elif part == 2 and isinstance(payload, bytes):
                    item = json_item(payload)
            value[key] = item
    return value


def json_item(raw: bytes) -> Any:
    """A google.protobuf.Value's bytes as JSON (the last kind set wins, as protobuf's does)."""
    item: Any = None
    for number, _, payload in wire_fields(raw):
        if number == 2 and isinstance(payload, bytes):
            (item,) = struct.unpack("<d", payload)
        elif number == 3 and isinstance(payload, bytes):
            item = payload.decode()
        elif number == 4:
            item = bool(payload)
        elif number == 5 and isinstance(payload, bytes):
            item = json_object(payload)
        elif number == 6 and isinstance(payload, bytes):
            item = [json_item(value) for part, _, value in wire_fields(payload) if part == 1]
        elif number == 1:
            item = None
    return item


def wire_fields(raw: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """A message's fields as (number, wire type, value): an int for varints, bytes otherwise."""
    position = 0
    while position < len(raw):
        key, position = varint(raw, position)
        number, wire_type = key >> 3, key & 7
        value: int | bytes
        if wire_type == VARINT:
            value, position = varint(raw, position)
        elif wire_type in (FIXED64, FIXED32):
            size = 8 if wire_type == FIXED64 else 4
            value, position = raw[position : position + size], position + size
        elif wire_type == LENGTH_DELIMITED:
            size, position = varint(raw, position)
            value, position = raw[position : position + size], position + size
        else:  # groups: no proto3 message has them
            raise ValueError(f"wire type {wire_type} is not read here")
        if position > len(raw):
            raise ValueError("a field runs past the message's end")
        yield number, wire_type, value


def varint(raw: bytes, position: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = raw[position]
        position += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, position
        shift += 7


def restore_integers(value: Any) -> Any:
    """Whole numbers as integers again: a Struct holds every number as a double, and schema
    keywords such as maxLength must be integers (JSON does not tell them apart)."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, dict):
        return {key: restore_integers(item) for key, item in value.items()}
    if isinstance(value, list):
        return [restore_integers(item) for item in value]
    return value
