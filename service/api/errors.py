"""Errors a completion request can end with: a gRPC code, a message and, for validation,
the fields at fault, and the HTTP status each code has for REST callers (the API's error
table). How they reach REST callers is `service.transport.rest_bridge`'s business.

Messages and field descriptions are bounded: a value quoted from the request is clipped
(`quote`), and every message is cut to a byte budget, whatever produced it (our validation,
the engine, a structured-output compiler). The whole error then travels in response metadata
well within gRPC's 8 KiB metadata limit and Envoy's header limits (docs/calling/errors.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from datetime import datetime, timezone

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

# A value quoted from the request shows at most this many characters.
MAX_QUOTED_CHARS = 256
# Byte budgets (UTF-8) of what travels in metadata; gRPC percent-encodes the message.
MAX_MESSAGE_BYTES = 384
MAX_VIOLATION_BYTES = 320
MAX_VIOLATIONS_BYTES = 768
# A model name in a message shows at most this many characters, and the served names an
# unknown-model error lists take at most this many bytes (the rest are counted): together
# within MAX_MESSAGE_BYTES.
MAX_QUOTED_NAME_CHARS = 100
MAX_SERVED_NAMES_BYTES = 160
ELLIPSIS = "…"

Loc = tuple[str | int, ...]

# gRPC code -> HTTP status, the API's error table (docs/calling/errors.md).
HTTP_STATUS: dict[grpc.StatusCode, int] = {
    grpc.StatusCode.INVALID_ARGUMENT: 422,
    grpc.StatusCode.OUT_OF_RANGE: 400,
    grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403,
    grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409,
    grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499,
    grpc.StatusCode.UNAVAILABLE: 503,
    grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}


def http_status(code: grpc.StatusCode) -> int:
    return HTTP_STATUS.get(code, 500)


def clip(text: str, max_bytes: int) -> str:
    """`text` cut to at most `max_bytes` of UTF-8, ending in an ellipsis if it was cut."""
    encoded = text.encode()
    if len(encoded) <= max_bytes:
        return text
    room = max_bytes - len(ELLIPSIS.encode())
    return encoded[:room].decode(errors="ignore") + ELLIPSIS


def quote(value: object, max_chars: int = MAX_QUOTED_CHARS) -> str:
    """A request value for a message: in backticks, at most `max_chars` characters."""
    text = str(value)
    if len(text) > max_chars:
        text = f"{text[:max_chars]}{ELLIPSIS} ({len(text)} characters)"
    return f"`{text}`"


@dataclass(frozen=True)
class FieldViolation:
    """One invalid field: where it is (path inside the body), what is wrong, and a type tag."""

    loc: Loc
    msg: str
    type: str

    @property
    def field_path(self) -> str:
        """The loc as a google.rpc.BadRequest field path: `stop[1]`, `stream_options.x`."""
        path = ""
        for part in self.loc:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else part)
        return path


class CompletionError(Exception):
    """A request that ends with an error status instead of a completion."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    # The HTTP status when the code's in the error table does not fit this error.
    http_status_override: int | None = None

    def __init__(self, message: str) -> None:
        self.message = clip(message, MAX_MESSAGE_BYTES)
        super().__init__(self.message)

    @property
    def http_code(self) -> int:
        return self.http_status_override or http_status(self.grpc_code)

    @property
    def violations(self) -> Sequence[FieldViolation]:
        """The fields at fault, for validation errors."""
        return ()

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Extra trailing metadata (headers through Envoy), e.g. a retry hint."""
        return ()

    def status_details(self) -> list[any_pb2.Any]:
        return []

    def rpc_status(self) -> status_pb2.Status:
        code = getattr(code_pb2, self.grpc_code.name)
        return status_pb2.Status(code=code, message=self.message, details=self.status_details())


def within_budget(violations: Sequence[FieldViolation]) -> list[FieldViolation]:
    """The violations, each description clipped, as many as fit the budget (at least one)."""
    kept: list[FieldViolation] = []
    spent = 0
    for violation in violations:
        clipped = replace(violation, msg=clip(violation.msg, MAX_VIOLATION_BYTES))
        spent += len(clipped.msg.encode()) + len(clipped.field_path)
        if kept and spent > MAX_VIOLATIONS_BYTES:
            break
        kept.append(clipped)
    return kept


class RequestValidationError(CompletionError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT

    def __init__(self, violations: Sequence[FieldViolation]) -> None:
        self._violations = within_budget(violations)
        omitted = len(violations) - len(self._violations)
        summary = "; ".join(
            f"{v.field_path}: {v.msg}" if v.loc else v.msg for v in self._violations
        )
        more = f" ({omitted} more not shown)" if omitted else ""
        super().__init__(f"invalid request{more}: {summary}")

    @property
    def violations(self) -> Sequence[FieldViolation]:
        return self._violations

    def status_details(self) -> list[any_pb2.Any]:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field=v.field_path, description=v.msg)
                for v in self._violations
            ]
        )
        packed = any_pb2.Any()
        packed.Pack(bad_request)
        return [packed]


def quoted_list(values: Sequence[str], max_bytes: int) -> str:
    """The values quoted and comma-separated, as many as fit `max_bytes` (at least one), then
    how many more there are."""
    shown: list[str] = []
    spent = 0
    for value in values:
        quoted = quote(value, MAX_QUOTED_NAME_CHARS)
        spent += len(quoted.encode()) + 2
        if shown and spent > max_bytes:
            break
        shown.append(quoted)
    omitted = len(values) - len(shown)
    return ", ".join(shown) + (f" and {omitted} more" if omitted else "")


class ModelNotFoundError(CompletionError):
    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, requested: str, served: Sequence[str]) -> None:
        super().__init__(
            f"The model {quote(requested, MAX_QUOTED_NAME_CHARS)} does not exist; the served "
            f"models are {quoted_list(served, MAX_SERVED_NAMES_BYTES)}."
        )


class ContextLengthError(CompletionError):
    """A well-formed request that cannot fit the model's context."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE

    def __init__(self, max_model_len: int, prompt_tokens: int, max_tokens: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the prompt or max_tokens."
        )


class TruncationTooLongError(CompletionError):
    """truncate_prompt_tokens asks to keep more than the context holds."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE

    def __init__(self, keep: int, max_model_len: int) -> None:
        super().__init__(
            f"truncate_prompt_tokens={keep} is more than this model's maximum context length "
            f"({max_model_len} tokens). Ask for fewer, or -1 to keep what fits."
        )


class PriorityNotEnabledError(CompletionError):
    """A priority asked of a server that schedules first come, first served."""

    grpc_code = grpc.StatusCode.FAILED_PRECONDITION

    def __init__(self, priority: int) -> None:
        super().__init__(
            f"priority {priority} needs a server started with --scheduling-policy priority "
            "(SCHEDULING_POLICY=priority); this one serves requests first come, first served. "
            "Leave priority out, or 0."
        )


class ReplyTooLargeError(CompletionError):
    """A well-formed request whose whole reply is larger than the surface can carry."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE

    def __init__(self, size: int, limit: int, what: str) -> None:
        super().__init__(
            f"The reply is {size} bytes, over the {limit}-byte limit of {what}. Set `stream` "
            "to true to receive it in pieces, ask for less (fewer prompts, n, logprobs or "
            "echo), or have the operator raise the limit."
        )


class OverloadedError(CompletionError):
    """The replica's backlog is past its bounds: retry shortly, here or on another replica."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    retry_after_seconds = 1

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("retry-after", str(self.retry_after_seconds)),)


class EngineUnavailableError(CompletionError):
    grpc_code = grpc.StatusCode.UNAVAILABLE


class InternalError(CompletionError):
    grpc_code = grpc.StatusCode.INTERNAL


def utc_timestamp() -> str:
    return datetime.now(timezone.utc).isoformat()


class RequestCancelledError(CompletionError):
    """The call was stopped by a CancelCompletion of its request id."""

    grpc_code = grpc.StatusCode.CANCELLED

    def __init__(self, request_id: str) -> None:
        super().__init__(f"The request {quote(request_id)} was cancelled by its caller.")


class CancelTargetNotFoundError(CompletionError):
    grpc_code = grpc.StatusCode.NOT_FOUND

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"No completion with the request id {quote(request_id)} is running or queued here."
        )


class CancelForbiddenError(CompletionError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED

    def __init__(self, request_id: str) -> None:
        super().__init__(
            f"The completion with the request id {quote(request_id)} was started by another "
            "caller; only the API key that started it may cancel it."
        )


class AdapterCallError(CompletionError):
    """An adapter that cannot be loaded, unloaded or run; the message names it."""


class AdapterNotFoundCallError(AdapterCallError):
    grpc_code = grpc.StatusCode.NOT_FOUND


class AdapterInvalidCallError(AdapterCallError):
    """A bad adapter, not a bad request field: 400, not the 422 of field validation."""

    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status_override = 400


class AdapterNameTakenCallError(AdapterCallError):
    grpc_code = grpc.StatusCode.ALREADY_EXISTS


class AdapterForbiddenCallError(AdapterCallError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED


class AdapterCapacityCallError(AdapterCallError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED


class AdapterPreconditionCallError(AdapterCallError):
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION


class AdapterUnloadedError(AdapterCallError):
    """A call still running on an adapter when its unload's drain deadline passed."""

    grpc_code = grpc.StatusCode.ABORTED
    http_status_override = 409
