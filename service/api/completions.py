"""The serving logic: validate a request, run it on the engine, assemble the responses."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from llmcompletions.v2.completions_pb2 import CreateCompletionRequest, CreateCompletionResponse
from opentelemetry.trace import Span
from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError, VLLMClientError
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.tokenizers import TokenizerLike
from vllm.utils.async_utils import merge_async_iterators
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from plumbing.tracing import annotate_call, child_span, outgoing_headers
from service.api.backlog import Backlog
from service.api.beam_search import BeamSearchSettings, beam_search
from service.api.call_record import CallRecord
from service.api.caller_errors import (
    BODY,
    ENGINE_FAILED,
    building_request,
    caller_error,
    unsatisfiable_constraint,
)
from service.api.cancellation import CancellableCall
from service.api.constraints import constraint_field
from service.api.endpoint_models import adapter_for_call
from service.api.engine_calls import CURRENT_CALL, EngineCall, ObservedEngine
from service.api.errors import (
    CompletionError,
    ContextLengthError,
    EngineUnavailableError,
    InternalError,
    PriorityNotEnabledError,
    TruncationTooLongError,
)
from service.api.prompts import PreparedPrompt, PromptInput, prepare_prompts, truncated
from service.api.responses import (
    ChoicePlan,
    EngineSlot,
    ResponseHeader,
    StreamAssembler,
    whole_response,
)
from service.api.sampling import (
    beam_search_settings,
    is_greedy,
    requested_candidates,
    requested_logprobs,
    requested_max_tokens,
    requested_n,
    sampling_params,
)
from service.api.timings import RequestTimings
from service.api.validation import check_prompt_tokens, validate_request
from service.model.engine import ServedModel
from service.settings import RequestLimits

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineRequestOptions:
    """What every engine request of one call shares besides its sampling parameters."""

    adapter: LoRARequest | None
    constraint: str | None  # the structured-output field the request set, if any
    priority: int
    span: Span  # the engine's span: vLLM's request spans go under it


class CompletionHandler:
    """Runs completion requests on one served model."""

    def __init__(
        self,
        model: ServedModel,
        limits: RequestLimits,
        backlog: Backlog,
        always_metrics: bool = False,
    ) -> None:
        self.model = model
        self.always_metrics = always_metrics  # --enable-per-request-metrics
        self.limits = limits
        self.backlog = backlog
        # As many tokenizing threads as vLLM's own renderer (one by default). With more, calls
        # overlap in vLLM's tokenizer pool, which then deep-copies the whole tokenizer (py-spy:
        # 18-19% of this server's samples in `make profile`).
        self.tokenizing = ThreadPoolExecutor(
            max_workers=model.engine.model_config.renderer_num_workers,
            thread_name_prefix="tokenize",
        )

    async def complete(
        self,
        request: CreateCompletionRequest,
        record: CallRecord,
        call: CancellableCall,
    ) -> AsyncIterator[CreateCompletionResponse]:
        """Yield the one whole response, or the stream chunks; raise CompletionError (and
        RequestCancelledError once `call` is cancelled). Token counts go into `record` as they
        become known."""
        header = ResponseHeader.new(request.model, self.model.system_fingerprint)
        # The engine request ids carry the request id, so engine logs can be matched to it.
        engine_prefix = f"{record.request_id}-{header.id[-8:]}"
        with child_span("validate and tokenize"), building_request():
            prepared, adapter = await self.prepare(request, call)
            slots = self.engine_requests(request, engine_prefix, len(prepared))
        if adapter is not None:
            annotate_call(**{"llm_completions.adapter": adapter.lora_name})
        sequences = len(prepared) * requested_candidates(request)
        plan = choice_plan(request, prepared, self.model.tokenizer)
        record.tokenized(plan.prompt_tokens())
        call.engine_prefix = engine_prefix
        call.check()
        self.backlog.admit(sequences)
        timings = RequestTimings(received=record.started)
        metrics_asked = self.always_metrics or request.return_metrics
        with child_span("engine", **{"llm_completions.engine_requests": len(slots)}) as engine_span:
            # For beam search's many engine requests (ObservedEngine). Each call runs in its own
            # task, whose context ends with it: nothing to reset.
            CURRENT_CALL.set(EngineCall(timings, outgoing_headers(engine_span)))
            try:
                results = self.generate(
                    prepared,
                    slots,
                    EngineRequestOptions(
                        adapter, constraint_field(request), request.priority, engine_span
                    ),
                )
                if request.stream:
                    assembler = StreamAssembler(header, plan)
                    async for slot, result in results:
                        call.check()
                        if metrics_asked:
                            timings.observe(result)
                        for chunk in assembler.chunks(slot, result):
                            record.completion_tokens = assembler.completion_tokens
                            yield chunk
                    record.cached_tokens = assembler.cached.total
                    last = assembler.usage_chunk() if request.stream_options.include_usage else None
                    if metrics_asked:
                        last = last or header.message()
                        last.metrics.CopyFrom(timings.reply(assembler.completion_tokens))
                    if last is not None:
                        yield last
                else:
                    outputs = await final_outputs(results, slots)
                    call.check()
                    response = whole_response(header, plan, outputs)
                    record.completion_tokens = response.usage.completion_tokens
                    record.cached_tokens = response.usage.prompt_tokens_details.cached_tokens
                    if metrics_asked:
                        for _, result in outputs:
                            timings.observe(result)
                        response.metrics.CopyFrom(timings.reply(record.completion_tokens))
                    yield response
            except Exception:
                call.check()  # a cancelled call's requests end early: what ends it is the cancel
                raise
            finally:
                await self.model.engine.abort([slot.request_id for slot in slots])  # no-op if done

    def check(self, request: CreateCompletionRequest) -> list[PromptInput]:
        """The request's prompts, if its fields pass the API's rules and its priority can be
        honoured (what a batch job's lines are checked by when the job is created, too)."""
        prompts = validate_request(
            request, self.model.vocab_size, self.model.structured_outputs_backend, self.limits
        )
        if request.priority and self.model.scheduling_policy != "priority":
            raise PriorityNotEnabledError(request.priority)
        return prompts

    async def prepare(
        self, request: CreateCompletionRequest, call: CancellableCall
    ) -> tuple[list[PreparedPrompt], LoRARequest | None]:
        """The request validated and its prompts tokenized (truncated as asked), each checked
        against the limits and the context; and the adapter its model names, if any (held by
        `call`)."""
        prompts = self.check(request)
        # 404 for a model not served
        adapter = await adapter_for_call(self.model.adapters, request.model, call)
        add_special_tokens = (
            request.add_special_tokens if request.HasField("add_special_tokens") else True
        )
        with self.backlog.preparing(len(prompts) * requested_candidates(request)):
            # Off the event loop: a long prompt takes a while to tokenize.
            prepared = await asyncio.get_running_loop().run_in_executor(
                self.tokenizing, prepare_prompts, prompts, self.model.tokenizer, add_special_tokens
            )
        if request.HasField("truncate_prompt_tokens"):
            prepared = self.truncate(request, prepared)
        check_prompt_tokens(prepared, self.limits.max_prompt_tokens)
        self.check_context_length(prepared, requested_max_tokens(request))
        return prepared, adapter

    def truncate(
        self, request: CreateCompletionRequest, prompts: list[PreparedPrompt]
    ) -> list[PreparedPrompt]:
        """The prompts cut as truncate_prompt_tokens and truncation_side ask; -1 keeps what
        leaves room for max_tokens in the context."""
        max_model_len = self.model.max_model_len
        keep = request.truncate_prompt_tokens
        if keep == -1:
            keep = max(max_model_len - requested_max_tokens(request), 1)
        elif keep > max_model_len:
            raise TruncationTooLongError(keep, max_model_len)
        side = request.truncation_side or getattr(self.model.tokenizer, "truncation_side", "right")
        return truncated(prompts, keep, side, self.model.tokenizer)

    def check_context_length(self, prompts: Sequence[PreparedPrompt], max_tokens: int) -> None:
        for prompt in prompts:
            if len(prompt.token_ids) + max_tokens > self.model.max_model_len:
                raise ContextLengthError(
                    self.model.max_model_len, len(prompt.token_ids), max_tokens
                )

    def engine_requests(
        self, request: CreateCompletionRequest, id_prefix: str, prompt_count: int
    ) -> list[EngineSlot]:
        """The engine requests that produce the candidates: one per prompt sampling them all,
        or, for greedy sampling (where vLLM requires n=1), one request per candidate."""
        if request.use_beam_search:
            settings = beam_search_settings(request)
            return [
                EngineSlot(index, 0, f"{id_prefix}-{index}", settings)
                for index in range(prompt_count)
            ]
        candidates = requested_candidates(request)
        greedy_copies = candidates if is_greedy(request, self.model.default_sampling) else 1
        params = sampling_params(request, self.model.default_sampling, candidates // greedy_copies)
        return [
            EngineSlot(prompt_index, copy, f"{id_prefix}-{prompt_index}-{copy}", params)
            for prompt_index in range(prompt_count)
            for copy in range(greedy_copies)
        ]

    async def generate(
        self,
        prompts: Sequence[PreparedPrompt],
        slots: Sequence[EngineSlot],
        options: EngineRequestOptions,
    ) -> AsyncIterator[tuple[EngineSlot, RequestOutput]]:
        """Each engine request's outputs, interleaved as they come, engine errors translated."""
        generators = [
            self.run(prompts[slot.prompt_index].token_ids, slot, options) for slot in slots
        ]
        try:
            if len(generators) == 1 and not options.constraint:
                # The common call: its outputs go straight on, one generator layer less per token
                # (closed at once if the call ends early, as vLLM's merge would close it).
                async with contextlib.aclosing(generators[0]) as outputs:
                    async for output in outputs:
                        yield slots[0], output
                return
            async for index, output in merge_async_iterators(*generators):
                failed = any(choice.finish_reason == ENGINE_FAILED for choice in output.outputs)
                if failed and options.constraint:
                    raise caller_error(unsatisfiable_constraint(options.constraint))
                yield slots[index], output
        except EngineDeadError as error:
            raise EngineUnavailableError(
                "The engine has stopped; retry on another replica."
            ) from error
        except EngineGenerateError as error:
            raise InternalError(f"The engine failed while generating: {error}") from error
        except CompletionError:
            raise
        except (QueueOverflowError, MaxQueuedTokensError) as error:
            # The engine checks the backlog bounds again as each request is added.
            raise self.backlog.refusal(error) from error
        except VLLMClientError as error:
            # The engine checks constraints (regex dialect, schema features) on submission.
            field = (options.constraint,) if options.constraint else BODY
            raise caller_error(error, field) from error
        except ValueError as error:
            raise InternalError(f"The engine rejected the request: {error}") from error

    def run(
        self, prompt_ids: list[int], slot: EngineSlot, options: EngineRequestOptions
    ) -> AsyncGenerator[RequestOutput, None]:
        if isinstance(slot.params, BeamSearchSettings):
            return self.beams(prompt_ids, slot.request_id, slot.params, options.adapter)
        return self.model.engine.generate(
            TokensPrompt(prompt_token_ids=prompt_ids),
            slot.params,
            slot.request_id,
            lora_request=options.adapter,
            priority=options.priority,
            # vLLM's request span goes under the engine span (never under another call's: a
            # request without these is given whatever trace vLLM's output task started in).
            trace_headers=outgoing_headers(options.span) or None,
        )

    async def beams(
        self,
        prompt_ids: list[int],
        request_id: str,
        settings: BeamSearchSettings,
        adapter: LoRARequest | None,
    ) -> AsyncGenerator[RequestOutput, None]:
        # Every step's engine requests carry the call's trace context and report its timings.
        engine = ObservedEngine(self.model.engine)
        yield await beam_search(
            engine,  # type: ignore[arg-type]  # the engine, with the call's context
            self.model.tokenizer,
            prompt_ids,
            request_id,
            settings,
            adapter,
        )


def choice_plan(
    request: CreateCompletionRequest, prompts: list[PreparedPrompt], tokenizer: TokenizerLike
) -> ChoicePlan:
    n = requested_n(request)
    return ChoicePlan(
        prompts=prompts,
        n=n,
        # Beam search returns its n best beams already ranked.
        candidates=n if request.use_beam_search else requested_candidates(request),
        echo=request.echo,
        keep_generated=requested_max_tokens(request) > 0,
        logprobs=requested_logprobs(request),
        tokenizer=tokenizer,
        return_token_ids=request.return_token_ids,
        tokens_as_ids=request.return_tokens_as_token_ids,
        prompt_logprobs=request.HasField("prompt_logprobs"),
    )


async def final_outputs(
    results: AsyncIterator[tuple[EngineSlot, RequestOutput]], slots: Sequence[EngineSlot]
) -> list[tuple[EngineSlot, RequestOutput]]:
    finals = {slot.request_id: (slot, result) async for slot, result in results}
    if len(finals) != len(slots):
        raise InternalError("The engine ended a request without a final output.")
    return [finals[slot.request_id] for slot in slots]
