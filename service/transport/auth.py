"""API-key authentication for completion calls; health and reflection stay open.

The key may be several, comma-separated: each is a caller of its own (a principal), named in
the call's record by a digest of its key, so that a caller cancels only its own requests."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import Message

from service.api.errors import CompletionError
from service.transport.error_mapping import abort_with
from service.transport.interception import StreamBehaviour, StreamInterceptor
from service.transport.request_context import current_record

BEARER = "bearer "


class UnauthenticatedError(CompletionError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


def presented_key(metadata: tuple[tuple[str, str | bytes], ...]) -> str | None:
    for key, value in metadata:
        if key == "authorization" and isinstance(value, str) and value.lower().startswith(BEARER):
            return value[len(BEARER) :].strip()
    return None


def principal_of(key: str) -> str:
    """A name for the caller holding `key` that does not reveal it."""
    return "key-" + hashlib.sha256(key.encode()).hexdigest()[:16]


def matching_key(presented: str | None, keys: tuple[str, ...]) -> str | None:
    """The accepted key presented, if any. Every key is compared, each in constant time, so
    that response timing reveals neither how much of a key matched nor which one."""
    if presented is None:
        return None
    found = None
    for key in keys:
        if hmac.compare_digest(presented.encode(), key.encode()):
            found = key
    return found


class ApiKeyInterceptor(StreamInterceptor):
    """Refuses calls that lack `authorization: Bearer <key>` with an accepted key, before any
    other work; records the caller's principal."""

    def __init__(self, methods: frozenset[str], api_key: str) -> None:
        super().__init__(methods)
        self._keys = tuple(key.strip() for key in api_key.split(",") if key.strip())

    async def around(
        self,
        inner: StreamBehaviour,
        method: str,
        request: Message,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Message]:
        metadata = tuple(context.invocation_metadata() or ())
        key = matching_key(presented_key(metadata), self._keys)
        if key is None:
            await abort_with(
                context,
                UnauthenticatedError(
                    "Missing or wrong API key: send the header `Authorization: Bearer <key>`."
                ),
            )
        current_record().principal = principal_of(str(key))
        async for message in inner(request, context):
            yield message
