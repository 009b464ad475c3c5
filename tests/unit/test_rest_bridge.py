"""The REST bridge: what the server and the facade's Lua filter agree on, pinned byte for byte,
and the gRPC code -> HTTP status and JSON error body mapping."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest
from google.protobuf import json_format

from service.api.errors import (
    FieldViolation,
    ModelNotFoundError,
    RequestValidationError,
    http_status,
)
from service.transport import rest_bridge

LUA = (Path(__file__).resolve().parents[2] / "facade" / "completions.lua").read_text()


def printed_as_the_transcoder_prints(message: object) -> bytes:
    """The transcoder's print options (envoy.yaml): snake_case names, primitive fields always
    printed, compact, one SSE event."""
    fields = json_format.MessageToDict(
        message,  # type: ignore[arg-type]
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
    )
    return b"data: " + json.dumps(fields, separators=(",", ":")).encode() + b"\n\n"


def test_the_end_sentinel_prints_as_the_bytes_the_facade_rewrites() -> None:
    # Adding a response field that always prints would change these bytes and silently drop
    # `data: [DONE]`: this test then fails first.
    printed = printed_as_the_transcoder_prints(rest_bridge.END_OF_EVENTS)
    assert printed == rest_bridge.END_OF_EVENTS_EVENT == b'data: {"choices":[]}\n\n'
    assert "local END_EVENT = 'data: {\"choices\":[]}\\n\\n'" in LUA


@pytest.mark.parametrize(
    "header",
    [
        rest_bridge.FRAMING_HEADER,
        rest_bridge.HTTP_STATUS_HEADER,
        rest_bridge.ERROR_BODY_HEADER,
    ],
)
def test_the_facade_reads_the_headers_the_bridge_names(header: str) -> None:
    assert f'"{header}"' in LUA


@pytest.mark.parametrize(
    ("code", "status"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, 422),
        (grpc.StatusCode.OUT_OF_RANGE, 400),
        (grpc.StatusCode.UNAUTHENTICATED, 401),
        (grpc.StatusCode.NOT_FOUND, 404),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, 429),
        (grpc.StatusCode.UNAVAILABLE, 503),
        (grpc.StatusCode.DEADLINE_EXCEEDED, 504),
        (grpc.StatusCode.INTERNAL, 500),
        (grpc.StatusCode.UNKNOWN, 500),
    ],
)
def test_grpc_codes_map_to_the_api_error_table(code: grpc.StatusCode, status: int) -> None:
    assert http_status(code) == status


def test_validation_errors_become_the_422_body_with_every_violation() -> None:
    error = RequestValidationError(
        [
            FieldViolation(("temperature",), "too hot", "less_than_equal"),
            FieldViolation(("stop", 1), "empty", "string_type"),
        ]
    )
    metadata = dict(rest_bridge.error_metadata(error))
    assert metadata[rest_bridge.HTTP_STATUS_HEADER] == "422"
    assert json.loads(metadata[rest_bridge.ERROR_BODY_HEADER]) == {
        "detail": [
            {"loc": ["body", "temperature"], "msg": "too hot", "type": "less_than_equal"},
            {"loc": ["body", "stop", 1], "msg": "empty", "type": "string_type"},
        ]
    }


def test_other_errors_become_a_detail_string_of_bounded_size() -> None:
    error = ModelNotFoundError("m" * 100_000, ["served"])
    metadata = dict(rest_bridge.error_metadata(error))
    assert metadata[rest_bridge.HTTP_STATUS_HEADER] == "404"
    detail = json.loads(metadata[rest_bridge.ERROR_BODY_HEADER])["detail"]
    assert detail.startswith("The model `" + "m" * 100) and len(detail.encode()) <= 384
    assert sum(len(key) + len(value) for key, value in metadata.items()) < 1024


def test_a_call_is_rest_only_when_the_transcoder_marked_it() -> None:
    assert rest_bridge.rest_call([("x-request-id", "a")]) is None
    marked = rest_bridge.rest_call(
        [(rest_bridge.TRANSCODED_MARKER, "/v2/completions"), (rest_bridge.MAX_REPLY_HEADER, "99")]
    )
    assert marked is not None and marked.max_reply_bytes == 99
    assert marked.framing(True) == ((rest_bridge.FRAMING_HEADER, "sse"),)
    assert marked.framing(False) == ((rest_bridge.FRAMING_HEADER, "json"),)
