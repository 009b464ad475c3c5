"""Admission control: a bounded number of requests in flight and waiting; the rest are
refused at once, so memory stays bounded whatever the offered load."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from google.protobuf.message import Message
from prometheus_client import Gauge

from service.api.errors import CompletionError
from service.transport.error_mapping import abort_with
from service.transport.interception import StreamBehaviour, StreamInterceptor

IN_FLIGHT = Gauge("llmcompletions_requests_in_flight", "Admitted requests being served")
WAITING = Gauge("llmcompletions_requests_waiting", "Requests waiting for an admission slot")
RETRY_AFTER_SECONDS = 1


class OverloadedError(CompletionError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("retry-after", str(RETRY_AFTER_SECONDS)),)


class Admission:
    """At most `max_in_flight` requests run; at most `max_waiting` more wait for a turn."""

    def __init__(self, max_in_flight: int, max_waiting: int) -> None:
        self.max_in_flight = max_in_flight
        self.max_waiting = max_waiting
        self._slots = asyncio.Semaphore(max_in_flight)
        self._waiting = 0

    async def enter(self) -> None:
        """Wait for a slot; raise OverloadedError at once when too many already wait."""
        if self._slots.locked() and self._waiting >= self.max_waiting:
            raise OverloadedError(
                f"The server is at capacity ({self.max_in_flight} requests in flight, "
                f"{self.max_waiting} waiting); retry after {RETRY_AFTER_SECONDS}s."
            )
        self._waiting += 1
        WAITING.inc()
        try:
            await self._slots.acquire()
        finally:
            self._waiting -= 1
            WAITING.dec()
        IN_FLIGHT.inc()

    def leave(self) -> None:
        IN_FLIGHT.dec()
        self._slots.release()


class AdmissionInterceptor(StreamInterceptor):
    def __init__(self, methods: frozenset[str], admission: Admission) -> None:
        super().__init__(methods)
        self._admission = admission

    async def around(
        self,
        inner: StreamBehaviour,
        method: str,
        request: Message,
        context: grpc.aio.ServicerContext,
    ) -> AsyncIterator[Message]:
        try:
            await self._admission.enter()
        except OverloadedError as error:
            await abort_with(context, error)
        try:
            async for message in inner(request, context):
                yield message
        finally:
            self._admission.leave()
