"""What another service gets from installing the package: stubs with types, a typed client."""

from __future__ import annotations

import asyncio
import importlib.resources
import json

import grpc
import pytest
from llmcompletions.client import AsyncCompletionClient, CompletionClient

from tests.conftest import API_KEY, MODEL
from tests.helpers import CAPITAL_PROMPT
from tests.processes import TestStack


def test_generated_modules_ship_with_type_stubs() -> None:
    package = importlib.resources.files("llmcompletions")
    assert (package / "py.typed").is_file()
    assert (package / "v2" / "completions_pb2.pyi").is_file()
    from llmcompletions.v2 import completions_pb2, completions_pb2_grpc

    assert completions_pb2_grpc.CompletionServiceStub
    assert completions_pb2.CreateCompletionRequest(model="m").model == "m"


def test_sync_client_completes_and_streams(stack: TestStack) -> None:
    with CompletionClient(stack.grpc_target, api_key=API_KEY) as client:
        whole = client.complete(model=MODEL, prompt=CAPITAL_PROMPT, max_tokens=6, temperature=0)
        assert whole.choices[0].text.startswith(" Paris")
        chunks = list(
            client.stream(
                model=MODEL,
                prompt=CAPITAL_PROMPT,
                max_tokens=6,
                temperature=0,
                metadata=[("x-request-id", "client-test")],
            )
        )
        assert "".join(chunk.choices[0].text for chunk in chunks) == whole.choices[0].text


def test_sync_client_deadline_and_errors(stack: TestStack) -> None:
    with CompletionClient(stack.grpc_target, api_key=API_KEY) as client:
        with pytest.raises(grpc.RpcError) as raised:
            client.complete(
                model=MODEL, prompt="Count:", max_tokens=1000, ignore_eos=True, timeout=0.5
            )
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        with pytest.raises(grpc.RpcError) as raised:
            client.complete(model=MODEL, prompt="Hi", temperature=7)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with CompletionClient(stack.grpc_target) as keyless, pytest.raises(grpc.RpcError) as raised:
        keyless.complete(model=MODEL, prompt="Hi")
    assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_async_client_completes_and_streams(stack: TestStack) -> None:
    async def run() -> tuple[str, str]:
        async with AsyncCompletionClient(stack.grpc_target, api_key=API_KEY) as client:
            whole = await client.complete(
                model=MODEL, prompt=CAPITAL_PROMPT, max_tokens=6, temperature=0, timeout=60
            )
            streamed = [
                chunk.choices[0].text
                async for chunk in client.stream(
                    model=MODEL, prompt=CAPITAL_PROMPT, max_tokens=6, temperature=0
                )
            ]
            return whole.choices[0].text, "".join(streamed)

    whole, streamed = asyncio.run(run())
    assert whole.startswith(" Paris") and streamed == whole


CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "What is the capital of France?"}]}


def test_clients_chat_whole_and_streamed_alike(stack: TestStack) -> None:
    with CompletionClient(stack.grpc_target, api_key=API_KEY) as client:
        whole = client.chat(**CHAT, max_completion_tokens=12, temperature=0)
        chunks = list(client.chat_stream(**CHAT, max_completion_tokens=12, temperature=0))

    async def run() -> str:
        async with AsyncCompletionClient(stack.grpc_target, api_key=API_KEY) as client:
            reply = await client.chat(**CHAT, max_completion_tokens=12, temperature=0)
            streamed = [
                chunk.choices[0].delta.content
                async for chunk in client.chat_stream(
                    **CHAT, max_completion_tokens=12, temperature=0
                )
                if chunk.choices
            ]
            assert "".join(streamed) == reply.choices[0].message.content
            return reply.choices[0].message.content

    content = whole.choices[0].message.content
    assert "Paris" in content and whole.object == "chat.completion"
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content for c in chunks if c.choices) == content
    assert asyncio.run(run()) == content


def test_clients_cancel_a_stream_by_its_request_id(stack: TestStack) -> None:
    request_id = "client-cancel-test"
    with CompletionClient(stack.grpc_target, api_key=API_KEY) as client:
        chunks = client.stream(
            model=MODEL,
            prompt="Count:",
            max_tokens=1000,
            ignore_eos=True,
            metadata=[("x-request-id", request_id)],
        )
        next(chunks)
        assert client.cancel(request_id).cancelled == 1
        with pytest.raises(grpc.RpcError) as raised:
            list(chunks)
        assert raised.value.code() == grpc.StatusCode.CANCELLED

    async def unknown() -> grpc.StatusCode:
        async with AsyncCompletionClient(stack.grpc_target, api_key=API_KEY) as client:
            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await client.cancel("nobody-sent-this")
            return raised.value.code()

    assert asyncio.run(unknown()) == grpc.StatusCode.NOT_FOUND


def test_json_objects_keep_the_callers_key_order(stack: TestStack) -> None:
    """A schema's properties come back in the order the caller wrote them, as over REST:
    the client writes each JSON object's keys in order (protobuf alone writes hash order)."""
    # Five keys: 120 orders, so that the right one does not come by chance.
    # (Bounded strings: the small model's integers can run past any token budget.)
    short = {"type": "string", "maxLength": 20}
    properties = {key: short for key in ("people", "city", "river", "country", "area")}
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    with CompletionClient(stack.grpc_target, api_key=API_KEY) as client:
        reply = client.chat(
            model=MODEL,
            messages=[{"role": "user", "content": "What is the capital of France?"}],
            temperature=0,
            max_completion_tokens=160,
            response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        )
        completion = client.complete(
            model=MODEL,
            prompt="A city as JSON: ",
            max_tokens=160,
            temperature=0,
            guided_json=schema,
        )
    for text, finish_reason in (
        (reply.choices[0].message.content, reply.choices[0].finish_reason),
        (completion.choices[0].text, completion.choices[0].finish_reason),
    ):
        assert finish_reason == "stop", text
        assert list(json.loads(text)) == list(properties)
