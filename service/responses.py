"""Assembly of CompletionResponse messages (whole responses, stream chunks) from engine outputs."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field

from llmcompletions.v2.completions_pb2 import (
    Choice,
    CompletionResponse,
    StreamError,
    StreamErrorContent,
    Usage,
)
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams

from service.errors import CompletionError, utc_timestamp
from service.prompts import PreparedPrompt

OBJECT_TYPE = "text_completion"


@dataclass(frozen=True)
class ResponseHeader:
    """The fields every message of one completion shares."""

    id: str
    created: int
    model: str
    system_fingerprint: str

    @classmethod
    def new(cls, model: str, system_fingerprint: str) -> ResponseHeader:
        return cls(f"cmpl-{uuid.uuid4().hex}", int(time.time()), model, system_fingerprint)

    def message(
        self, choices: Sequence[Choice] = (), usage: Usage | None = None
    ) -> CompletionResponse:
        return CompletionResponse(
            id=self.id,
            object=OBJECT_TYPE,
            created=self.created,
            model=self.model,
            choices=choices,
            usage=usage,
            system_fingerprint=self.system_fingerprint,
        )


@dataclass(frozen=True)
class EngineSlot:
    """One engine request of a completion: which prompt, and which of its choices it makes
    (`first_choice` onwards, one per sequence)."""

    prompt_index: int
    first_choice: int
    request_id: str
    params: SamplingParams


@dataclass(frozen=True)
class ChoicePlan:
    """How outputs become choices: `n` per prompt, echo, and whether generated text is kept."""

    prompts: list[PreparedPrompt]
    n: int
    echo: bool
    keep_generated: bool  # False for max_tokens 0: the engine's one token is dropped

    def index(self, slot: EngineSlot, output: CompletionOutput) -> int:
        return slot.prompt_index * self.n + slot.first_choice + output.index

    def echoed(self, slot: EngineSlot) -> str:
        return self.prompts[slot.prompt_index].text if self.echo else ""

    def prompt_tokens(self) -> int:
        return sum(len(prompt.token_ids) for prompt in self.prompts)

    def generated(self, output: CompletionOutput) -> tuple[str, int]:
        """The output's text and token count as the caller sees them."""
        if not self.keep_generated:
            return "", 0
        return output.text, len(output.token_ids)

    def finish_reason(self, output: CompletionOutput) -> str | None:
        if not self.keep_generated:
            return "length"
        return output.finish_reason


def usage(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def whole_response(
    header: ResponseHeader,
    plan: ChoicePlan,
    results: Sequence[tuple[EngineSlot, RequestOutput]],
) -> CompletionResponse:
    """The one message of a non-streamed completion, from each engine request's final output."""
    choices: list[Choice] = []
    completion_tokens = 0
    for slot, result in results:
        for output in result.outputs:
            text, token_count = plan.generated(output)
            completion_tokens += token_count
            choices.append(
                Choice(
                    index=plan.index(slot, output),
                    text=plan.echoed(slot) + text,
                    finish_reason=plan.finish_reason(output),
                )
            )
    choices.sort(key=lambda choice: choice.index)
    return header.message(choices, usage(plan.prompt_tokens(), completion_tokens))


@dataclass
class StreamAssembler:
    """Turns delta outputs into stream chunks, one per choice delta, and counts usage."""

    header: ResponseHeader
    plan: ChoicePlan
    echo_sent: set[int] = field(default_factory=set)
    completion_tokens: int = 0

    def chunks(self, slot: EngineSlot, result: RequestOutput) -> list[CompletionResponse]:
        return [
            chunk for output in result.outputs if (chunk := self.chunk(slot, output)) is not None
        ]

    def chunk(self, slot: EngineSlot, output: CompletionOutput) -> CompletionResponse | None:
        index = self.plan.index(slot, output)
        text, token_count = self.plan.generated(output)
        finish_reason = self.plan.finish_reason(output) if output.finished() else None
        self.completion_tokens += token_count
        if self.plan.echo and index not in self.echo_sent:
            self.echo_sent.add(index)
            text = self.plan.echoed(slot) + text
        if not text and finish_reason is None:
            return None  # nothing a caller could see, e.g. text held back for a stop string
        return self.header.message([Choice(index=index, text=text, finish_reason=finish_reason)])

    def usage_chunk(self) -> CompletionResponse:
        return self.header.message((), usage(self.plan.prompt_tokens(), self.completion_tokens))


def stream_error_chunk(error: CompletionError) -> CompletionResponse:
    """The reference's stream error chunk: only `error` set."""
    return CompletionResponse(
        error=StreamError(
            status_code=error.http_status,
            content=StreamErrorContent(error=error.message, timestamp=utc_timestamp()),
        )
    )
