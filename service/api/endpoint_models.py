"""The models of the whole endpoint when this replica is one of several pools behind the
facade: with the calls that no single pool owns (ListModels, and a name no pool serves), Envoy
passes the listing of every pool's models (the transport binds it to the call), which this
replica then answers from; and a request's `model` resolved to what runs it."""

from __future__ import annotations

import contextvars
from collections.abc import Sequence

from llmcompletions.v2.completions_pb2 import ListModelsResponse
from vllm.lora.request import LoRARequest

from service.api.cancellation import CancellableCall
from service.api.errors import (
    AdapterCallError,
    AdapterCapacityCallError,
    AdapterForbiddenCallError,
    AdapterInvalidCallError,
    AdapterNameTakenCallError,
    AdapterNotFoundCallError,
    AdapterPreconditionCallError,
    ModelNotFoundError,
)
from service.api.tenants import may_use, visible
from service.model.adapter_checks import (
    AdapterError,
    AdapterInvalidError,
    AdapterNameTakenError,
    AdapterNotFoundError,
)
from service.model.adapter_registry import (
    AdapterCapacityError,
    AdapterFromRootError,
    AdapterOutsideRootError,
    AdapterRegistry,
)
from service.model.adapters import UnknownModelError

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


def check_served(adapters: AdapterRegistry, requested: str) -> None:
    """A name this server does not serve, or that the caller's tenant may not reach, is not
    found (the same answer: nobody learns what exists), with the names the caller may use."""
    if not may_use(requested) or not adapters.serves(requested):
        raise ModelNotFoundError(requested, served_names(adapters.names))


async def adapter_for_call(
    adapters: AdapterRegistry, requested: str, call: CancellableCall
) -> LoRARequest | None:
    """The adapter the call runs with (None: the base model alone), held by the call until it
    ends (an unload waits for it), loaded into the engine if it was not."""
    check_served(adapters, requested)
    try:
        lease = await adapters.acquire(requested, call.end_with_reason)
    except UnknownModelError:
        raise ModelNotFoundError(requested, served_names(adapters.names)) from None
    except AdapterError as error:
        raise adapter_call_error(error) from None
    call.hold(lease)
    return lease.request


def adapter_call_error(error: AdapterError) -> AdapterCallError:
    """The status an adapter's problem answers with."""
    for model_error, call_error in ADAPTER_ERRORS:
        if isinstance(error, model_error):
            return call_error(str(error))
    return AdapterInvalidCallError(str(error))


ADAPTER_ERRORS: tuple[tuple[type[AdapterError], type[AdapterCallError]], ...] = (
    (AdapterNotFoundError, AdapterNotFoundCallError),
    (AdapterInvalidError, AdapterInvalidCallError),
    (AdapterNameTakenError, AdapterNameTakenCallError),
    (AdapterOutsideRootError, AdapterForbiddenCallError),
    (AdapterCapacityError, AdapterCapacityCallError),
    (AdapterFromRootError, AdapterPreconditionCallError),
)
