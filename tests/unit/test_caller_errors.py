"""service/api/caller_errors.py: what building a request raises for its caller's input is a 4xx
naming the field, on both methods; what fails once the engine has it stays a server fault."""

from __future__ import annotations

import asyncio
import contextvars
from typing import Any

import grpc
import jinja2
import pydantic
import pytest
from google.protobuf import json_format
from llmcompletions.v2.completions_pb2 import CreateChatCompletionRequest
from unit_fakes import (
    MODEL,
    VOCAB_SIZE,
    StandInEngine,
    completion_output,
    make_request,
    request_output,
    run_until_engine,
    served_model,
)
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.serve.engine.protocol import ErrorInfo, ErrorResponse
from vllm.exceptions import (
    GenerationError,
    QueueOverflowError,
    VLLMNotFoundError,
    VLLMUnprocessableEntityError,
    VLLMValidationError,
)
from vllm.v1.engine.exceptions import EngineDeadError, EngineGenerateError

from service.api.backlog import Backlog
from service.api.caller_errors import (
    EngineSideError,
    building_request,
    engine_has_request,
    error_from,
)
from service.api.chat import CALL_CONSTRAINT, CatalogChat
from service.api.chat_requests import chat_constraint_field, validate_chat_request, vllm_request
from service.api.completions import CompletionHandler
from service.api.errors import CompletionError, Loc, ModelNotFoundError, http_status
from service.api.media.addresses import HostRules
from service.api.media.parts import MediaPolicy
from service.settings import RequestLimits
from service.transport.rest_bridge import error_body

HI = [{"role": "user", "content": "Hi"}]
TEXT_ONLY = MediaPolicy(takes_media=False, images_per_prompt=0, rules=HostRules())
TOOL = {"type": "function", "function": {"name": "get_weather"}}


def built_chat_request(**fields: Any) -> ChatCompletionRequest:
    """A chat request built as the chat handler builds it: validated, then vLLM's."""
    request = json_format.ParseDict(
        {"model": MODEL, "messages": HI, **fields}, CreateChatCompletionRequest()
    )
    with building_request():
        validate_chat_request(request, VOCAB_SIZE, "xgrammar", RequestLimits(), TEXT_ONLY)
        return vllm_request(request, "req")


def refusal(**fields: Any) -> CompletionError:
    with pytest.raises(CompletionError) as raised:
        built_chat_request(**fields)
    return raised.value


def locs(error: CompletionError) -> list[Loc]:
    return [violation.loc for violation in error.violations]


def test_tool_choice_without_tools_is_a_422_naming_tool_choice() -> None:
    # The reported 500: vLLM's request model raised VLLMValidationError, which nothing caught.
    error = refusal(tool_choice="auto")
    assert http_status(error.grpc_code) == 422
    assert error_body(error)["detail"] == [
        {
            "loc": ["body", "tool_choice"],
            "msg": "When using `tool_choice`, `tools` must be set. (parameter=tool_choice)",
            "type": "value_error",
        }
    ]


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"tool_choice": "bogus", "tools": [TOOL]}, ("tool_choice",)),
        (
            {"tool_choice": {"type": "function", "function": {"name": "other"}}, "tools": [TOOL]},
            ("tool_choice",),
        ),
        (
            {"tool_choice": {"type": "function", "function": {}}, "tools": [TOOL]},
            ("tool_choice", "function", "name"),
        ),
        ({"top_logprobs": 3}, ("top_logprobs",)),
        # vLLM names no field: the body as a whole.
        ({"continue_final_message": True, "add_generation_prompt": True}, ()),
        (
            {
                "tool_choice": {"type": "function", "function": TOOL["function"]},
                "tools": [TOOL],
                "guided_regex": "a",
            },
            (),
        ),
    ],
)
def test_vllms_request_model_refusals_name_its_field(fields: dict[str, Any], loc: Loc) -> None:
    error = refusal(**fields)
    assert error.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
    assert locs(error) == [loc]


def test_a_refusal_naming_no_field_is_located_at_the_body() -> None:
    error = refusal(continue_final_message=True, add_generation_prompt=True)
    assert error_body(error)["detail"][0]["loc"] == ["body"]
    assert error.message.startswith("invalid request: Cannot set both")


def test_a_tool_without_a_name_is_refused_before_vllm_reads_it() -> None:
    # vLLM's validator would index the missing name: a KeyError.
    error = refusal(tool_choice=TOOL, tools=[{"type": "function", "function": {}}])
    assert locs(error) == [("tools", 0, "function", "name")]


def test_a_conversations_tool_call_needs_its_parts() -> None:
    messages = [*HI, {"role": "assistant", "tool_calls": [{"function": {"name": "f"}}]}]
    at = ("messages", 1, "tool_calls", 0)
    assert locs(refusal(messages=messages)) == [
        (*at, "id"),
        (*at, "type"),
        (*at, "function", "arguments"),
    ]


def test_content_parts_are_validated_under_their_message() -> None:
    # Validated lazily by pydantic, their error would name the part's index alone, and only
    # while vLLM renders the conversation.
    messages = [*HI, {"role": "user", "content": [{"type": "text"}]}]
    error = refusal(messages=messages)
    assert error.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
    assert all(loc[:4] == ("messages", 1, "content", 0) for loc in locs(error)), locs(error)


def test_valid_content_parts_reach_vllm_as_a_list() -> None:
    built = built_chat_request(
        messages=[{"role": "user", "content": [{"type": "text", "text": "a"}]}]
    )
    assert built.messages[0]["content"] == [{"type": "text", "text": "a"}]


def a_pydantic_error() -> pydantic.ValidationError:
    with pytest.raises(pydantic.ValidationError) as raised:
        ChatCompletionRequest.model_validate({"model": MODEL, "messages": HI, "n": "many"})
    return raised.value


@pytest.mark.parametrize(
    ("raised", "code", "loc"),
    [
        (
            VLLMValidationError("bad", parameter="tool_choice.function.name"),
            "INVALID_ARGUMENT",
            ("tool_choice", "function", "name"),
        ),
        (VLLMValidationError("bad"), "INVALID_ARGUMENT", ()),
        (
            VLLMUnprocessableEntityError("no image there", parameter="messages"),
            "INVALID_ARGUMENT",
            ("messages",),
        ),
        (
            VLLMValidationError("This model's maximum context length is 2048 tokens. However, ..."),
            "OUT_OF_RANGE",
            None,
        ),
        (VLLMNotFoundError("no such adapter"), "NOT_FOUND", None),
        (ValueError("not a multimodal model"), "INVALID_ARGUMENT", ()),
        (TypeError("'float' object is not iterable"), "INVALID_ARGUMENT", ()),
        (OverflowError("int too large"), "INVALID_ARGUMENT", ()),
        (KeyError("function"), "INVALID_ARGUMENT", ()),
        (RecursionError("maximum recursion depth exceeded"), "INVALID_ARGUMENT", ()),
        (jinja2.TemplateError("roles must alternate"), "INVALID_ARGUMENT", ()),
        (a_pydantic_error(), "INVALID_ARGUMENT", ("n",)),
    ],
)
def test_what_the_input_raises_while_built_is_the_callers(
    raised: Exception, code: str, loc: Loc | None
) -> None:
    with pytest.raises(CompletionError) as caught, building_request():
        raise raised
    assert caught.value.grpc_code.name == code
    assert http_status(caught.value.grpc_code) < 500
    if loc is not None:
        assert locs(caught.value) == [loc]
    assert caught.value.__cause__ is raised


def test_messages_lose_the_servers_paths() -> None:
    with pytest.raises(CompletionError) as caught, building_request():
        raise ValueError("/root/.cache/llm-completions/models/m is not a multimodal model")
    assert "/root" not in caught.value.message
    assert "is not a multimodal model" in caught.value.message


@pytest.mark.parametrize(
    "raised",
    [
        RuntimeError("a fault of ours"),
        EngineGenerateError(),
        EngineDeadError(),
        QueueOverflowError(),  # the backlog's, mapped by the handler (429)
        ModelNotFoundError("m", [MODEL]),  # already the API's
    ],
)
def test_other_errors_pass_unchanged(raised: Exception) -> None:
    with pytest.raises(type(raised)) as caught, building_request():
        raise raised
    assert caught.value is raised


def test_once_the_engine_has_the_request_a_value_error_is_a_server_fault() -> None:
    with pytest.raises(EngineSideError), building_request(), engine_has_request():
        raise ValueError("a tool parser failed on the model's output")


def test_the_engines_check_of_a_request_is_still_the_callers() -> None:
    with pytest.raises(CompletionError) as caught, building_request(), engine_has_request():
        raise VLLMValidationError("bad regex", parameter="guided_regex")
    assert locs(caught.value) == [("guided_regex",)]


@pytest.mark.parametrize(
    ("status", "code"),
    [
        (400, "INVALID_ARGUMENT"),
        (422, "INVALID_ARGUMENT"),  # was INTERNAL
        (404, "NOT_FOUND"),
        (429, "RESOURCE_EXHAUSTED"),
        (503, "UNAVAILABLE"),
        (500, "INTERNAL"),
        (501, "INTERNAL"),
    ],
)
def test_vllms_error_responses_by_status(status: int, code: str) -> None:
    response = ErrorResponse(
        error=ErrorInfo(message="m", type="t", code=status, param="chat_template")
    )
    assert error_from(response).grpc_code.name == code


class FailingEngine(StandInEngine):
    """An engine that ends every request with finish_reason "error", as vLLM's does when a
    grammar does not compile or allows none of the model's tokens."""

    def generate(self, prompt: Any, params: Any, request_id: str, **options: Any) -> Any:
        async def outputs() -> Any:
            yield request_output(
                [completion_output([], finish_reason="error")], request_id=request_id
            )

        return outputs()


def completion_on_failing_engine(**fields: Any) -> CompletionError | None:
    model = served_model(FailingEngine())
    handler = CompletionHandler(model, RequestLimits(), Backlog(model.engine, model.capacity))
    try:
        asyncio.run(run_until_engine(handler, make_request(max_tokens=2, **fields)))
    except CompletionError as error:
        return error
    finally:
        handler.tokenizing.shutdown()
    return None


def test_a_constraint_the_engine_cannot_follow_is_a_422_naming_it() -> None:
    # vLLM's server answers 500 (its GenerationError); the constraint is the caller's.
    error = completion_on_failing_engine(guided_grammar="root ::= root")
    assert error is not None and error.grpc_code == grpc.StatusCode.INVALID_ARGUMENT
    assert locs(error) == [("guided_grammar",)]


def test_an_unconstrained_engine_failure_is_not_blamed_on_the_caller() -> None:
    assert completion_on_failing_engine() is None  # the reply says finish_reason "error"


@pytest.mark.parametrize(
    ("fields", "field"),
    [
        ({}, None),
        ({"guided_regex": "a+"}, "guided_regex"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"tools": [TOOL]}, None),  # tool_choice auto: the reply is free
        ({"tools": [TOOL], "tool_choice": "required"}, "tools"),
        ({"tools": [TOOL], "tool_choice": TOOL}, "tools"),
    ],
)
def test_the_chat_constraint_field(fields: dict[str, Any], field: str | None) -> None:
    request = json_format.ParseDict(
        {"model": MODEL, "messages": HI, **fields}, CreateChatCompletionRequest()
    )
    assert chat_constraint_field(request) == field


def test_vllms_chat_failure_of_a_constrained_reply_names_the_constraint() -> None:
    serving = CatalogChat.__new__(CatalogChat)  # _raise_if_error reads nothing of it

    def fail_constrained() -> None:
        CALL_CONSTRAINT.set("guided_json")
        serving._raise_if_error("error", "chatcmpl-1")

    with pytest.raises(VLLMValidationError) as raised:
        contextvars.copy_context().run(fail_constrained)
    assert raised.value.parameter == "guided_json"
    with pytest.raises(GenerationError):  # unconstrained: the engine's failure, a 500
        serving._raise_if_error("error", "chatcmpl-1")
    serving._raise_if_error("stop", "chatcmpl-1")
