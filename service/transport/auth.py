"""API-key authentication for completion calls; health and reflection stay open.

A tenant's key (the tenants file, service.api.tenants) makes the tenant the caller: every key
of a tenant is one principal (its requests are cancelled by any of its keys), and the call may
reach only the tenant's models. An API_KEY key is a caller of its own (a principal named by a
digest of the key) that may reach every model; with both set, both kinds of key are taken."""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import Message

from service.api.batch.runner import Owner
from service.api.errors import CompletionError
from service.api.tenants import Caller, bind_caller, unbind_caller
from service.settings import ServerSettings
from service.transport.error_mapping import abort_with
from service.transport.interception import StreamBehaviour, StreamInterceptor
from service.transport.observability import AUTH_FAILURES
from service.transport.request_context import current_record
from service.transport.tenants_file import TenantsFile

BEARER = "bearer "
BASIC = "basic "
API_KEY_HEADER = "x-api-key"


class UnauthenticatedError(CompletionError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED


class NotOperatorError(CompletionError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED


def split_keys(keys: str | None) -> tuple[str, ...]:
    return tuple(key.strip() for key in (keys or "").split(",") if key.strip())


def presented_key(metadata: tuple[tuple[str, str | bytes], ...]) -> str | None:
    """The key a call presents: `Authorization: Bearer <key>`, or as LLM Engine's clients
    send it, `Authorization: Basic base64(<key>:)` (the key as the user name) or
    `x-api-key: <key>`."""
    for key, value in metadata:
        if key != "authorization" or not isinstance(value, str):
            continue
        if value.lower().startswith(BEARER):
            return value[len(BEARER) :].strip()
        if value.lower().startswith(BASIC):
            return basic_user(value[len(BASIC) :].strip())
    api_key = next((value for key, value in metadata if key == API_KEY_HEADER), None)
    return api_key.strip() if isinstance(api_key, str) and api_key.strip() else None


def basic_user(credentials: str) -> str | None:
    """The user name of HTTP basic credentials (LLM Engine's key), else None."""
    try:
        decoded = base64.b64decode(credentials, validate=True).decode()
    except (binascii.Error, UnicodeDecodeError):
        return None
    user = decoded.partition(":")[0].strip()
    return user or None


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
        record = current_record()
        owner = record.line_owner  # read off the metadata with the record
        if owner is not None:  # a batch job's line, run for the job's owner
            caller = await self.owners_caller(owner, context)
            record.principal, record.tenant, record.key_id = (
                owner.principal,
                owner.tenant,
                owner.key_id,
            )
            async for message in self.as_caller(caller, inner, request, context):
                yield message
            return
        presented = presented_key(metadata)
        caller = None if self._tenants is None else self._tenants.table.find(presented)
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
        async for message in self.as_caller(caller, inner, request, context):
            yield message

    async def as_caller(
        self,
        caller: Caller | None,
        inner: StreamBehaviour,
        request: Message,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Message]:
        token = bind_caller(caller)
        try:
            async for message in inner(request, context):
                yield message
        finally:
            unbind_caller(token)

    async def owners_caller(self, owner: Owner, context: grpc.aio.ServicerContext) -> Caller | None:
        """The tenant a job's owner called as (its key, else another key of the tenant)."""
        if not owner.tenant:
            return None
        caller = (
            None if self._tenants is None else self._tenants.table.of(owner.tenant, owner.key_id)
        )
        if caller is None:
            await abort_with(
                context,
                UnauthenticatedError(
                    f"the job's tenant {owner.tenant!r} is no longer in the tenants file"
                ),
            )
        return caller


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
