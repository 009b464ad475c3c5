"""The shape every interceptor of the chain shares: it wraps the behaviour of the methods it
is given, around the handler the rest of the chain returns. Each interceptor is written once,
for server-streaming calls; a unary call runs through it as a stream of one message.

The chain (built in `service.transport.server`, outermost first): request context (id, record,
metrics, log line) -> authentication -> error mapping -> the servicer.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import Message

StreamBehaviour = Callable[[Message, grpc.aio.ServicerContext], AsyncIterator[Message]]
UnaryBehaviour = Callable[[Message, grpc.aio.ServicerContext], Awaitable[Message]]


class StreamInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the `methods` (full names, `/package.Service/Method`)."""

    def __init__(self, methods: frozenset[str]) -> None:
        self._methods = methods

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method not in self._methods:
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        codec = {
            "request_deserializer": handler.request_deserializer,
            "response_serializer": handler.response_serializer,
        }
        if handler.unary_stream is not None:
            # A partial of an async generator method is still one to grpc.aio (inspect unwraps
            # it), and costs no extra generator per message.
            streamed = functools.partial(self.around, handler.unary_stream, method)
            return grpc.unary_stream_rpc_method_handler(streamed, **codec)
        if handler.unary_unary is not None:
            unary = functools.partial(self.around_unary, handler.unary_unary, method)
            return grpc.unary_unary_rpc_method_handler(unary, **codec)
        return handler

    async def around_unary(
        self,
        inner: UnaryBehaviour,
        method: str,
        request: Message,
        context: grpc.aio.ServicerContext,
    ) -> Message | None:
        async def as_stream(
            request: Message, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Message]:
            yield await inner(request, context)

        reply = None
        async for message in self.around(as_stream, method, request, context):
            reply = message
        return reply

    def around(
        self,
        inner: StreamBehaviour,
        method: str,
        request: Message,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Message]:
        """The wrapped behaviour of `method` (its short name, e.g. CreateCompletion): an async
        generator that runs `inner(request, context)` somewhere inside."""
        raise NotImplementedError
