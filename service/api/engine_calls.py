"""What the engine's requests of one call carry beyond their parameters: the call's trace
context (vLLM's request span continues it) and its timings collector.

The completion handler passes both to the engine itself; beam search calls the engine on its
own for every step, so it is given `ObservedEngine`, which adds them from the call's context.
(vLLM's chat serving needs neither: it reads the trace context from the request's headers and
times its requests itself, so it is given the engine as it is.)
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from vllm.outputs import RequestOutput
from vllm.v1.engine.async_llm import AsyncLLM

from service.api.timings import RequestTimings


@dataclass
class EngineCall:
    timings: RequestTimings
    trace_headers: Mapping[str, str] = field(default_factory=dict)


CURRENT_CALL: ContextVar[EngineCall | None] = ContextVar("engine_call", default=None)


class ObservedEngine:
    """The engine, with `generate` carrying the current call's trace context and reporting
    its outputs to the call's timings; everything else is the engine's."""

    def __init__(self, engine: AsyncLLM) -> None:
        self._engine = engine

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[RequestOutput]:
        call = CURRENT_CALL.get()
        if call is not None and call.trace_headers and not kwargs.get("trace_headers"):
            kwargs["trace_headers"] = dict(call.trace_headers)
        # Closed with this generator: vLLM aborts the request when its generator is closed.
        async with contextlib.aclosing(self._engine.generate(*args, **kwargs)) as outputs:
            async for output in outputs:
                if call is not None:
                    call.timings.observe(output)
                yield output
