"""The endpoint picker protocol of the Gateway API Inference Extension (its proposal 004), as
the picker speaks it over Envoy's external processing (ext_proc), and what the picker reads
from the replies.

Gateway -> picker, with a request's headers: optionally, in the metadata namespace
`envoy.lb.subset_hint`, `x-gateway-destination-endpoint-subset`: the endpoints (ip:port) the
pick must come from.
Picker -> gateway: the endpoints to try, first choice first, comma-separated, in the header
`x-gateway-destination-endpoint` and, with the same value, in dynamic metadata `envoy.lb`; or
an immediate 503 when no endpoint is ready (or none of the subset), 429 when the request is shed.
Gateway -> picker, with the response: in metadata `envoy.lb`,
`x-gateway-destination-endpoint-served`: the endpoint that served it (after any retries).

Our Envoy also forwards, for the picker alone, the prompt's path (facade/routing.lua), a
cancel's request id, the request's x-request-id and the reply's ORCA load report trailer.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Iterable

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as ext_proc
from envoy.type.v3 import http_status_pb2
from google.protobuf.message import DecodeError
from google.rpc import code_pb2
from xds.data.orca.v3.orca_load_report_pb2 import OrcaLoadReport

DESTINATION_HEADER = "x-gateway-destination-endpoint"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
SUBSET_KEY = "x-gateway-destination-endpoint-subset"
SERVED_KEY = "x-gateway-destination-endpoint-served"
LOAD_REPORT_TRAILER = "endpoint-load-metrics-bin"  # ORCA, binary (service.transport.load_reports)
REQUEST_ID_HEADER = "x-request-id"
# A CancelCompletion's request id, set by facade/routing.lua from the request message.
CANCEL_HEADER = "x-cancel-request-id"
RETRY_AFTER_SECONDS = 1

HeaderList = Iterable[base_pb2.HeaderValue]


def header_value(headers: HeaderList, name: str) -> str | None:
    for header in headers:
        if header.key == name:
            return header.raw_value.decode() if header.raw_value else header.value
    return None


def subset_hint(request: ext_proc.ProcessingRequest) -> set[str] | None:
    """The endpoints the gateway allows, or None if it set no hint. A list, or one string of
    comma-separated endpoints (what a header-to-metadata filter makes)."""
    namespaces = request.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in namespaces:
        return None
    fields = namespaces[SUBSET_NAMESPACE].fields
    if SUBSET_KEY not in fields:
        return None
    value = fields[SUBSET_KEY]
    if value.WhichOneof("kind") == "list_value":
        items = [item.string_value for item in value.list_value.values]
    else:
        items = value.string_value.split(",")
    return {item.strip() for item in items if item.strip()}


def served_endpoint(request: ext_proc.ProcessingRequest) -> str | None:
    namespaces = request.metadata_context.filter_metadata
    if LB_NAMESPACE not in namespaces:
        return None
    value = namespaces[LB_NAMESPACE].fields.get(SERVED_KEY)
    return value.string_value or None if value is not None else None


def destination_response(endpoints: list[str]) -> ext_proc.ProcessingResponse:
    """The request goes on to `endpoints` (first choice first), named in the header and the
    metadata alike."""
    value = ",".join(endpoints)
    response = ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())
    response.request_headers.response.header_mutation.set_headers.append(
        base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=DESTINATION_HEADER, raw_value=value.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD,
        )
    )
    response.dynamic_metadata.update({LB_NAMESPACE: {DESTINATION_HEADER: value}})
    return response


def unpicked_response() -> ext_proc.ProcessingResponse:
    """The request goes on without a pick (Envoy balances it itself)."""
    return ext_proc.ProcessingResponse(request_headers=ext_proc.HeadersResponse())


def immediate(
    http_code: int, grpc_code: int, message: str, headers: dict[str, str] | None = None
) -> ext_proc.ProcessingResponse:
    """The request ends here: `http_code` for HTTP callers, `grpc_code` for gRPC ones."""
    reply = ext_proc.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=http_code),
        body=message.encode(),
        grpc_status=ext_proc.GrpcStatus(status=grpc_code),
        details=message,
    )
    for name, value in (headers or {}).items():
        reply.headers.set_headers.append(
            base_pb2.HeaderValueOption(
                header=base_pb2.HeaderValue(key=name, raw_value=value.encode())
            )
        )
    return ext_proc.ProcessingResponse(immediate_response=reply)


def no_ready_endpoint(why: str) -> ext_proc.ProcessingResponse:
    return immediate(503, code_pb2.UNAVAILABLE, why)


def shed(why: str) -> ext_proc.ProcessingResponse:
    return immediate(
        429, code_pb2.RESOURCE_EXHAUSTED, why, {"retry-after": str(RETRY_AFTER_SECONDS)}
    )


CONTINUE_RESPONSE_HEADERS = ext_proc.ProcessingResponse(response_headers=ext_proc.HeadersResponse())
CONTINUE_TRAILERS = ext_proc.ProcessingResponse(response_trailers=ext_proc.TrailersResponse())


def load_report(headers: HeaderList) -> OrcaLoadReport | None:
    """The ORCA report a reply's trailers carry, if any (a -bin header's value is base64 in
    HTTP/2, as Envoy passes it on)."""
    value = header_value(headers, LOAD_REPORT_TRAILER)
    if not value:
        return None
    try:
        return OrcaLoadReport.FromString(
            base64.b64decode(value + "=" * (-len(value) % 4), validate=True)
        )
    except (binascii.Error, DecodeError):
        return None
