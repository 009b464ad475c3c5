"""The chat serving logic: a conversation rendered with the model's chat template, run on the
engine, tool calls (and reasoning) parsed out of the reply.

Rendering, sampling, parsing and the reply's assembly are vLLM's own chat serving
(OpenAIServingChat over this server's engine), so that a reply equals `vllm serve`'s for the
same model and flags. Around it this module applies what the API adds: its limits and errors,
the backlog bounds, the served names (adapters, and the CPU LoRA fix's stand-in for the base
model) and its own fingerprint."""

from __future__ import annotations

import contextlib
import contextvars
import uuid
from collections.abc import AsyncIterator, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from llmcompletions.v2.completions_pb2 import (
    CreateChatCompletionRequest,
    CreateChatCompletionResponse,
)
from vllm.entrypoints.openai.chat_completion.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from vllm.entrypoints.openai.chat_completion.serving import OpenAIServingChat
from vllm.entrypoints.openai.models.protocol import BaseModelPath
from vllm.entrypoints.openai.models.serving import OpenAIServingModels
from vllm.entrypoints.serve.engine.protocol import ErrorResponse
from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError
from vllm.lora.request import LoRARequest
from vllm.reasoning import ReasoningParserManager
from vllm.renderers.chat_utils import load_chat_template
from vllm.renderers.online_renderer import OnlineRenderer
from vllm.tool_parsers import ToolParserManager

from plumbing.tracing import annotate_call, child_span, outgoing_headers
from service.api.backlog import Backlog
from service.api.call_record import CallRecord
from service.api.caller_errors import (
    ENGINE_FAILED,
    building_request,
    engine_has_request,
    error_from,
    unsatisfiable_constraint,
)
from service.api.cancellation import CancellableCall
from service.api.chat_replies import ChatReplies
from service.api.chat_requests import chat_constraint_field, validate_chat_request, vllm_request
from service.api.endpoint_models import adapter_for_call, check_served
from service.api.errors import PriorityNotEnabledError
from service.api.media.connector import use_guarded_fetcher
from service.api.media.parts import MediaPolicy, image_counts
from service.model.engine import ServedModel
from service.settings import ChatSettings, RequestLimits

# vLLM's chat serving names its engine requests "chatcmpl-" and the request's request_id.
VLLM_CHAT_ID_PREFIX = "chatcmpl-"
# The field holding the constraint the current call's reply follows, if any (each call runs in
# its own task, and vLLM's serving reads it there).
CALL_CONSTRAINT: ContextVar[str | None] = ContextVar("call_constraint", default=None)


class ChatSettingsError(ValueError):
    """Chat flags that cannot work together, or name a parser vLLM does not have."""


def check_chat_settings(settings: ChatSettings) -> None:
    """Refuse at start what vLLM would refuse on every request."""
    if settings.enable_auto_tool_choice and settings.tool_call_parser is None:
        raise ChatSettingsError("--enable-auto-tool-choice needs --tool-call-parser NAME")
    known = ToolParserManager.list_registered()
    if settings.tool_call_parser is not None and settings.tool_call_parser not in known:
        raise ChatSettingsError(
            f"--tool-call-parser {settings.tool_call_parser!r} is not one of vLLM's parsers: "
            + ", ".join(known)
        )
    reasoning = ReasoningParserManager.list_registered()
    if settings.reasoning_parser is not None and settings.reasoning_parser not in reasoning:
        raise ChatSettingsError(
            f"--reasoning-parser {settings.reasoning_parser!r} is not one of vLLM's parsers: "
            + ", ".join(reasoning)
        )
    if settings.chat_template is not None and not settings.chat_template.is_file():
        raise ChatSettingsError(f"--chat-template {settings.chat_template}: no such file")


# The adapter the current chat call holds (set before vLLM's serving runs it).
CALL_ADAPTER: contextvars.ContextVar[LoRARequest | None] = contextvars.ContextVar(
    "chat_adapter", default=None
)
# The current chat call's record: told the prompt's token count (and its images) as soon as
# vLLM's serving has rendered and tokenized it.
CALL_RECORD: contextvars.ContextVar[CallRecord | None] = contextvars.ContextVar(
    "chat_record", default=None
)


class CatalogChat(OpenAIServingChat):
    """vLLM's chat serving, with the served names and adapters this server's registry knows
    (checked, and the adapter held, before a request gets here)."""

    async def _check_model(self, request: Any) -> ErrorResponse | None:
        return None

    def _maybe_get_adapters(
        self, request: Any, supports_default_mm_loras: bool = False
    ) -> LoRARequest | None:
        return CALL_ADAPTER.get()

    def _log_inputs(
        self, request_id: str, inputs: Any, params: Any, lora_request: LoRARequest | None
    ) -> None:
        # Called once the conversation is tokenized, before the engine gets it.
        super()._log_inputs(request_id, inputs, params=params, lora_request=lora_request)
        record = CALL_RECORD.get()
        if record is not None:
            record.images, record.image_tokens = image_counts(inputs)
            record.tokenized(len(self._extract_prompt_components(inputs).token_ids or ()))

    def _raise_if_error(self, finish_reason: str | None, request_id: str) -> None:
        constraint = CALL_CONSTRAINT.get()
        if finish_reason == ENGINE_FAILED and constraint is not None:
            raise unsatisfiable_constraint(constraint)
        super()._raise_if_error(finish_reason, request_id)

    async def chat_completion_full_generator(self, *args: Any, **kwargs: Any) -> Any:
        # Called once the request is built and with the engine: from here, what fails is the
        # server's, not the caller's input.
        with engine_has_request():
            return await super().chat_completion_full_generator(*args, **kwargs)


def chat_serving(model: ServedModel, settings: ChatSettings) -> CatalogChat:
    engine = model.engine
    template = load_chat_template(settings.chat_template) if settings.chat_template else None
    common: dict[str, Any] = {
        "request_logger": None,
        "chat_template": template,
        "chat_template_content_format": "auto",
        "trust_request_chat_template": settings.trust_request_chat_template,
        "enable_auto_tools": settings.enable_auto_tool_choice,
        "tool_parser": settings.tool_call_parser,
        "reasoning_parser": settings.reasoning_parser or "",
    }
    renderer = OnlineRenderer(
        model_config=engine.model_config,
        renderer=engine.renderer,
        **{**common, "reasoning_parser": settings.reasoning_parser},
    )
    renderer.warmup()
    models = OpenAIServingModels(
        engine_client=engine,
        base_model_paths=[BaseModelPath(name=model.name, model_path=str(model.name))],
    )
    serving = CatalogChat(
        engine,
        models,
        "assistant",
        online_renderer=renderer,
        enable_prompt_tokens_details=True,  # usage.prompt_tokens_details.cached_tokens
        # vLLM's own timings of the request (`metrics`), kept when the caller asks for them.
        enable_per_request_metrics=True,
        **common,
    )
    return serving


class ChatHandler:
    """Runs chat requests on one served model."""

    def __init__(
        self,
        model: ServedModel,
        limits: RequestLimits,
        backlog: Backlog,
        settings: ChatSettings,
        always_metrics: bool = False,
    ) -> None:
        self.model = model
        self.always_metrics = always_metrics  # --enable-per-request-metrics
        self.limits = limits
        self.backlog = backlog
        self.serving = chat_serving(model, settings)
        use_guarded_fetcher(settings.media)  # every image this process renders
        self.media = MediaPolicy.of(model.engine.model_config)

    async def complete(
        self, request: CreateChatCompletionRequest, record: CallRecord, call: CancellableCall
    ) -> AsyncIterator[CreateChatCompletionResponse]:
        """Yield the one whole reply, or the stream chunks; raise CompletionError (and
        RequestCancelledError once `call` is cancelled)."""
        with child_span("validate"), building_request():
            self.validate(request)
            # The engine request ids carry the request id, so engine logs can be matched to it.
            engine_request = vllm_request(request, f"{record.request_id}-{uuid.uuid4().hex[:8]}")
        CALL_CONSTRAINT.set(chat_constraint_field(request))
        adapter = await adapter_for_call(self.model.adapters, request.model, call)
        if adapter is not None:
            annotate_call(**{"llm_completions.adapter": adapter.lora_name})
        CALL_ADAPTER.set(adapter)
        CALL_RECORD.set(record)  # a tenant's limits charge the prompt at once
        call.engine_prefix = f"{VLLM_CHAT_ID_PREFIX}{engine_request.request_id}"
        call.check()
        timed = self.always_metrics or request.return_metrics
        replies = ChatReplies(
            model=request.model,
            system_fingerprint=self.model.system_fingerprint,
            usage_asked=request.stream_options.include_usage,
            timed_since=record.started if timed else None,
        )
        # vLLM's chat serving renders and tokenizes the conversation itself, under this span.
        with child_span("render, tokenize and generate") as engine_span:
            # Each call runs in its own task, whose context ends with it: nothing to reset.
            trace_headers = outgoing_headers(engine_span)
            try:
                async for message in self.run(engine_request, replies, trace_headers):
                    call.check()
                    yield message
                call.check()
            except Exception:
                call.check()  # a cancelled call's requests end early: what ends it is the cancel
                raise
            finally:
                record.prompt_tokens, record.completion_tokens, record.cached_tokens = (
                    replies.token_counts()
                )

    def validate(self, request: CreateChatCompletionRequest) -> None:
        self.check(request)
        check_served(self.model.adapters, request.model)  # 404 unless served
        self.backlog.check(request.n if request.HasField("n") else 1)

    def check(self, request: CreateChatCompletionRequest) -> None:
        """Whether the request's fields pass the API's rules and its priority can be honoured
        (what a batch job's lines are checked by when the job is created, too)."""
        self.check_request(request)
        if request.priority and self.model.scheduling_policy != "priority":
            raise PriorityNotEnabledError(request.priority)

    def check_request(self, request: CreateChatCompletionRequest) -> None:
        validate_chat_request(
            request,
            self.model.vocab_size,
            self.model.structured_outputs_backend,
            self.limits,
            self.media,
        )

    async def prompt_token_ids(self, request: CreateChatCompletionRequest) -> list[int]:
        """The conversation rendered and tokenized exactly as a chat request renders it."""
        with building_request():
            self.check_request(request)
            check_served(self.model.adapters, request.model)  # 404 unless served
            rendered = await self.serving.online_renderer.render_chat(
                vllm_request(request, "tokenize")
            )
        if isinstance(rendered, ErrorResponse):
            raise error_from(rendered)
        _, engine_inputs = rendered
        return [
            token
            for engine_input in engine_inputs
            for token in self.serving._extract_prompt_components(engine_input).token_ids or ()
        ]

    async def run(
        self,
        request: ChatCompletionRequest,
        replies: ChatReplies,
        trace_headers: Mapping[str, str],
    ) -> AsyncIterator[CreateChatCompletionResponse]:
        try:
            # vLLM renders the conversation and builds the sampling parameters here; a whole
            # reply is generated here too, under engine_has_request.
            with building_request():
                result = await self.serving.create_chat_completion(
                    request,
                    traced_request(trace_headers),  # type: ignore[arg-type]
                )
        except (QueueOverflowError, MaxQueuedTokensError) as error:
            raise self.backlog.refusal(error) from error
        if isinstance(result, ErrorResponse):
            raise error_from(result)
        if isinstance(result, ChatCompletionResponse):
            yield replies.whole(result.model_dump(mode="json"))
            return
        async with contextlib.aclosing(result) as events:  # leaving it aborts the engine work
            async for text in events:
                for message in replies.events(text):
                    yield message


@dataclass(frozen=True)
class TracedRequest:
    """What vLLM's chat serving reads of an HTTP request when given one: its headers, where it
    finds the trace context its engine request continues (else, with tracing on, vLLM would
    give the engine request's span to whatever trace its output task started in)."""

    headers: Mapping[str, str]
    state: SimpleNamespace = field(default_factory=SimpleNamespace)


def traced_request(trace_headers: Mapping[str, str]) -> TracedRequest | None:
    return TracedRequest(trace_headers) if trace_headers else None
