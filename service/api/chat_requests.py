"""A chat request: checked against the API's limits (the rules it shares with a completion
request, and its own), then turned into vLLM's ChatCompletionRequest, which vLLM's chat serving
renders and samples from. Both raise for the caller's input only inside
`service.api.caller_errors.building_request`, which makes their errors the API's."""

from __future__ import annotations

import dataclasses
from typing import Any

import pydantic
from google.protobuf import json_format
from llmcompletions.v2.completions_pb2 import (
    ChatToolCall,
    CreateChatCompletionRequest,
    TokenizeRequest,
)
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

from service.api.caller_errors import pydantic_violations
from service.api.constraints import (
    GUIDED_FIELDS,
    constraint_field,
    json_value,
    structured_outputs,
)
from service.api.declared_ranges import declared_ranges
from service.api.errors import Loc, RequestValidationError
from service.api.media.parts import MediaPolicy, check_media, message_content
from service.api.validation import (
    Violations,
    check_backend,
    check_constraint_sizes,
    check_logit_bias_count,
    check_numeric_ranges,
    check_output_constraints,
    check_stop,
    check_token_ids,
    constraint_sizes,
)
from service.settings import RequestLimits

ROLES = ("system", "developer", "user", "assistant", "tool")
CHAT_RANGES = {
    name: bounds
    for name, bounds in declared_ranges(CreateChatCompletionRequest.DESCRIPTOR).items()
    if name != "logit_bias"  # checked per entry, with the token ids
}
# Our fields that vLLM's chat request does not have: translated here, or checked and dropped.
OURS_ONLY = (*GUIDED_FIELDS, "guided_decoding_backend", "guided_whitespace_pattern")


def validate_chat_request(
    request: CreateChatCompletionRequest,
    vocab_size: int,
    structured_outputs_backend: str,
    limits: RequestLimits,
    media: MediaPolicy,
) -> None:
    """Raise RequestValidationError listing every violation of the API's own rules; vLLM's
    request model checks the rest (the forms of messages, tools and tool_choice)."""
    found = Violations()
    if not request.model:
        found.add(("model",), "model is required", "missing")
    check_messages(request, found)
    check_media(request.messages, request.model, media, found)
    check_tools(request, found)
    check_numeric_ranges(request, found, CHAT_RANGES)
    check_stop(request.stop if request.HasField("stop") else None, found)
    check_token_ids(request, vocab_size, found)
    check_output_constraints(request, found)
    check_backend(request, structured_outputs_backend, found)
    check_constraint_sizes(chat_constraint_sizes(request), limits, found)
    check_logit_bias_count(request, limits, found)
    n = request.n if request.HasField("n") else 1
    if n > limits.max_choices:
        found.add(("n",), f"n is {n}; at most {limits.max_choices} per request", "too_long")
    if request.HasField("stream_options") and not request.stream:
        found.add(("stream_options",), "stream_options is only allowed with stream=true")
    if found.items:
        raise RequestValidationError(found.items)


def check_messages(request: CreateChatCompletionRequest, found: Violations) -> None:
    if not request.messages:
        found.add(("messages",), "messages must hold at least one message", "too_short")
    for index, message in enumerate(request.messages):
        if message.role not in ROLES:
            found.add(
                ("messages", index, "role"),
                f"role must be one of {', '.join(ROLES)}, got {message.role!r:.40}",
                "literal_error",
            )
        for call_index, call in enumerate(message.tool_calls):
            check_tool_call(call, ("messages", index, "tool_calls", call_index), found)


def check_tool_call(call: ChatToolCall, loc: Loc, found: Violations) -> None:
    """A call in the conversation needs the parts vLLM's request model requires (its error for
    a missing one would name the call's index alone: it validates the calls lazily)."""
    if not call.id:
        found.add((*loc, "id"), "a tool call needs its id", "missing")
    if call.type != "function":
        found.add(
            (*loc, "type"), f'type must be "function", got {call.type!r:.40}', "literal_error"
        )
    for part in ("name", "arguments"):
        if not call.function.HasField(part):
            found.add(
                (*loc, "function", part), f"a tool call needs its function's {part}", "missing"
            )


def check_tools(request: CreateChatCompletionRequest, found: Violations) -> None:
    """A tool needs its function's name (vLLM's request model reads it before checking)."""
    for index, tool in enumerate(request.tools):
        if not tool.function.name:
            found.add(("tools", index, "function", "name"), "a tool needs a name", "missing")


def chat_constraint_sizes(request: CreateChatCompletionRequest) -> dict[str, int]:
    """The constraints' sizes, and the tools' (their schemas constrain the output too)."""
    sizes = constraint_sizes(request)
    tools = sum(tool.ByteSize() for tool in request.tools)
    return {**sizes, "tools": tools} if tools else sizes


def chat_constraint_field(request: CreateChatCompletionRequest) -> str | None:
    """The field whose constraint the reply follows, if any: a guided_* field or
    response_format, else the tools when a call of one is forced (their schemas constrain)."""
    field = constraint_field(request)
    if field is not None or not request.tools:
        return field
    choice = request.tool_choice
    forced = choice.WhichOneof("kind") == "struct_value" or choice.string_value == "required"
    return "tools" if forced else None


def vllm_request(request: CreateChatCompletionRequest, request_id: str) -> ChatCompletionRequest:
    """vLLM's chat request for ours: the same JSON, with guided_* as vLLM's structured outputs
    and usage always asked of a stream (the request's log line counts its tokens)."""
    body: dict[str, Any] = json_format.MessageToDict(request, preserving_proto_field_name=True)
    for name in OURS_ONLY:
        body.pop(name, None)
    for message, given in zip(body.get("messages", []), request.messages, strict=True):
        if message.pop("parts", None) is not None:
            message["content"] = message_content(given)
    # JSON schemas with their whole numbers as integers again (a Struct holds doubles).
    for tool, given in zip(body.get("tools", []), request.tools, strict=True):
        if given.function.HasField("parameters"):
            tool["function"]["parameters"] = json_value(given.function.parameters)
    if request.HasField("response_format") and request.response_format.HasField("json_schema"):
        body["response_format"]["json_schema"]["schema"] = json_value(
            request.response_format.json_schema.schema
        )
    if any(request.HasField(name) for name in GUIDED_FIELDS):
        constraint = structured_outputs(request)
        if constraint is not None:
            body["structured_outputs"] = {
                key: value
                for key, value in dataclasses.asdict(constraint).items()
                if value not in (None, False)
            }
    if request.stream:
        body["stream_options"] = {**body.get("stream_options", {}), "include_usage": True}
    body["request_id"] = request_id
    built = ChatCompletionRequest.model_validate(body)
    materialize_contents(built)
    return built


def materialize_contents(request: ChatCompletionRequest) -> None:
    """Each message's content parts validated now, located under their message, rather than
    while vLLM renders the conversation (pydantic validates an iterable lazily, and its error
    then names the part's index alone)."""
    for index, message in enumerate(request.messages):
        content = message.get("content") if isinstance(message, dict) else None
        if content is None or isinstance(content, (str, list)):
            continue
        try:
            message["content"] = list(content)  # type: ignore[call-overload,arg-type]
        except pydantic.ValidationError as error:
            raise RequestValidationError(
                pydantic_violations(error, ("messages", index, "content"))
            ) from error


def conversation_of(request: TokenizeRequest) -> CreateChatCompletionRequest:
    """A Tokenize request's conversation as the chat request that would render it."""
    conversation = CreateChatCompletionRequest(
        model=request.model,
        messages=request.messages,
        tools=request.tools,
        chat_template_kwargs=request.chat_template_kwargs,
    )
    for name in ("add_generation_prompt", "continue_final_message"):
        if request.HasField(name):
            setattr(conversation, name, getattr(request, name))
    if not request.HasField("chat_template_kwargs"):
        conversation.ClearField("chat_template_kwargs")
    return conversation
