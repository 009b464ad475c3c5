"""API-key authentication for completion calls; health and reflection stay open."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc

from service.errors import CompletionError
from service.rest_bridge import error_metadata, rest_call

BEARER = "bearer "


class UnauthenticatedError(CompletionError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


def presented_key(metadata: tuple[tuple[str, str | bytes], ...]) -> str | None:
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str) and value.lower().startswith(BEARER):
            return value[len(BEARER) :].strip()
    return None


def key_matches(presented: str | None, expected: str) -> bool:
    # Constant time, so that response timing does not reveal how much of a key matched.
    return presented is not None and hmac.compare_digest(presented.encode(), expected.encode())


class ApiKeyInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls to `protected` methods that lack `authorization: Bearer <key>`."""

    def __init__(self, api_key: str, protected: frozenset[str]) -> None:
        self._api_key = api_key
        self._protected = protected

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if handler_call_details.method not in self._protected:
            return await continuation(handler_call_details)
        metadata = tuple(handler_call_details.invocation_metadata or ())
        if key_matches(presented_key(metadata), self._api_key):
            return await continuation(handler_call_details)
        return grpc.unary_stream_rpc_method_handler(refusal(rest_call(metadata) is not None))


def refusal(transcoded: bool) -> Callable[[object, grpc.aio.ServicerContext], AsyncIterator[None]]:
    error = UnauthenticatedError(
        "Missing or wrong API key: send the header `Authorization: Bearer <key>`."
    )

    async def refuse(_: object, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        metadata = error_metadata(error) if transcoded else ()
        await context.abort(error.grpc_code, error.message, trailing_metadata=metadata)
        yield None  # makes this an async generator, as a server-streaming handler must be

    return refuse
