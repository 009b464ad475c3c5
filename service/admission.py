"""Admission control: a bounded number of requests in flight and waiting; the rest are
refused at once, so memory stays bounded whatever the offered load."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import grpc
from prometheus_client import Gauge

from service.errors import CompletionError

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

    @contextlib.asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
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
        try:
            yield
        finally:
            self._slots.release()
