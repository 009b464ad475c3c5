"""An OTLP/gRPC trace receiver for the tests: a real endpoint of the protocol (the collector
service opentelemetry-proto generates), keeping every span it is sent."""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

SERVER_KIND = 2  # opentelemetry.proto.trace.v1.Span.SPAN_KIND_SERVER


@dataclass(frozen=True)
class ReceivedSpan:
    name: str
    service: str  # the resource's service.name
    trace_id: str
    span_id: str
    parent_id: str  # "" for a trace's root
    kind: int
    start_ns: int
    end_ns: int
    attributes: dict[str, Any]
    status: int  # 0 unset, 1 ok, 2 error
    resource: dict[str, Any] = field(hash=False, compare=False)


def value_of(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    return None if kind is None else getattr(value, kind)


class TraceCollector(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self.lock = threading.Lock()

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received = list(spans_of(request))
        with self.lock:
            self.spans.extend(received)
        return trace_service_pb2.ExportTraceServiceResponse()


def spans_of(request: trace_service_pb2.ExportTraceServiceRequest) -> Iterator[ReceivedSpan]:
    for resource_spans in request.resource_spans:
        resource = {kv.key: value_of(kv.value) for kv in resource_spans.resource.attributes}
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield ReceivedSpan(
                    name=span.name,
                    service=str(resource.get("service.name", "")),
                    trace_id=span.trace_id.hex(),
                    span_id=span.span_id.hex(),
                    parent_id=span.parent_span_id.hex(),
                    kind=span.kind,
                    start_ns=span.start_time_unix_nano,
                    end_ns=span.end_time_unix_nano,
                    attributes={kv.key: value_of(kv.value) for kv in span.attributes},
                    status=span.status.code,
                    resource=resource,
                )


class OtlpReceiver:
    """Listens on 127.0.0.1:`port` (0: any free port) until stopped."""

    def __init__(self, port: int = 0) -> None:
        self.collector = TraceCollector()
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self.collector, self.server)
        self.port = self.server.add_insecure_port(f"127.0.0.1:{port}")
        self.server.start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        self.server.stop(grace=None)

    def spans(self, trace_id: str | None = None) -> list[ReceivedSpan]:
        with self.collector.lock:
            return [s for s in self.collector.spans if trace_id in (None, s.trace_id)]

    def wait_for(
        self, trace_id: str, complete: Callable[[list[ReceivedSpan]], bool], timeout: float = 20
    ) -> list[ReceivedSpan]:
        """The trace's spans once `complete` says they all came (each process sends its own
        in batches, every second or so)."""
        deadline = time.monotonic() + timeout
        while not complete(spans := self.spans(trace_id)):
            if time.monotonic() > deadline:
                names = sorted(f"{s.service}:{s.name}" for s in spans)
                raise AssertionError(f"trace {trace_id} incomplete after {timeout:.0f}s: {names}")
            time.sleep(0.2)
        return spans


def named(spans: list[ReceivedSpan], name: str) -> ReceivedSpan:
    (found,) = [s for s in spans if s.name == name]
    return found


def children(spans: list[ReceivedSpan], parent: ReceivedSpan) -> list[ReceivedSpan]:
    return [s for s in spans if s.parent_id == parent.span_id]


def caller_context() -> tuple[str, str, str]:
    """A caller's trace id, span id and the `traceparent` naming them (sampled)."""
    trace_id, span_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    return trace_id, span_id, f"00-{trace_id}-{span_id}-01"
