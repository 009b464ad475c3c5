"""The REST bridge: everything the gRPC server and Envoy's facade (`facade/completions.lua`)
agree on, in one place. The facade applies what the server says; it decides nothing.

- A call came through the transcoder when it carries TRANSCODED_MARKER.
- The transcoder picks the gRPC method from the path alone, so one server-streaming method
  serves both modes. The server, which parses `stream` exactly as the transcoder does, says
  in initial metadata whether the REST reply is one JSON object or server-sent events, and
  ends an event stream with END_OF_EVENTS, which the facade rewrites to `data: [DONE]`.
- An error before any output travels as trailing metadata: the HTTP status and JSON body.
- The facade tells the server, in MAX_REPLY_HEADER, the largest whole JSON reply it carries.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from llmcompletions.v2.completions_pb2 import CreateCompletionResponse

from plumbing.headers import MAX_REPLY_HEADER
from service.api.errors import CompletionError, ReplyTooLargeError

Metadata = Sequence[tuple[str, str | bytes]]

# Envoy's transcoder sets this on every request it transcodes from REST.
TRANSCODED_MARKER = "x-envoy-original-path"
FRAMING_HEADER = "x-response-framing"
HTTP_STATUS_HEADER = "x-http-status"
ERROR_BODY_HEADER = "x-error-body"
END_OF_EVENTS = CreateCompletionResponse()
# The sentinel as the transcoder prints it (repeated fields are always printed); the facade
# matches these exact bytes.
END_OF_EVENTS_EVENT = b'data: {"choices":[]}\n\n'

# A non-streamed reply this much smaller than the limit cannot print past it as JSON: the
# transcoder's JSON is at most a few times the protobuf size for these messages.
SAFE_JSON_EXPANSION = 16


def error_body(error: CompletionError) -> dict[str, Any]:
    """The JSON error body: field violations for validation, else the message."""
    if error.violations:
        return {
            "detail": [
                {"loc": ["body", *v.loc], "msg": v.msg, "type": v.type} for v in error.violations
            ]
        }
    return {"detail": error.message}


def error_metadata(error: CompletionError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata from which the facade builds the HTTP status and JSON body."""
    body = json.dumps(error_body(error), ensure_ascii=True, separators=(",", ":"))
    return ((HTTP_STATUS_HEADER, str(error.http_code)), (ERROR_BODY_HEADER, body))


@dataclass(frozen=True)
class RestCall:
    """A call that came through the facade."""

    max_reply_bytes: int | None  # the facade's cap on a whole JSON reply

    def framing(self, stream: bool) -> tuple[tuple[str, str], ...]:
        return ((FRAMING_HEADER, "sse" if stream else "json"),)

    def check_whole_reply(self, reply: Message) -> None:
        """Refuse a non-streamed reply whose JSON the facade could not carry."""
        limit = self.max_reply_bytes
        if limit is None or reply.ByteSize() * SAFE_JSON_EXPANSION <= limit:
            return
        printed = json_format.MessageToJson(
            reply,
            indent=None,
            preserving_proto_field_name=True,
            always_print_fields_with_no_presence=True,
        )
        size = len(printed.encode())
        if size > limit:
            raise ReplyTooLargeError(size, limit, "a whole REST reply")


def rest_call(metadata: Metadata | None) -> RestCall | None:
    """The REST side of a call, or None for a native gRPC call."""
    found = dict(metadata or ())
    if TRANSCODED_MARKER not in found:
        return None
    limit = found.get(MAX_REPLY_HEADER)
    return RestCall(int(limit) if isinstance(limit, str) and limit.isdigit() else None)
