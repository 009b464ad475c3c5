"""API-key authentication for completion calls; health and reflection stay open."""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import Message

from service.api.errors import CompletionError
from service.transport.error_mapping import abort_with
from service.transport.interception import StreamBehaviour, StreamInterceptor

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


class ApiKeyInterceptor(StreamInterceptor):
    """Refuses calls that lack `authorization: Bearer <key>`, before any other work."""

    def __init__(self, methods: frozenset[str], api_key: str) -> None:
        super().__init__(methods)
        self._api_key = api_key

    async def around(
        self,
        inner: StreamBehaviour,
        method: str,
        request: Message,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Message]:
        metadata = tuple(context.invocation_metadata() or ())
        if not key_matches(presented_key(metadata), self._api_key):
            await abort_with(
                context,
                UnauthenticatedError(
                    "Missing or wrong API key: send the header `Authorization: Bearer <key>`."
                ),
            )
        async for message in inner(request, context):
            yield message
