"""The models of the whole endpoint when this replica is one of several pools behind the
facade: with the calls that no single pool owns (ListModels, and a name no pool serves),
Envoy passes the listing of every pool's models, which this replica then answers from."""

from __future__ import annotations

import contextvars
from collections.abc import Sequence

import grpc
from google.protobuf.message import DecodeError
from llmcompletions.v2.completions_pb2 import ListModelsResponse

# Binary gRPC metadata: Envoy sends it base64-encoded, a replica receives the bytes.
ENDPOINT_MODELS_HEADER = "x-endpoint-models-bin"

_listing: contextvars.ContextVar[ListModelsResponse | None] = contextvars.ContextVar(
    "endpoint_models", default=None
)


def passed_listing(context: grpc.aio.ServicerContext) -> ListModelsResponse | None:
    for key, value in context.invocation_metadata() or ():
        if key == ENDPOINT_MODELS_HEADER and isinstance(value, bytes):
            try:
                return ListModelsResponse.FromString(value)
            except DecodeError:
                return None
    return None


def bind(context: grpc.aio.ServicerContext) -> contextvars.Token[ListModelsResponse | None]:
    """Makes the call's listing (if the facade passed one) the endpoint's for this call."""
    return _listing.set(passed_listing(context))


def unbind(token: contextvars.Token[ListModelsResponse | None]) -> None:
    _listing.reset(token)


def endpoint_listing() -> ListModelsResponse | None:
    """Every pool's models, when the facade passed them with this call."""
    return _listing.get()


def served_names(own: Sequence[str]) -> list[str]:
    """The names a caller may use here: the endpoint's when known, else this server's own."""
    listing = _listing.get()
    return [model.id for model in listing.data] if listing is not None else list(own)
