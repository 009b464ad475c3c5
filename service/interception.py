"""The shape every interceptor of the chain shares: it wraps the behaviour of the
server-streaming methods it is given, around the handler the rest of the chain returns.

The chain (built in `service.server`, outermost first): request context (id, record,
metrics, log line) -> authentication -> admission -> error mapping -> the servicer.
"""

from __future__ import annotations

import functools
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
from google.protobuf.message import Message

StreamBehaviour = Callable[[Message, grpc.aio.ServicerContext], AsyncIterator[Message]]


class StreamInterceptor(grpc.aio.ServerInterceptor):
    """Wraps the server-streaming `methods` (full names, `/package.Service/Method`)."""

    def __init__(self, methods: frozenset[str]) -> None:
        self._methods = methods

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if (
            handler is None
            or handler.unary_stream is None
            or handler_call_details.method not in self._methods
        ):
            return handler
        method = handler_call_details.method.rsplit("/", 1)[-1]
        # A partial of an async generator method is still one to grpc.aio (inspect unwraps
        # it), and costs no extra generator per message.
        wrapped = functools.partial(self.around, handler.unary_stream, method)
        return grpc.unary_stream_rpc_method_handler(
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )

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
