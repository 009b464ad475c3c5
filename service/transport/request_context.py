"""The outermost interceptor: every call gets a request id and a record (and, with tracing on,
a span), and is counted and logged once with its true final status, whether it was served,
refused or expired. It also
binds what the facade passed about the endpoint's models (`service.api.endpoint_models`)."""

from __future__ import annotations

import asyncio
import contextvars
import re
import time
import uuid
from collections.abc import AsyncIterator

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message

from service.api import endpoint_models
from service.transport.batch_lines import line_owner
from service.transport.call_tracing import start_call_span
from service.transport.endpoint_header import passed_listing
from service.transport.interception import StreamBehaviour, StreamInterceptor
from service.transport.observability import (
    GENERATING_METHODS,
    IN_FLIGHT,
    INTERACTIVE_CALLS,
    RequestRecord,
    caller_text,
)

REQUEST_ID_HEADER = "x-request-id"
# Accepted from callers as is; anything else is replaced, so ids stay safe to log and echo.
ACCEPTABLE_ID = re.compile(r"^[A-Za-z0-9._:/+=-]{1,128}$")

# A client cancels its call when its own deadline passes, which is a little before the
# server's copy of that deadline (the timeout is counted from when the call arrived here).
# A cancellation this close to the deadline is the deadline's.
DEADLINE_SLACK_SECONDS = 0.5

_current: contextvars.ContextVar[RequestRecord] = contextvars.ContextVar("request_record")


def current_record() -> RequestRecord:
    """The record of the call being served (set by RequestContextInterceptor)."""
    return _current.get()


def request_id(context: grpc.aio.ServicerContext) -> str:
    """The caller's (or Envoy's) x-request-id when it is sane, else a new one."""
    for key, value in context.invocation_metadata() or ():
        if key == REQUEST_ID_HEADER and isinstance(value, str) and ACCEPTABLE_ID.match(value):
            return value
    return uuid.uuid4().hex


def ended_code(context: grpc.aio.ServicerContext) -> str:
    """The status of a call that ended without a message: aborted, expired or cancelled."""
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    remaining = context.time_remaining()
    expired = remaining is not None and remaining <= DEADLINE_SLACK_SECONDS
    return "DEADLINE_EXCEEDED" if expired else "CANCELLED"


def logged_prompts(request: Message) -> list[str]:
    """A completion's prompt, or a chat's messages, as JSON for the request's log line."""
    if hasattr(request, "prompt"):
        return [json_format.MessageToJson(request.prompt, indent=None)]
    messages = getattr(request, "messages", ())
    return [json_format.MessageToJson(message, indent=None) for message in messages]


class RequestContextInterceptor(StreamInterceptor):
    def __init__(
        self, methods: frozenset[str], log_prompts: bool = False, traced: bool = False
    ) -> None:
        super().__init__(methods)
        self._log_prompts = log_prompts
        self._traced = traced  # each call gets a span (off: no cost at all)

    async def around(
        self,
        inner: StreamBehaviour,
        method: str,
        request: Message,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Message]:
        record = self.record(method, request, context)
        token = _current.set(record)
        span = start_call_span(method, record, context) if self._traced else None
        endpoint = endpoint_models.bind(passed_listing(context))
        code = "UNKNOWN"
        IN_FLIGHT.inc()
        interactive = method in GENERATING_METHODS and record.line_owner is None
        if interactive:
            INTERACTIVE_CALLS.add(1)
        try:
            messages = inner(request, context)
            async for message in messages:  # the first: the time to it is measured
                record.message_sent(message)
                yield message
                break
            # The rest go straight through (a loop per token is the serving path's cost): only
            # their text is kept, where prompts are logged; the last went when the stream ends.
            logs_output = record.prompts is not None
            async for message in messages:
                if logs_output:
                    record.message_sent(message)
                yield message
            record.last_message_at = time.monotonic()
            code = "OK"
        except (grpc.aio.AbortError, asyncio.CancelledError, GeneratorExit):
            code = ended_code(context)
            raise
        finally:
            IN_FLIGHT.dec()
            if interactive:
                INTERACTIVE_CALLS.add(-1)
            record.finish(code)
            if span is not None:
                span.end(record, code)
            endpoint_models.unbind(endpoint)
            _current.reset(token)

    def record(
        self, method: str, request: Message, context: grpc.aio.ServicerContext
    ) -> RequestRecord:
        return RequestRecord(
            request_id=request_id(context),
            method=method,
            model=caller_text(getattr(request, "model", "") or getattr(request, "lora_name", "")),
            user=caller_text(getattr(request, "user", "")),
            stream=getattr(request, "stream", False),
            prompts=logged_prompts(request) if self._log_prompts else None,
            line_owner=line_owner(tuple(context.invocation_metadata() or ())),
        )
