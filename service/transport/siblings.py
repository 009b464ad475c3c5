"""Calls that concern every frontend of one replica: cancel by request id, and the operator's
adapter loads and unloads.

A call runs in the frontend its connection reached, and only that frontend can end it (an
abort in the engine core alone would leave the caller's stream hanging). So a frontend that
does not hold the id asks its siblings, over their local sockets, with the caller's own
credentials: each one decides as for a cancel sent to it directly. A load or unload is done by
the frontend it reached, then by each sibling (each holds its own table of adapters over the
one engine). A forwarded call carries FORWARDED_HEADER and is not forwarded again.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import grpc
from google.protobuf.message import Message
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CancelCompletionRequest, CancelCompletionResponse

FORWARDED_HEADER = "x-llm-completions-forwarded"
FORWARD_TIMEOUT_SECONDS = 5.0
# Headers the sibling needs to decide as this frontend would: the caller's key and request id.
PASSED_HEADERS = ("authorization", "x-request-id")


def is_forwarded(metadata: Sequence[tuple[str, str | bytes]]) -> bool:
    return any(key == FORWARDED_HEADER for key, _ in metadata)


class Siblings:
    """The other frontends of this replica, reached over their unix sockets."""

    def __init__(self, sockets: Sequence[str]) -> None:
        self.channels = [grpc.aio.insecure_channel(f"unix:{path}") for path in sockets]

    async def cancel(
        self, request: CancelCompletionRequest, metadata: Sequence[tuple[str, str | bytes]]
    ) -> tuple[list[CancelCompletionResponse], list[grpc.StatusCode]]:
        """Each sibling's answer: the cancels that succeeded, and the other codes."""
        passed = forwarded_metadata(metadata, "cancel")
        answers = await asyncio.gather(
            *(self.ask(channel, request, passed) for channel in self.channels)
        )
        done = [answer for answer in answers if isinstance(answer, CancelCompletionResponse)]
        codes = [answer for answer in answers if isinstance(answer, grpc.StatusCode)]
        return done, codes

    @staticmethod
    async def ask(
        channel: grpc.aio.Channel,
        request: CancelCompletionRequest,
        metadata: Sequence[tuple[str, str | bytes]],
    ) -> CancelCompletionResponse | grpc.StatusCode:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        try:
            reply: CancelCompletionResponse = await stub.CancelCompletion(
                request, metadata=tuple(metadata), timeout=FORWARD_TIMEOUT_SECONDS
            )
        except grpc.aio.AioRpcError as error:
            return error.code()
        return reply

    async def each(
        self,
        method: str,
        request: Message,
        metadata: Sequence[tuple[str, str | bytes]],
        timeout: float,
    ) -> list[grpc.aio.AioRpcError]:
        """Makes the call `method` on every sibling; the errors they answered with."""
        passed = forwarded_metadata(metadata, method)
        answers = await asyncio.gather(
            *(self.call(channel, method, request, passed, timeout) for channel in self.channels)
        )
        return [answer for answer in answers if answer is not None]

    @staticmethod
    async def call(
        channel: grpc.aio.Channel,
        method: str,
        request: Message,
        metadata: Sequence[tuple[str, str | bytes]],
        timeout: float,
    ) -> grpc.aio.AioRpcError | None:
        stub = completions_pb2_grpc.CompletionServiceStub(channel)
        try:
            await getattr(stub, method)(request, metadata=tuple(metadata), timeout=timeout)
        except grpc.aio.AioRpcError as error:
            return error
        return None


def forwarded_metadata(
    metadata: Sequence[tuple[str, str | bytes]], what: str
) -> list[tuple[str, str | bytes]]:
    passed = [(key, value) for key, value in metadata if key in PASSED_HEADERS]
    passed.append((FORWARDED_HEADER, what))
    return passed
