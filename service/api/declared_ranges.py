"""The allowed range of each numeric request field, read from the proto's `allowed` option:
the one source of these numbers. Light to import (no vLLM), so that the command line can use
them before it decides to start an engine."""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.descriptor import Descriptor
from llmcompletions.v2 import completions_pb2
from llmcompletions.v2.completions_pb2 import CreateCompletionRequest


@dataclass(frozen=True)
class Bound:
    value: float
    inclusive: bool = True


Range = tuple[Bound | None, Bound | None]  # None: unbounded on that side


def declared_ranges(message: Descriptor = CreateCompletionRequest.DESCRIPTOR) -> dict[str, Range]:
    """The allowed range of each numeric request field, as the proto declares it (its
    `allowed` option): the one source of these numbers."""
    ranges: dict[str, Range] = {}
    for field in message.fields:
        options = field.GetOptions()
        if not options.HasExtension(completions_pb2.allowed):
            continue
        allowed = options.Extensions[completions_pb2.allowed]
        low = Bound(allowed.min, not allowed.min_exclusive) if allowed.HasField("min") else None
        high = Bound(allowed.max, not allowed.max_exclusive) if allowed.HasField("max") else None
        ranges[field.name] = (low, high)
    return ranges


DECLARED_RANGES = declared_ranges()
MAX_BEST_OF = int(DECLARED_RANGES["best_of"][1].value)  # type: ignore[union-attr]
# The log-probabilities per step the engine must allow: beam search asks each step for
# 2 x width of them (vLLM's default cap is 20).
ENGINE_MAX_LOGPROBS = 2 * MAX_BEST_OF
