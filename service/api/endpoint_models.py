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
from service.api.tenants import may_use, visible
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
    """The names the caller may use here: the endpoint's when known, else this server's own,
    those its tenant may reach."""
    listing = _listing.get()
    return visible([model.id for model in listing.data] if listing is not None else own)


def visible_listing(listing: ListModelsResponse) -> ListModelsResponse:
    """A listing with only the models the caller's tenant may reach."""
    return ListModelsResponse(
        object=listing.object, data=[model for model in listing.data if may_use(model.id)]
    )


def adapter_for(catalog: ModelCatalog, requested: str) -> LoRARequest | None:
    """The adapter a request for `requested` runs with (None: the base model alone); a name
    this server does not serve, or that the caller's tenant may not reach, is not found (the
    same answer: nobody learns what exists), with the names the caller may use."""
    try:
        if not may_use(requested):
            raise UnknownModelError(requested)
        return catalog.resolve(requested)
    except UnknownModelError:
        raise ModelNotFoundError(requested, served_names(catalog.names)) from None
