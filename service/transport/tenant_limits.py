"""Tenants' limits on the wire: a tenant's completion and chat calls are counted against its
limits before any work (refused with RESOURCE_EXHAUSTED, 429, and `retry-after`), replies carry
OpenAI's rate-limit headers, a call's prompt tokens are charged as soon as it is tokenized
(RequestRecord.tokenized), and the rest of its tokens when it ends, however it ends.
service.api.rate_limits keeps the windows."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import Message

from service.api.rate_limits import TenantLimits
from service.api.tenants import current_caller
from service.transport.interception import StreamBehaviour, StreamInterceptor
from service.transport.request_context import current_record


class TenantLimitsInterceptor(StreamInterceptor):
    def __init__(self, methods: frozenset[str], limits: TenantLimits) -> None:
        super().__init__(methods)
        self.limits = limits

    async def around(
        self,
        inner: StreamBehaviour,
        method: str,
        request: Message,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Message]:
        caller = current_caller()
        if caller is None or (caller.limits.rpm is None and caller.limits.tpm is None):
            async for message in inner(request, context):
                yield message
            return
        record = current_record()
        windows = await self.limits.admit(caller)
        record.reply_headers += tuple(header for window in windows for header in window.headers())
        charged = 0

        def charge_prompt(prompt_tokens: int) -> None:
            nonlocal charged
            self.limits.charge(caller, prompt_tokens)
            charged += prompt_tokens

        record.on_tokenized = charge_prompt
        try:
            async for message in inner(request, context):
                yield message
        finally:
            record.on_tokenized = None
            used = record.prompt_tokens + record.completion_tokens
            self.limits.charge(caller, used - charged)
