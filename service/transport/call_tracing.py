"""Each call's span: a SERVER span that continues the caller's trace (its `traceparent`
metadata, which Envoy also sends for REST callers) and carries what the request's log line
says. The api layer adds its children (validation and tokenization, the engine); vLLM's own
`llm_request` span is a child of the engine's."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from plumbing.tracing import incoming_context, trace_id, tracer
from service.transport.observability import RequestRecord

SERVICE = "llmcompletions.v2.CompletionService"


@dataclass
class CallSpan:
    span: trace.Span
    token: object  # to detach the span from the call's context when it ends

    def end(self, record: RequestRecord, code: str) -> None:
        self.span.set_attributes(
            {
                "gen_ai.usage.input_tokens": record.prompt_tokens,
                "gen_ai.usage.output_tokens": record.completion_tokens,
                "gen_ai.usage.cache_read.input_tokens": record.cached_tokens,
                "rpc.grpc.status_code": grpc_status_number(code),
            }
        )
        if record.tenant:
            self.span.set_attributes(
                {"llm_completions.tenant": record.tenant, "llm_completions.key_id": record.key_id}
            )
        if code != "OK":
            self.span.set_status(Status(StatusCode.ERROR, code))
        otel_context.detach(self.token)  # type: ignore[arg-type]
        self.span.end()


def start_call_span(
    method: str, record: RequestRecord, context: grpc.aio.ServicerContext
) -> CallSpan:
    """The call's span, current for the rest of the call (its children find it)."""
    parent = incoming_context(context.invocation_metadata())
    span = tracer().start_span(
        f"{SERVICE}/{method}",
        context=parent,
        kind=SpanKind.SERVER,
        attributes={
            "rpc.system": "grpc",
            "rpc.service": SERVICE,
            "rpc.method": method,
            "gen_ai.request.model": record.model,
            "llm_completions.request_id": record.request_id,
            "llm_completions.stream": record.stream,
        },
    )
    record.trace_id = trace_id(span)
    token = otel_context.attach(trace.set_span_in_context(span, parent))
    return CallSpan(span, token)


def grpc_status_number(code: str) -> int:
    status = grpc.StatusCode.__members__.get(code, grpc.StatusCode.UNKNOWN)
    return int(status.value[0])
