"""API-key authentication for completion calls; health and reflection stay open.

A tenant's key (the tenants file, service.api.tenants) makes the tenant the caller: every key
of a tenant is one principal (its requests are cancelled by any of its keys), and the call may
reach only the tenant's models. An API_KEY key is a caller of its own (a principal named by a
digest of the key) that may reach every model; with both set, both kinds of key are taken."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import Message

from service.api.errors import CompletionError
from service.api.tenants import bind_caller, unbind_caller
from service.settings import ServerSettings
from service.transport.error_mapping import abort_with
from service.transport.interception import StreamBehaviour, StreamInterceptor
from service.transport.observability import AUTH_FAILURES
from service.transport.request_context import current_record
from service.transport.tenants_file import TenantsFile

BEARER = "bearer "


class UnauthenticatedError(CompletionError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class NotOperatorError(CompletionError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED


def split_keys(keys: str | None) -> tuple[str, ...]:
    return tuple(key.strip() for key in (keys or "").split(",") if key.strip())


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

    def __init__(
        self, methods: frozenset[str], api_key: str | None, tenants: TenantsFile | None = None
    ) -> None:
        super().__init__(methods)
        self._keys = split_keys(api_key)
        self._tenants = tenants

    async def around(
        self,
        inner: StreamBehaviour,
        method: str,
        request: Message,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Message]:
        metadata = tuple(context.invocation_metadata() or ())
        presented = presented_key(metadata)
        caller = None if self._tenants is None else self._tenants.table.find(presented)
        record = current_record()
        if caller is not None:
            record.principal = f"tenant-{caller.tenant}"
            record.tenant, record.key_id = caller.tenant, caller.key_id
        else:
            key = matching_key(presented, self._keys)
            if key is None:
                AUTH_FAILURES.labels("missing" if presented is None else "unknown").inc()
                await abort_with(
                    context,
                    UnauthenticatedError(
                        "Missing or wrong API key: send the header `Authorization: Bearer <key>`."
                    ),
                )
            record.principal = principal_of(str(key))
        token = bind_caller(caller)
        try:
            async for message in inner(request, context):
                yield message
        finally:
            unbind_caller(token)


class OperatorKeyInterceptor(StreamInterceptor):
    """Lets only an operator key (--operator-api-key, or a tenant marked `operator: true`)
    make the operator's calls (loading and unloading adapters): a caller's key is refused with
    PERMISSION_DENIED, whether or not callers need keys; no key or an unknown one with
    UNAUTHENTICATED."""

    def __init__(
        self, methods: frozenset[str], settings: ServerSettings, tenants: TenantsFile | None
    ) -> None:
        super().__init__(methods)
        self._operator_keys = split_keys(settings.operator_api_key)
        self._caller_keys = split_keys(settings.api_key)
        self._tenants = tenants

    async def around(
        self,
        inner: StreamBehaviour,
        method: str,
        request: Message,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Message]:
        presented = presented_key(tuple(context.invocation_metadata() or ()))
        caller = None if self._tenants is None else self._tenants.table.find(presented)
        record = current_record()
        if caller is not None and caller.operator:
            record.principal = f"tenant-{caller.tenant}"
            record.tenant, record.key_id = caller.tenant, caller.key_id
        elif (key := matching_key(presented, self._operator_keys)) is not None:
            record.principal = "operator-" + principal_of(key)
        elif caller is not None or matching_key(presented, self._caller_keys) is not None:
            AUTH_FAILURES.labels("not_operator").inc()
            await abort_with(
                context,
                NotOperatorError("Only the operator key may load or unload adapters."),
            )
        else:
            AUTH_FAILURES.labels("missing" if presented is None else "unknown").inc()
            await abort_with(
                context,
                UnauthenticatedError(
                    "Loading and unloading adapters needs the operator key: send "
                    "`Authorization: Bearer <key>` with a key of --operator-api-key."
                ),
            )
        async for message in inner(request, context):
            yield message
