"""Errors a completion request can end with, and how each reaches gRPC and REST callers.

Each error knows its gRPC code, its REST status and REST JSON body (CONTRACT.md's table).
REST callers get the body through Envoy: the servicer sends it in trailing metadata that
the facade's Lua filter turns into the HTTP response.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

# Bounded so that the status fits gRPC's 8 KiB metadata soft limit.
MAX_REPORTED_VIOLATIONS = 20
MAX_MESSAGE_CHARS = 300

Loc = tuple[str | int, ...]


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
    http_status: int = 500

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def rest_body(self) -> dict[str, Any]:
        return {"detail": self.message}

    def metadata(self) -> tuple[tuple[str, str], ...]:
        """Extra trailing metadata (headers through Envoy), e.g. a retry hint."""
        return ()

    def status_details(self) -> list[any_pb2.Any]:
        return []

    def rpc_status(self) -> status_pb2.Status:
        code = getattr(code_pb2, self.grpc_code.name)
        return status_pb2.Status(code=code, message=self.message, details=self.status_details())


class RequestValidationError(CompletionError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 422

    def __init__(self, violations: Sequence[FieldViolation]) -> None:
        self.violations = list(violations)[:MAX_REPORTED_VIOLATIONS]
        summary = "; ".join(f"{v.field_path}: {v.msg}" for v in self.violations)
        super().__init__(f"invalid request: {summary}")

    def rest_body(self) -> dict[str, Any]:
        return {
            "detail": [
                {"loc": ["body", *v.loc], "msg": v.msg[:MAX_MESSAGE_CHARS], "type": v.type}
                for v in self.violations
            ]
        }

    def status_details(self) -> list[any_pb2.Any]:
        bad_request = error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(
                    field=v.field_path, description=v.msg[:MAX_MESSAGE_CHARS]
                )
                for v in self.violations
            ]
        )
        packed = any_pb2.Any()
        packed.Pack(bad_request)
        return [packed]


class ModelNotFoundError(CompletionError):
    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404

    def __init__(self, requested: str, served: str) -> None:
        super().__init__(f"The model `{requested}` does not exist; this server serves `{served}`.")


class ContextLengthError(CompletionError):
    """A well-formed request that cannot fit the model's context."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE
    http_status = 400

    def __init__(self, max_model_len: int, prompt_tokens: int, max_tokens: int) -> None:
        super().__init__(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion). Please reduce the prompt or max_tokens."
        )


class EngineUnavailableError(CompletionError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503


class InternalError(CompletionError):
    grpc_code = grpc.StatusCode.INTERNAL
    http_status = 500


def rest_error_metadata(error: CompletionError) -> tuple[tuple[str, str], ...]:
    """Trailing metadata from which the facade builds the REST status and JSON body."""
    body = json.dumps(error.rest_body(), ensure_ascii=True, separators=(",", ":"))
    return (("x-http-status", str(error.http_status)), ("x-error-body", body))


def utc_timestamp() -> str:
    return datetime.now(timezone.utc).isoformat()
