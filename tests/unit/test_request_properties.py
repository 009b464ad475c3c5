"""Property: whatever request protobuf can carry, building it ends in a 4xx naming what is wrong
or reaches the engine; never a 500, never an exception the API does not know.

Bodies come from the proto's descriptors (tests/request_strategies.py). The real handlers run
them, completion and chat, through validation and vLLM's request building up to the engine,
which is a stand-in here; so is the part of vLLM's chat serving that needs the model's files
(rendering), the rest of its building (SamplingParams from its ChatCompletionRequest) runs.
A short budget (a few seconds); tests/test_fuzz.py runs the same bodies on a real replica.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any
from unittest import mock

import pytest
from google.protobuf import json_format
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llmcompletions.v2.completions_pb2 import (
    CreateChatCompletionRequest,
    CreateCompletionRequest,
)
from unit_fakes import MAX_MODEL_LEN, MODEL, ReachedEngine, run_until_engine, served_model
from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

from service.api.backlog import Backlog
from service.api.chat import ChatHandler
from service.api.completions import CompletionHandler
from service.api.errors import CompletionError, InternalError, http_status
from service.settings import ChatSettings, RequestLimits
from tests.request_strategies import chat_bodies, completion_bodies

EXAMPLES = 150
BUILDING = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
RENDERED_PROMPT_TOKENS = 5  # what the stand-in chat serving takes a conversation to render to


class StandInChatServing:
    """vLLM's chat serving as far as it goes without the model's files: the conversation taken
    as rendered, then the sampling parameters built as vLLM builds them."""

    async def create_chat_completion(self, request: ChatCompletionRequest, raw: Any) -> Any:
        max_tokens = get_max_tokens(
            MAX_MODEL_LEN,
            request.max_completion_tokens
            if request.max_completion_tokens is not None
            else request.max_tokens,
            RENDERED_PROMPT_TOKENS,
            {},
            truncate_prompt_tokens=request.truncate_prompt_tokens,
        )
        request.build_chat_params(None, "auto")
        if request.use_beam_search:
            request.to_beam_search_params(max_tokens, {})
        else:
            request.to_sampling_params(max_tokens, {})
        raise ReachedEngine


Handlers = tuple[CompletionHandler, ChatHandler]


@pytest.fixture(scope="module")
def handlers() -> Iterator[Handlers]:
    model = served_model()
    backlog = Backlog(model.engine, model.capacity)
    completions = CompletionHandler(model, RequestLimits(), backlog)
    with mock.patch("service.api.chat.chat_serving", return_value=StandInChatServing()):
        chat = ChatHandler(model, RequestLimits(), backlog, ChatSettings())
    yield completions, chat
    completions.tokenizing.shutdown()


def check_built_or_refused(handler: CompletionHandler | ChatHandler, request: Message) -> None:
    """The request reaches the engine, or is refused with a 4xx naming what is wrong."""
    try:
        asyncio.run(run_until_engine(handler, request))
    except ReachedEngine:
        return
    except CompletionError as error:
        assert not isinstance(error, InternalError), error.message
        assert http_status(error.grpc_code) < 500, (error.grpc_code, error.message)


@BUILDING
@given(body=completion_bodies(MODEL, wrong_types=False))
def test_every_completion_request_is_built_or_refused_with_a_4xx(
    handlers: Handlers, body: dict[str, Any]
) -> None:
    request = json_format.ParseDict(body, CreateCompletionRequest())
    check_built_or_refused(handlers[0], request)


@BUILDING
@given(body=chat_bodies(MODEL, wrong_types=False))
def test_every_chat_request_is_built_or_refused_with_a_4xx(
    handlers: Handlers, body: dict[str, Any]
) -> None:
    request = json_format.ParseDict(body, CreateChatCompletionRequest())
    check_built_or_refused(handlers[1], request)


def test_the_bodies_reach_the_engine_as_well_as_refusals(handlers: Handlers) -> None:
    """The bodies are not all refused early: on both methods some get to the engine."""
    outcomes: dict[str, set[str]] = {"completion": set(), "chat": set()}

    @settings(max_examples=40, deadline=None, derandomize=True, database=None)
    @given(st.data())
    def sample(data: st.DataObject) -> None:
        for name, strategy, message, handler in (
            ("completion", completion_bodies, CreateCompletionRequest, handlers[0]),
            ("chat", chat_bodies, CreateChatCompletionRequest, handlers[1]),
        ):
            request = json_format.ParseDict(data.draw(strategy(MODEL, False)), message())
            try:
                asyncio.run(run_until_engine(handler, request))
            except ReachedEngine:
                outcomes[name].add("engine")
            except CompletionError as error:
                outcomes[name].add(error.grpc_code.name)

    sample()
    for name, seen in outcomes.items():
        assert {"engine", "INVALID_ARGUMENT"} <= seen, (name, seen)
