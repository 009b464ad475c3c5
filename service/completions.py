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
from service.sampling import is_greedy, requested_max_tokens, requested_n, sampling_params
from service.validation import validate_request

logger = logging.getLogger(__name__)


class CompletionHandler:
    """Runs completion requests on one served model."""

    def __init__(self, model: ServedModel) -> None:
        self.model = model

    async def complete(self, request: CompletionRequest) -> AsyncIterator[CompletionResponse]:
        """Yield the one whole response, or the stream chunks; raise CompletionError."""
        prompts = validate_request(request, self.model.vocab_size)
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
            echo=request.echo,
            keep_generated=requested_max_tokens(request) > 0,
        )
        slots = self.engine_requests(request, header.id, len(prepared))
        started = time.monotonic()
        request_ids = [slot.request_id for slot in slots]
        outcome = "error"
        try:
            results = self.generate(prepared, slots)
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
        """The engine requests that produce the choices: one per prompt with `n` sequences,
        or, for greedy sampling (where vLLM requires n=1), `n` requests of one sequence."""
        n = requested_n(request)
        greedy_copies = n if is_greedy(request, self.model.default_sampling) else 1
        try:
            params = sampling_params(request, self.model.default_sampling, n // greedy_copies)
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
        self, prompts: Sequence[PreparedPrompt], slots: Sequence[EngineSlot]
    ) -> AsyncIterator[tuple[EngineSlot, RequestOutput]]:
        """Each engine request's outputs, interleaved as they come, engine errors translated."""
        generators = [
            self.model.engine.generate(
                TokensPrompt(prompt_token_ids=prompts[slot.prompt_index].token_ids),
                slot.params,
                slot.request_id,
            )
            for slot in slots
        ]
        try:
            async for index, output in merge_async_iterators(*generators):
                yield slots[index], output
        except EngineDeadError as error:
            raise EngineUnavailableError(
                "The engine has stopped; retry on another replica."
            ) from error
        except CompletionError:
            raise
        except ValueError as error:
            raise InternalError(f"The engine rejected the request: {error}") from error


async def final_outputs(
    results: AsyncIterator[tuple[EngineSlot, RequestOutput]], slots: Sequence[EngineSlot]
) -> list[tuple[EngineSlot, RequestOutput]]:
    finals = {slot.request_id: (slot, result) async for slot, result in results}
    if len(finals) != len(slots):
        raise InternalError("The engine ended a request without a final output.")
    return [finals[slot.request_id] for slot in slots]
