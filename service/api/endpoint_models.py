"""The models of the whole endpoint when this replica is one of several pools behind the
facade: with the calls that no single pool owns (ListModels, and a name no pool serves), Envoy
passes the listing of every pool's models (the transport binds it to the call), which this
replica then answers from; and a request's `model` resolved to what runs it."""

from __future__ import annotations

import contextvars
from collections.abc import Sequence

from llmcompletions.v2.completions_pb2 import ListModelsResponse
from vllm.lora.request import LoRARequest

from service.api.errors import ModelNotFoundError
from service.model.adapters import ModelCatalog, UnknownModelError

_listing: contextvars.ContextVar[ListModelsResponse | None] = contextvars.ContextVar(
    "endpoint_models", default=None
)


def bind(listing: ListModelsResponse | None) -> contextvars.Token[ListModelsResponse | None]:
    """Makes `listing` (if the facade passed one) the endpoint's for the current call."""
    return _listing.set(listing)


def unbind(token: contextvars.Token[ListModelsResponse | None]) -> None:
    _listing.reset(token)


def endpoint_listing() -> ListModelsResponse | None:
    """Every pool's models, when the facade passed them with this call."""
    return _listing.get()


def served_names(own: Sequence[str]) -> list[str]:
    """The names a caller may use here: the endpoint's when known, else this server's own."""
    listing = _listing.get()
    return [model.id for model in listing.data] if listing is not None else list(own)


def adapter_for(catalog: ModelCatalog, requested: str) -> LoRARequest | None:
    """The adapter a request for `requested` runs with (None: the base model alone); a name
    this server does not serve is not found, with the endpoint's names in the message."""
    try:
        return catalog.resolve(requested)
    except UnknownModelError:
        raise ModelNotFoundError(requested, served_names(catalog.names)) from None
