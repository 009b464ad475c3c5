"""A job's lines: read from the request's `content` or its input file (a JSON list, or JSONL
with one request a line), each a completion request (`prompt`) or a chat request (`messages`)
with every field of the synchronous endpoint, `model` from the job's model_config unless the
line names one, never streamed; each checked at create by the synchronous call's own
validation, a bad line refused with 422 naming its index and field."""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from llmcompletions.v2.completions_pb2 import CreateChatCompletionRequest, CreateCompletionRequest

from service.api.batch import files
from service.api.errors import CompletionError, FieldViolation, Loc, RequestValidationError
from service.api.validation import Violations
from service.settings import BatchSettings

KINDS: dict[str, type[Message]] = {
    "completion": CreateCompletionRequest,
    "chat": CreateChatCompletionRequest,
}
# At most this many violations are reported for a whole job (the error stays small).
MAX_REPORTED = 20


@dataclass(frozen=True)
class Line:
    kind: str  # "completion" or "chat"
    body: dict[str, Any]


def read_input_file(location: str, limits: BatchSettings, field: str) -> list[Any]:
    """The requests of an input file (on disk or in a bucket): a JSON list, or JSONL. Reads
    from disk or the network: call it from a thread."""
    try:
        size = files.size_of(location)
    except OSError as error:
        raise one_violation((field,), f"cannot read {field}: {reason(error)}") from error
    if size > limits.max_input_bytes:
        raise one_violation(
            (field,), f"the file has {size} bytes; at most {limits.max_input_bytes} per job"
        )
    try:
        text = files.read_text(location)
    except (OSError, UnicodeDecodeError) as error:
        raise one_violation((field,), f"cannot read {field} as UTF-8 text: {error}") from error
    try:
        parsed = json.loads(text)
    except ValueError:
        parsed = None
    if isinstance(parsed, list):
        return parsed
    try:
        return [json.loads(line) for line in text.splitlines() if line.strip()]
    except ValueError as error:
        raise one_violation(
            (field,), f"the file is neither a JSON list of requests nor JSONL: {error}"
        ) from error


def reason(error: OSError) -> str:
    if isinstance(error, FileNotFoundError):
        return "no such file"
    if isinstance(error, PermissionError):
        return "permission denied"
    return error.strerror or str(error)


def one_violation(loc: Loc, message: str) -> RequestValidationError:
    return RequestValidationError([FieldViolation(loc, message, "value_error")])


def kind_of(request: dict[str, Any]) -> str | None:
    if "messages" in request:
        return "chat"
    return "completion" if "prompt" in request else None


def normalized(request: dict[str, Any], model: str | None) -> dict[str, Any]:
    """The line without nulls (LLM Engine's client sends every unset field as null), with the
    job's model unless it names one."""
    body = {key: value for key, value in request.items() if value is not None}
    if "model" not in body and model:
        body["model"] = model
    return body


def checked_lines(
    requests: Sequence[Any],
    model: str | None,
    where: Loc,
    limits: BatchSettings,
    validate: Callable[[str, Message], None],
) -> list[Line]:
    """The job's lines, each validated as the synchronous call validates it (`validate`);
    every bad line refused together (up to MAX_REPORTED violations)."""
    if not requests:
        raise one_violation(where, "a job needs at least one request")
    if len(requests) > limits.max_lines:
        raise one_violation(where, f"{len(requests)} requests; at most {limits.max_lines} per job")
    found = Violations()
    lines = []
    for index, request in enumerate(requests):
        line = checked_line(request, model, (*where, index), validate, found)
        if line is not None:
            lines.append(line)
        if len(found.items) >= MAX_REPORTED:
            break
    if found.items:
        raise RequestValidationError(found.items[:MAX_REPORTED])
    return lines


def checked_line(
    request: Any,
    model: str | None,
    loc: Loc,
    validate: Callable[[str, Message], None],
    found: Violations,
) -> Line | None:
    if not isinstance(request, dict) or (kind := kind_of(request)) is None:
        found.add(loc, "each line is a completion request (prompt) or a chat request (messages)")
        return None
    body = normalized(request, model)
    if body.get("stream"):
        found.add((*loc, "stream"), "batch lines are not streamed: leave stream unset or false")
        return None
    try:
        message = json_format.ParseDict(body, KINDS[kind](), ignore_unknown_fields=True)
    except json_format.ParseError as error:
        found.add(loc, f"not a valid {kind} request: {str(error)[:200]}")
        return None
    try:
        validate(kind, message)
    except CompletionError as error:
        for violation in error.violations or [FieldViolation((), error.message, "value_error")]:
            found.add((*loc, *violation.loc), violation.msg, violation.type)
        return None
    return Line(kind, body)
