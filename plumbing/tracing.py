"""OpenTelemetry tracing for every process of the product (the service, the replica picker and
Envoy's launcher), switched on by one option and off by default.

Configured as OpenTelemetry's SDKs are, by the standard variables: the endpoint
(`--otlp-traces-endpoint`, or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT), the protocol
(OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: `grpc`, the default as in vLLM, or `http/protobuf`), the
sampler (OTEL_TRACES_SAMPLER and OTEL_TRACES_SAMPLER_ARG; by default a caller's sampling
decision is followed, and every new trace is sampled) and the service's name
(OTEL_SERVICE_NAME, else the process's own default). Traces continue the caller's W3C
`traceparent` and `tracestate`.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.trace import Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
from opentelemetry.util.types import AttributeValue

logger = logging.getLogger(__name__)

ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"
PROTOCOL_ENV = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"
SERVICE_NAME_ENV = "OTEL_SERVICE_NAME"
PROTOCOLS = ("grpc", "http/protobuf")
# At exit, the spans not yet sent get this long to go (a collector that is down costs no more).
FLUSH_AT_EXIT_MILLIS = 2000

PROPAGATOR = TraceContextTextMapPropagator()
TRACER_NAME = "llm-completions"


@dataclass(frozen=True)
class TracingSettings:
    endpoint: str  # grpc: http(s)://host:port; http/protobuf: the full URL, e.g. .../v1/traces
    protocol: str
    service_name: str

    @property
    def host_and_port(self) -> tuple[str, int, bool]:
        """The collector's host, port, and whether it speaks TLS."""
        parts = urlsplit(self.endpoint if "://" in self.endpoint else f"http://{self.endpoint}")
        secure = parts.scheme == "https"
        default_port = {"grpc": 4317, "http/protobuf": 4318}[self.protocol]
        return parts.hostname or "127.0.0.1", parts.port or default_port, secure

    @property
    def url_path(self) -> str:
        """The HTTP path an http/protobuf collector takes spans on."""
        return urlsplit(self.endpoint).path or "/v1/traces"


def add_tracing_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=os.environ.get(ENDPOINT_ENV) or None,
        help=(
            "send OpenTelemetry traces to this OTLP collector, e.g. http://127.0.0.1:4317 "
            f"(protocol: {PROTOCOL_ENV}, grpc or http/protobuf) [env {ENDPOINT_ENV}; "
            "default: off]"
        ),
    )


def tracing_settings(endpoint: str | None, default_service_name: str) -> TracingSettings | None:
    """The settings in force, or None when tracing is off; a bad protocol is a usage error."""
    if not endpoint:
        return None
    protocol = os.environ.get(PROTOCOL_ENV, "grpc").strip() or "grpc"
    if protocol not in PROTOCOLS:
        raise SystemExit(f"{PROTOCOL_ENV}={protocol!r}: must be one of {', '.join(PROTOCOLS)}")
    name = os.environ.get(SERVICE_NAME_ENV) or default_service_name
    return TracingSettings(endpoint, protocol, name)


def start_tracing(settings: TracingSettings, attributes: dict[str, str] | None = None) -> None:
    """Installs the process's tracer provider, exporting in the background in batches.

    Set before anything else sets one (vLLM sets its own when its engine starts, unless one is
    set): vLLM's request spans then go out with this process's name. The name is also put in
    the environment for the processes this one starts (vLLM's engine processes trace their
    own start).
    """
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    os.environ[SERVICE_NAME_ENV] = settings.service_name
    os.environ[ENDPOINT_ENV] = settings.endpoint
    os.environ[PROTOCOL_ENV] = settings.protocol
    # `attributes`: more of the process's resource, on every span (e.g. which frontend it is).
    resource = Resource.create({SERVICE_NAME: settings.service_name, **(attributes or {})})
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(span_exporter(settings)))
    trace.set_tracer_provider(provider)
    logger.info(
        "tracing: sending spans as %s to %s (%s)",
        settings.service_name,
        settings.endpoint,
        settings.protocol,
    )


def span_exporter(settings: TracingSettings) -> SpanExporter:
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=settings.endpoint)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as OTLPHttpSpanExporter,
    )

    return OTLPHttpSpanExporter(endpoint=settings.endpoint)


def flush_tracing() -> None:
    """Sends the spans still waiting (before an exit that skips the interpreter's teardown)."""
    provider = trace.get_tracer_provider()
    force_flush = getattr(provider, "force_flush", None)
    if force_flush is not None:
        force_flush(FLUSH_AT_EXIT_MILLIS)


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


@contextlib.contextmanager
def child_span(name: str, **attributes: AttributeValue) -> Iterator[trace.Span]:
    """A span under the current one, ended with the block (an error in it marks it failed).

    Not made current, so it may span the yields of a generator; what runs under it names it
    as parent explicitly (`outgoing_headers`). Without tracing, a span that records nothing.
    """
    span = tracer().start_span(name, attributes=attributes)
    try:
        yield span
    except Exception as error:
        span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"))
        raise
    finally:
        span.end()


def annotate_call(**attributes: AttributeValue) -> None:
    """Adds attributes to the current call's span (nothing without tracing)."""
    trace.get_current_span().set_attributes(attributes)


def incoming_context(metadata: Iterable[tuple[str, str | bytes]] | None) -> otel_context.Context:
    """The caller's trace context, from gRPC metadata (or HTTP headers)."""
    carrier = {key: value for key, value in metadata or () if isinstance(value, str)}
    return PROPAGATOR.extract(carrier)


def outgoing_headers(span: trace.Span) -> Mapping[str, str]:
    """`traceparent` (and `tracestate`) naming `span` as the parent of what is sent."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return carrier


def trace_id(span: trace.Span) -> str:
    """The span's trace id in hex, as tracing systems show it ("" for no trace)."""
    span_context = span.get_span_context()
    return format(span_context.trace_id, "032x") if span_context.is_valid else ""
