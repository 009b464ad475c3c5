"""The serving logic: validate a request, run it on the engine, assemble the responses."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Sequence

from llmcompletions.v2.completions_pb2 import CompletionRequest, CompletionResponse
from vllm.inputs import TokensPrompt
from vllm.outputs import RequestOutput
from vllm.utils.async_utils import merge_async_iterators
from vllm.v1.engine.exceptions import EngineDeadError

from service.engine import ServedModel
from service.errors import (
    CompletionError,
    ContextLengthError,
    EngineUnavailableError,
    InternalError,
    ModelNotFoundError,
)
from service.prompts import PreparedPrompt, prepare_prompts
from service.responses import ChoicePlan, ResponseHeader, StreamAssembler, whole_response
from service.sampling import requested_max_tokens, sampling_params
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
            n=request.n if request.HasField("n") else 1,
            echo=request.echo,
            keep_generated=requested_max_tokens(request) > 0,
        )
        started = time.monotonic()
        request_ids = [f"{header.id}-{index}" for index in range(len(prepared))]
        outcome = "error"
        try:
            results = self.generate(request, prepared, request_ids)
            if request.stream:
                assembler = StreamAssembler(header, plan)
                async for prompt_index, result in results:
                    for chunk in assembler.chunks(prompt_index, result):
                        yield chunk
                if request.stream_options.include_usage:
                    yield assembler.usage_chunk()
            else:
                yield whole_response(header, plan, await final_outputs(results, len(prepared)))
            outcome = "ok"
        except (GeneratorExit, asyncio.CancelledError):
            outcome = "cancelled"
            raise
        finally:
            await self.model.engine.abort(request_ids)  # no-op for finished requests
            logger.info(
                "request id=%s model=%s user=%r prompts=%d prompt_tokens=%d stream=%s "
                "outcome=%s latency=%.3fs",
                header.id, self.model.name, request.user, len(prepared), plan.prompt_tokens(),
                request.stream, outcome, time.monotonic() - started,
            )

    def check_context_length(self, prompts: Sequence[PreparedPrompt], max_tokens: int) -> None:
        for prompt in prompts:
            if len(prompt.token_ids) + max_tokens > self.model.max_model_len:
                raise ContextLengthError(self.model.max_model_len, len(prompt.token_ids), max_tokens)

    async def generate(
        self, request: CompletionRequest, prompts: Sequence[PreparedPrompt], request_ids: list[str]
    ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Each prompt's engine outputs, interleaved as they come, engine errors translated."""
        params = sampling_params(request, self.model.default_sampling)
        generators = [
            self.model.engine.generate(
                TokensPrompt(prompt_token_ids=prompt.token_ids), params, request_id
            )
            for prompt, request_id in zip(prompts, request_ids, strict=True)
        ]
        try:
            async for item in merge_async_iterators(*generators):
                yield item
        except EngineDeadError as error:
            raise EngineUnavailableError("The engine has stopped; retry on another replica.") from error
        except CompletionError:
            raise
        except ValueError as error:
            raise InternalError(f"The engine rejected the request: {error}") from error


async def final_outputs(
    results: AsyncIterator[tuple[int, RequestOutput]], count: int
) -> list[RequestOutput]:
    finals: list[RequestOutput | None] = [None] * count
    async for prompt_index, result in results:
        finals[prompt_index] = result
    if any(result is None for result in finals):
        raise InternalError("The engine ended a request without a final output.")
    return [result for result in finals if result is not None]
