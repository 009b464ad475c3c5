"""Assembly of completion responses (whole responses, stream chunks) from engine outputs."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property

from google.protobuf import struct_pb2
from llmcompletions.v2.completions_pb2 import (
    Choice,
    CreateCompletionResponse,
    PromptTokensDetails,
    StreamError,
    StreamErrorContent,
    Usage,
)
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.tokenizers import TokenizerLike

from service.api.beam_search import BeamSearchSettings
from service.api.errors import CompletionError, utc_timestamp
from service.api.logprobs import StepLogprobs, next_offset, prompt_logprobs, token_logprobs
from service.api.prompts import PreparedPrompt

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

    @cached_property
    def shared_fields(self) -> CreateCompletionResponse:
        return CreateCompletionResponse(
            id=self.id,
            object=OBJECT_TYPE,
            created=self.created,
            model=self.model,
            system_fingerprint=self.system_fingerprint,
        )

    def message(
        self, choices: Sequence[Choice] = (), usage: Usage | None = None
    ) -> CreateCompletionResponse:
        # Copying the shared fields built once costs half of setting them again (a stream
        # makes a message per token).
        message = CreateCompletionResponse()
        message.CopyFrom(self.shared_fields)
        message.choices.extend(choices)
        if usage is not None:
            message.usage.CopyFrom(usage)
        return message


@dataclass(frozen=True)
class EngineSlot:
    """One engine request of a completion: which prompt, and which of its choices it makes
    (`first_choice` onwards, one per sequence)."""

    prompt_index: int
    first_choice: int
    request_id: str
    params: SamplingParams | BeamSearchSettings


@dataclass(frozen=True)
class ChoiceContent:
    """What a choice (or one delta of it) shows: text, and the tokens behind it."""

    text: str
    token_ids: Sequence[int]
    steps: Sequence[StepLogprobs]
    generated_tokens: int  # counted in usage


@dataclass(frozen=True)
class ChoicePlan:
    """How engine outputs become choices: `n` per prompt, echo, log-probabilities, and
    whether generated text is kept (not for max_tokens 0: the engine's one token is dropped)."""

    prompts: list[PreparedPrompt]
    n: int
    candidates: int  # best_of: sequences sampled per prompt, of which the n best are returned
    echo: bool
    keep_generated: bool
    logprobs: int | None
    tokenizer: TokenizerLike
    return_token_ids: bool = False  # each choice's token ids and its prompt's
    tokens_as_ids: bool = False  # logprobs' tokens as "token_id:N"
    prompt_logprobs: bool = False  # each choice's prompt_logprobs

    def index(self, slot: EngineSlot, output: CompletionOutput) -> int:
        return slot.prompt_index * self.n + slot.first_choice + output.index

    def select(self, outputs: list[SlotOutput]) -> list[SlotOutput]:
        """A prompt's outputs as its choices, in order: all of them, or for best_of the n
        with the highest mean token log-probability, best first."""
        if self.candidates <= self.n:
            return sorted(outputs, key=lambda item: self.index(item.slot, item.output))
        return sorted(outputs, key=lambda item: mean_logprob(item.output), reverse=True)[: self.n]

    def prompt_tokens(self) -> int:
        return sum(len(prompt.token_ids) for prompt in self.prompts)

    def content(
        self, slot: EngineSlot, result: RequestOutput, output: CompletionOutput, with_prompt: bool
    ) -> ChoiceContent:
        """The output as the caller sees it, the echoed prompt first when `with_prompt`."""
        text, token_ids, steps, generated = "", [], [], 0
        if with_prompt:
            prompt = self.prompts[slot.prompt_index]
            text, token_ids = prompt.text, list(prompt.token_ids)
            steps = list(result.prompt_logprobs or [None] * len(token_ids))
        if self.keep_generated:
            text += output.text
            token_ids += output.token_ids
            steps += output.logprobs or [None] * len(output.token_ids)
            generated = len(output.token_ids)
        return ChoiceContent(text, token_ids, steps, generated)

    def finish_reason(self, output: CompletionOutput) -> str | None:
        if output.finish_reason is None:
            return None
        return output.finish_reason if self.keep_generated else "length"

    def choice(
        self, index: int, content: ChoiceContent, finish_reason: str | None, text_offset: int
    ) -> Choice:
        choice = Choice(index=index, text=content.text, finish_reason=finish_reason)
        if self.logprobs is not None:
            choice.logprobs.CopyFrom(
                token_logprobs(
                    content.token_ids,
                    content.steps,
                    self.logprobs,
                    self.tokenizer,
                    text_offset,
                    self.tokens_as_ids,
                )
            )
        return choice

    def add_details(
        self,
        choice: Choice,
        slot: EngineSlot,
        result: RequestOutput,
        output: CompletionOutput,
        first: bool,
    ) -> None:
        """What vLLM's extras ask for: why the choice stopped (with its finish reason), the
        token ids of the output and (on a choice's first message) of the prompt, and the
        prompt's log-probabilities."""
        if choice.HasField("finish_reason"):
            set_stop_reason(choice.stop_reason, output.stop_reason if self.keep_generated else None)
        if self.return_token_ids:
            choice.token_ids.extend(list(output.token_ids) if self.keep_generated else [])
            if first:
                choice.prompt_token_ids.extend(self.prompts[slot.prompt_index].token_ids)
        if self.prompt_logprobs and first:
            choice.prompt_logprobs.CopyFrom(
                prompt_logprobs(result.prompt_logprobs or [], self.tokenizer)
            )


@dataclass(frozen=True)
class SlotOutput:
    """One sequence of an engine request's final output."""

    slot: EngineSlot
    result: RequestOutput
    output: CompletionOutput


def set_stop_reason(value: struct_pb2.Value, reason: int | str | None) -> None:
    """vLLM's stop_reason: the stop string or stop token id that matched, else null."""
    if isinstance(reason, str):
        value.string_value = reason
    elif isinstance(reason, int):
        value.number_value = reason
    else:
        value.null_value = struct_pb2.NULL_VALUE


def mean_logprob(output: CompletionOutput) -> float:
    return (output.cumulative_logprob or 0.0) / max(len(output.token_ids), 1)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> Usage:
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=cached_tokens),
    )


@dataclass
class CachedTokens:
    """Prompt tokens the engine found in its prefix cache, each prompt counted once (by its
    first engine request's report: greedy copies of a prompt find it cached by each other)."""

    by_prompt: dict[int, int] = field(default_factory=dict)

    def add(self, slot: EngineSlot, result: RequestOutput) -> None:
        if slot.prompt_index not in self.by_prompt:
            self.by_prompt[slot.prompt_index] = result.num_cached_tokens or 0

    @property
    def total(self) -> int:
        return sum(self.by_prompt.values())


def whole_response(
    header: ResponseHeader,
    plan: ChoicePlan,
    results: Sequence[tuple[EngineSlot, RequestOutput]],
) -> CreateCompletionResponse:
    """The one message of a non-streamed completion, from each engine request's final output.
    Usage counts every generated token, also of best_of candidates not returned."""
    by_prompt: dict[int, list[SlotOutput]] = {}
    completion_tokens = 0
    cached = CachedTokens()
    for slot, result in results:
        cached.add(slot, result)
        for output in result.outputs:
            by_prompt.setdefault(slot.prompt_index, []).append(SlotOutput(slot, result, output))
            completion_tokens += len(output.token_ids) if plan.keep_generated else 0
    choices: list[Choice] = []
    for prompt_index, outputs in sorted(by_prompt.items()):
        for position, item in enumerate(plan.select(outputs)):
            content = plan.content(item.slot, item.result, item.output, with_prompt=plan.echo)
            index = prompt_index * plan.n + position
            choice = plan.choice(index, content, plan.finish_reason(item.output), 0)
            plan.add_details(choice, item.slot, item.result, item.output, first=True)
            choices.append(choice)
    return header.message(choices, usage(plan.prompt_tokens(), completion_tokens, cached.total))


@dataclass
class StreamAssembler:
    """Turns delta outputs into stream chunks, one per choice delta, and counts usage."""

    header: ResponseHeader
    plan: ChoicePlan
    started: set[int] = field(default_factory=set)  # choices that have sent a chunk
    text_offsets: dict[int, int] = field(default_factory=dict)
    completion_tokens: int = 0
    cached: CachedTokens = field(default_factory=CachedTokens)

    def chunks(self, slot: EngineSlot, result: RequestOutput) -> list[CreateCompletionResponse]:
        self.cached.add(slot, result)
        return [
            chunk
            for output in result.outputs
            if (chunk := self.chunk(slot, result, output)) is not None
        ]

    def chunk(
        self, slot: EngineSlot, result: RequestOutput, output: CompletionOutput
    ) -> CreateCompletionResponse | None:
        index = self.plan.index(slot, output)
        first = index not in self.started
        content = self.plan.content(slot, result, output, with_prompt=self.plan.echo and first)
        self.completion_tokens += content.generated_tokens
        finish_reason = self.plan.finish_reason(output)
        if not content.token_ids and finish_reason is None:
            return None  # nothing a caller could see
        self.started.add(index)
        offset = self.text_offsets.get(index, 0)
        choice = self.plan.choice(index, content, finish_reason, offset)
        self.plan.add_details(choice, slot, result, output, first)
        self.text_offsets[index] = next_offset(choice.logprobs, offset)
        return self.header.message([choice])

    def usage_chunk(self) -> CreateCompletionResponse:
        return self.header.message(
            (), usage(self.plan.prompt_tokens(), self.completion_tokens, self.cached.total)
        )


def stream_error_chunk(error: CompletionError) -> CreateCompletionResponse:
    """The reference's stream error chunk: only `error` set."""
    return CreateCompletionResponse(
        error=StreamError(
            status_code=error.http_code,
            content=StreamErrorContent(error=error.message, timestamp=utc_timestamp()),
        )
    )
