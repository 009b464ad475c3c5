"""Keeps each request's JSON objects in their caller's key order: the request's deserializer
also hands its bytes to service.api.caller_order, which reads the objects' order off the wire
(the parsed message keeps them in hash order)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import grpc
from google.protobuf.message import Message

from service.api.caller_order import holds_objects, remember


class KeyOrderInterceptor(grpc.aio.ServerInterceptor):
    """For every method whose request can hold a JSON object. The deserializer runs in the
    call's own task, before its handler, so what it remembers is the call's alone."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        deserializer = getattr(handler, "request_deserializer", None)
        if deserializer is None:
            return handler
        return handler._replace(request_deserializer=remembering(deserializer))  # type: ignore[attr-defined]


def remembering(deserializer: Callable[[bytes], Message]) -> Callable[[bytes], Message]:
    def deserialize(raw: bytes) -> Message:
        message = deserializer(raw)
        if holds_objects(message.DESCRIPTOR):
            remember(raw, message.DESCRIPTOR)
        return message

    return deserialize
