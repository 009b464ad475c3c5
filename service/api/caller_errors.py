"""Which errors are the caller's: the one translation of what building a request raises for
what its caller sent, and of vLLM's error responses, into the API's errors (docs/api.md,
"Errors").

A request is built by our validation, then vLLM's request model (its validators), its renderer
and chat template, its tool and reasoning parsers and its SamplingParams. `building_request`
goes around all of that, for both methods: what it raises there for the request's content
becomes a 4xx naming the field (pydantic's `loc`, the `parameter` of vLLM's error, else the
body). The split is vLLM's own (`vllm.entrypoints.serve`'s create_error_response): its client errors
(VLLMClientError) are the caller's; so are ValueError, TypeError, OverflowError and a chat
template's errors, raised from the input while it is built, and, here, a missing key or too
deep a nesting (vLLM's validators read the raw body). Once the engine has the request
(`engine_has_request`), only vLLM's client errors are: anything else is a server fault, 500.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from http import HTTPStatus

import grpc
import jinja2
import pydantic
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.entrypoints.serve.exception_handling.error_response import create_error_response
from vllm.entrypoints.serve.exception_handling.utils import sanitize_message
from vllm.exceptions import VLLMClientError, VLLMError, VLLMValidationError

from service.api.errors import (
    MAX_VIOLATION_BYTES,
    CompletionError,
    EngineUnavailableError,
    FieldViolation,
    InternalError,
    Loc,
    OverloadedError,
    RequestValidationError,
    clip,
)

logger = logging.getLogger(__name__)

# Raised by building code from the request's content; once the engine has it, a server fault.
INPUT_ERRORS = (
    ValueError,  # pydantic's ValidationError among them
    TypeError,
    OverflowError,
    LookupError,
    RecursionError,
    jinja2.TemplateError,
)
# Parts of a pydantic loc that name a validator, not a field.
VALIDATOR_STEPS = frozenset({"function-after", "function-before", "function-wrap"})
# The body as a whole, when no field is named: loc ["body"] on REST (which adds "body").
BODY: Loc = ()


class VllmContextLengthError(CompletionError):
    """A request that, as vLLM renders it, does not fit the model's context (vLLM's message)."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE


class VllmNotFoundError(CompletionError):
    grpc_code = grpc.StatusCode.NOT_FOUND


def parameter_loc(parameter: str | None, fallback: Loc = BODY) -> Loc:
    """vLLM's name of a field (`tool_choice.function.name`) as a loc."""
    return tuple(parameter.split(".")) if parameter else fallback


def vllm_error(
    status: int, message: str, param: str | None = None, fallback: Loc = BODY
) -> CompletionError:
    """vLLM's error (an HTTP status and message) as the API's: a request the model cannot take
    (over its context) is 400, anything else the caller sent wrong a validation error (422)."""
    if status == HTTPStatus.BAD_REQUEST and (
        "context length" in message or "maximum context" in message
    ):
        return VllmContextLengthError(message)
    if status == HTTPStatus.NOT_FOUND:
        return VllmNotFoundError(message)
    if status == HTTPStatus.TOO_MANY_REQUESTS:
        return OverloadedError(message)
    if status == HTTPStatus.SERVICE_UNAVAILABLE:
        return EngineUnavailableError(message)
    if HTTPStatus.BAD_REQUEST <= status < HTTPStatus.INTERNAL_SERVER_ERROR:
        violation = FieldViolation(parameter_loc(param, fallback), message, "value_error")
        return RequestValidationError([violation])
    return InternalError(message)


def error_from(response: ErrorResponse, fallback: Loc = BODY) -> CompletionError:
    return vllm_error(response.error.code, response.error.message, response.error.param, fallback)


def pydantic_violations(error: pydantic.ValidationError, prefix: Loc = ()) -> list[FieldViolation]:
    return [
        FieldViolation(
            (*prefix, *(part for part in issue["loc"] if part not in VALIDATOR_STEPS)),
            clip(issue["msg"], MAX_VIOLATION_BYTES),
            issue["type"],
        )
        for issue in error.errors(include_url=False, include_input=False)
    ]


def caller_error(error: Exception, fallback: Loc = BODY) -> CompletionError:
    """The API's error for one the caller's input raised while its request was built (one of
    INPUT_ERRORS or a VLLMClientError)."""
    if isinstance(error, pydantic.ValidationError):
        return RequestValidationError(pydantic_violations(error))
    if isinstance(error, (LookupError, RecursionError)):  # vLLM would make these 500s
        deep = isinstance(error, RecursionError)
        what = "nested too deeply" if deep else "missing"
        message = f"a part of the request is {what}: {sanitize_message(str(error))}"
        violation = FieldViolation(fallback, message, "too_deep" if deep else "missing")
        return RequestValidationError([violation])
    # vLLM's own status, message (paths and addresses removed) and field for the error.
    return error_from(create_error_response(error), fallback)


@contextlib.contextmanager
def building_request(fallback: Loc = BODY) -> Iterator[None]:
    """Around the building of a request from its caller's input: what the input makes it
    raise becomes the API's error for it (a 4xx naming the field, else `fallback`)."""
    try:
        yield
    except CompletionError:
        raise
    except (VLLMClientError, *INPUT_ERRORS) as error:
        if not isinstance(error, (VLLMClientError, pydantic.ValidationError)):
            # Kept findable in the log: a fault of ours would look the same to the caller.
            logger.info("request refused while built: %s: %s", type(error).__name__, error)
        raise caller_error(error, fallback) from error


# The engine ends a constrained request with this finish reason when the grammar does not
# compile in the engine, or allows none of the model's tokens: a constraint nothing satisfies
# (vLLM's server makes it a 500). Unconstrained, it is the engine's own failure.
ENGINE_FAILED = "error"
UNSATISFIABLE_CONSTRAINT = (
    "the engine could not follow this constraint: it does not compile, or admits no output "
    "this model can generate"
)


def unsatisfiable_constraint(field: str) -> VLLMValidationError:
    return VLLMValidationError(UNSATISFIABLE_CONSTRAINT, parameter=field)


class EngineSideError(Exception):
    """An error raised once the engine had the request: a server fault, whatever its type."""


@contextlib.contextmanager
def engine_has_request() -> Iterator[None]:
    """Around code that runs once the engine has the request: its errors stay server faults
    (500) inside `building_request`, except vLLM's client errors (the engine checks the request
    on submission: its length, its constraint)."""
    try:
        yield
    except (CompletionError, VLLMError):
        raise
    except INPUT_ERRORS as error:
        raise EngineSideError(f"{type(error).__name__}: {error}") from error
