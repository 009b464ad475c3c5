"""The serving logic: validate a request, run it on the engine, assemble the responses."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

from llmcompletions.v2.completions_pb2 import CompletionRequest, CompletionResponse
from vllm.exceptions import VLLMValidationError
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.utils.async_utils import merge_async_iterators
from vllm.v1.engine.exceptions import EngineDeadError

from service.beam_search import BeamSearchSettings, beam_search
from service.constraints import constraint_field
from service.engine import ServedModel
from service.errors import (
    CompletionError,
    ContextLengthError,
    EngineUnavailableError,
    FieldViolation,
    InternalError,
    ModelNotFoundError,
    RequestValidationError,
)
from service.prompts import PreparedPrompt, prepare_prompts
from service.responses import (
    ChoicePlan,
    EngineSlot,
    ResponseHeader,
    StreamAssembler,
    whole_response,
)
from service.sampling import (
    beam_search_settings,
    is_greedy,
    requested_candidates,
    requested_max_tokens,
    requested_n,
    sampling_params,
)
from service.validation import validate_request

logger = logging.getLogger(__name__)


class CompletionHandler:
    """Runs completion requests on one served model."""

    def __init__(self, model: ServedModel) -> None:
        self.model = model

    async def complete(self, request: CompletionRequest) -> AsyncIterator[CompletionResponse]:
        """Yield the one whole response, or the stream chunks; raise CompletionError."""
        prompts = validate_request(
            request, self.model.vocab_size, self.model.structured_outputs_backend
        )
        if request.model != self.model.name:
            raise ModelNotFoundError(request.model, self.model.name)
        add_special_tokens = (
            request.add_special_tokens if request.HasField("add_special_tokens") else True
        )
        prepared = prepare_prompts(prompts, self.model.tokenizer, add_special_tokens)
        self.check_context_length(prepared, requested_max_tokens(request))
        header = ResponseHeader.new(self.model.name, self.model.system_fingerprint)
        plan = ChoicePlan(
            prompts=prepared,
            n=requested_n(request),
            candidates=requested_n(request)
            if request.use_beam_search
            else requested_candidates(request),
            echo=request.echo,
            keep_generated=requested_max_tokens(request) > 0,
            logprobs=request.logprobs if request.HasField("logprobs") else None,
            tokenizer=self.model.tokenizer,
        )
        slots = self.engine_requests(request, header.id, len(prepared))
        started = time.monotonic()
        request_ids = [slot.request_id for slot in slots]
        outcome = "error"
        try:
            results = self.generate(prepared, slots, constraint_field(request))
            if request.stream:
                assembler = StreamAssembler(header, plan)
                async for slot, result in results:
                    for chunk in assembler.chunks(slot, result):
                        yield chunk
                if request.stream_options.include_usage:
                    yield assembler.usage_chunk()
            else:
                yield whole_response(header, plan, await final_outputs(results, slots))
            outcome = "ok"
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "cancelled"
            raise
        finally:
            await self.model.engine.abort(request_ids)  # no-op for finished requests
            logger.info(
                "request id=%s model=%s user=%r prompts=%d prompt_tokens=%d stream=%s "
                "outcome=%s latency=%.3fs engine_unfinished=%d",
                header.id,
                self.model.name,
                request.user,
                len(prepared),
                plan.prompt_tokens(),
                request.stream,
                outcome,
                time.monotonic() - started,
                self.model.engine.get_num_unfinished_requests(),
            )

    def check_context_length(self, prompts: Sequence[PreparedPrompt], max_tokens: int) -> None:
        for prompt in prompts:
            if len(prompt.token_ids) + max_tokens > self.model.max_model_len:
                raise ContextLengthError(
                    self.model.max_model_len, len(prompt.token_ids), max_tokens
                )

    def engine_requests(
        self, request: CompletionRequest, completion_id: str, prompt_count: int
    ) -> list[EngineSlot]:
        """The engine requests that produce the candidates: one per prompt sampling them all,
        or, for greedy sampling (where vLLM requires n=1), one request per candidate."""
        if request.use_beam_search:
            settings = beam_search_settings(request)
            return [
                EngineSlot(index, 0, f"{completion_id}-{index}", settings)
                for index in range(prompt_count)
            ]
        candidates = requested_candidates(request)
        greedy_copies = candidates if is_greedy(request, self.model.default_sampling) else 1
        try:
            params = sampling_params(
                request, self.model.default_sampling, candidates // greedy_copies
            )
        except VLLMValidationError as error:
            raise RequestValidationError(
                [FieldViolation((error.parameter or "body",), str(error), "value_error")]
            ) from error
        return [
            EngineSlot(prompt_index, copy, f"{completion_id}-{prompt_index}-{copy}", params)
            for prompt_index in range(prompt_count)
            for copy in range(greedy_copies)
        ]

    async def generate(
        self,
        prompts: Sequence[PreparedPrompt],
        slots: Sequence[EngineSlot],
        constraint: str | None,
    ) -> AsyncIterator[tuple[EngineSlot, RequestOutput]]:
        """Each engine request's outputs, interleaved as they come, engine errors translated."""
        generators = [self.run(prompts[slot.prompt_index].token_ids, slot) for slot in slots]
        try:
            async for index, output in merge_async_iterators(*generators):
                yield slots[index], output
        except EngineDeadError as error:
            raise EngineUnavailableError(
                "The engine has stopped; retry on another replica."
            ) from error
        except CompletionError:
            raise
        except VLLMValidationError as error:
            # The engine checks constraints (regex dialect, schema features) on submission.
            field = error.parameter or constraint or "body"
            raise RequestValidationError(
                [FieldViolation((field,), str(error), "value_error")]
            ) from error
        except ValueError as error:
            raise InternalError(f"The engine rejected the request: {error}") from error

    def run(self, prompt_ids: list[int], slot: EngineSlot) -> AsyncIterator[RequestOutput]:
        if isinstance(slot.params, BeamSearchSettings):
            return self.beams(prompt_ids, slot.request_id, slot.params)
        return self.model.engine.generate(
            TokensPrompt(prompt_token_ids=prompt_ids), slot.params, slot.request_id
        )

    async def beams(
        self, prompt_ids: list[int], request_id: str, settings: BeamSearchSettings
    ) -> AsyncIterator[RequestOutput]:
        yield await beam_search(
            self.model.engine, self.model.tokenizer, prompt_ids, request_id, settings
        )


async def final_outputs(
    results: AsyncIterator[tuple[EngineSlot, RequestOutput]], slots: Sequence[EngineSlot]
) -> list[tuple[EngineSlot, RequestOutput]]:
    finals = {slot.request_id: (slot, result) async for slot, result in results}
    if len(finals) != len(slots):
        raise InternalError("The engine ended a request without a final output.")
    return [finals[slot.request_id] for slot in slots]
