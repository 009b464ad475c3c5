"""Test-only fault injection, off unless the server runs with --enable-fault-injection.

A request carrying the metadata `x-inject-fault: engine-error-after=N` has its engine output
stream fail after N outputs, as an engine failure in the middle of a stream would. The real
engine cannot be made to fail on demand; everything after the failure point is real.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import TypeVar

import grpc
from vllm.v1.engine.exceptions import EngineGenerateError

FAULT_HEADER = "x-inject-fault"
ENGINE_ERROR_AFTER = re.compile(r"^engine-error-after=(\d{1,6})$")

T = TypeVar("T")


def requested_fault(context: grpc.aio.ServicerContext) -> int | None:
    """N from `x-inject-fault: engine-error-after=N`, if the request carries it."""
    for key, value in context.invocation_metadata() or ():
        if key == FAULT_HEADER and isinstance(value, str):
            match = ENGINE_ERROR_AFTER.match(value)
            if match:
                return int(match.group(1))
    return None


async def failing_after(outputs: AsyncIterator[T], count: int) -> AsyncIterator[T]:
    seen = 0
    async for item in outputs:
        if seen == count:
            raise EngineGenerateError("injected engine failure")
        seen += 1
        yield item
