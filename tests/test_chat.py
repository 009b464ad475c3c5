"""Chat completions on both surfaces, against vLLM's own `/v1/chat/completions` on the same
model and flags (`--tool-call-parser hermes --enable-auto-tool-choice`): the same content,
tool calls, log-probabilities and usage, whole and streamed, and the same refusals."""

from __future__ import annotations

import json
import math
import subprocess
from typing import Any

import grpc
import httpx
import openai
import pytest
from google.protobuf import json_format
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateChatCompletionRequest

from tests.conftest import API_KEY, GRPC_AUTH, MODEL
from tests.fault_injection import fault_request_id
from tests.image_server import ImageServer
from tests.metrics import sample
from tests.processes import TestStack
from tests.test_grpc_tooling import GRPCURL

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
CONVERSATIONS = {
    "one question": CAPITAL,
    "system and turns": [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": [{"type": "text", "text": "Name another one."}]},
    ],
}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}},
    },
}
WEATHER_QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


def chat_body(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": messages, "temperature": 0, **fields}


def ours(rest: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = rest.post("/v2/chat/completions", json=body)
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


def theirs(vllm_server: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{vllm_server}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def stream_events(client: httpx.Client, url: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    """The JSON events of a streamed chat reply; asserts it ended with `[DONE]`."""
    events = []
    with client.stream("POST", url, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    for payload in payloads[:-1]:
        events.append(json.loads(payload))
    return events


def usage_counts(reply: dict[str, Any]) -> tuple[int, int, int]:
    usage = reply["usage"]
    return usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]


def tool_calls(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The calls of a reply message: each function's name and its parsed arguments."""
    return [
        (call["function"]["name"], json.loads(call["function"]["arguments"]))
        for call in message.get("tool_calls") or []
    ]


def streamed_reply(events: list[dict[str, Any]]) -> dict[str, Any]:
    """What the deltas of choice 0 add up to: role, content, tool calls (name first, then the
    argument fragments), finish reasons, and the usage chunk."""
    reply: dict[str, Any] = {"content": "", "calls": {}, "finish_reasons": [], "roles": []}
    for event in events:
        if event.get("usage") and not event["choices"]:
            reply["usage"] = event["usage"]
        for choice in event["choices"]:
            delta = choice.get("delta") or {}
            if delta.get("role"):
                reply["roles"].append(delta["role"])
            reply["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = reply["calls"].setdefault(call.get("index", 0), {"name": "", "args": ""})
                function = call.get("function") or {}
                if function.get("name"):
                    assert not entry["args"], "the name comes before the arguments"
                    entry["name"] = function["name"]
                entry["args"] += function.get("arguments") or ""
            if choice.get("finish_reason"):
                reply["finish_reasons"].append(choice["finish_reason"])
    return reply


@pytest.mark.parametrize("messages", CONVERSATIONS.values(), ids=CONVERSATIONS.keys())
def test_greedy_replies_equal_vllm(
    rest: httpx.Client, vllm_server: str, messages: list[dict[str, Any]]
) -> None:
    body = chat_body(messages, max_completion_tokens=24)
    mine, peer = ours(rest, body), theirs(vllm_server, body)
    assert mine["object"] == "chat.completion" and mine["id"].startswith("chatcmpl-")
    assert mine["model"] == MODEL and mine["system_fingerprint"]
    assert mine["choices"][0]["message"]["role"] == "assistant"
    assert mine["choices"][0]["message"]["content"] == peer["choices"][0]["message"]["content"]
    assert mine["choices"][0]["finish_reason"] == peer["choices"][0]["finish_reason"]
    assert usage_counts(mine) == usage_counts(peer)


def test_a_stream_adds_up_to_the_whole_reply(rest: httpx.Client, vllm_server: str) -> None:
    body = chat_body(CAPITAL, max_completion_tokens=24)
    events = stream_events(
        rest, "/v2/chat/completions", {**body, "stream_options": {"include_usage": True}}
    )
    reply = streamed_reply(events)
    whole = ours(rest, body)
    assert all(event["object"] == "chat.completion.chunk" for event in events)
    assert reply["roles"] == ["assistant"]  # on the first chunk only
    assert reply["content"] == whole["choices"][0]["message"]["content"]
    assert reply["finish_reasons"] == [whole["choices"][0]["finish_reason"]]
    assert usage_counts({"usage": reply["usage"]}) == usage_counts(whole)
    peer = streamed_reply(
        stream_events(httpx.Client(timeout=120), f"{vllm_server}/v1/chat/completions", body)
    )
    assert reply["content"] == peer["content"]


def test_logprobs_equal_vllm(rest: httpx.Client, vllm_server: str) -> None:
    body = chat_body(CAPITAL, max_completion_tokens=8, logprobs=True, top_logprobs=3)
    mine = ours(rest, body)["choices"][0]["logprobs"]["content"]
    peer = theirs(vllm_server, body)["choices"][0]["logprobs"]["content"]
    assert [entry["token"] for entry in mine] == [entry["token"] for entry in peer]
    for ours_entry, their_entry in zip(mine, peer, strict=True):
        assert math.isclose(ours_entry["logprob"], their_entry["logprob"], abs_tol=1e-4)
        assert ours_entry["bytes"] == their_entry["bytes"]
        assert [top["token"] for top in ours_entry["top_logprobs"]] == [
            top["token"] for top in their_entry["top_logprobs"]
        ]
        for a, b in zip(ours_entry["top_logprobs"], their_entry["top_logprobs"], strict=True):
            assert math.isclose(a["logprob"], b["logprob"], abs_tol=1e-4)


def test_n_choices_with_a_seed_equal_vllm(rest: httpx.Client, vllm_server: str) -> None:
    body = chat_body(CAPITAL, max_completion_tokens=12, n=3, seed=11, temperature=1.0)
    mine, peer = ours(rest, body), theirs(vllm_server, body)
    contents = [choice["message"]["content"] for choice in mine["choices"]]
    assert [choice["index"] for choice in mine["choices"]] == [0, 1, 2]
    assert contents == [choice["message"]["content"] for choice in peer["choices"]]
    assert usage_counts(mine) == usage_counts(peer)


def test_continue_final_message_equals_vllm(rest: httpx.Client, vllm_server: str) -> None:
    messages = [*CAPITAL, {"role": "assistant", "content": "The capital of France is"}]
    body = chat_body(
        messages, max_completion_tokens=8, add_generation_prompt=False, continue_final_message=True
    )
    mine, peer = ours(rest, body), theirs(vllm_server, body)
    assert mine["choices"][0]["message"]["content"] == peer["choices"][0]["message"]["content"]
    assert usage_counts(mine) == usage_counts(peer)


def test_a_json_schema_response_format_equals_vllm_and_parses(
    rest: httpx.Client, vllm_server: str
) -> None:
    # Properties in an order of the caller's own: the reply writes them in it, as vLLM's does.
    properties = {
        "people": {"type": "integer"},
        "city": {"type": "string", "maxLength": 20},
        "country": {"type": "string", "maxLength": 20},
    }
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    body = chat_body(
        CAPITAL,
        max_completion_tokens=64,
        response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema}},
    )
    mine, peer = ours(rest, body), theirs(vllm_server, body)
    content = mine["choices"][0]["message"]["content"]
    assert content == peer["choices"][0]["message"]["content"]
    assert mine["choices"][0]["finish_reason"] == "stop", content
    assert list(json.loads(content)) == list(properties)


TOOL_CHOICES = {
    "named": {"type": "function", "function": {"name": "get_weather"}},
    "required": "required",
}


@pytest.mark.parametrize("tool_choice", TOOL_CHOICES.values(), ids=TOOL_CHOICES.keys())
def test_forced_tool_calls_equal_vllm_whole_and_streamed(
    rest: httpx.Client, vllm_server: str, tool_choice: Any
) -> None:
    body = chat_body(
        WEATHER_QUESTION,
        max_completion_tokens=64,
        tools=[WEATHER_TOOL, TIME_TOOL],
        tool_choice=tool_choice,
    )
    mine, peer = ours(rest, body), theirs(vllm_server, body)
    message = mine["choices"][0]["message"]
    assert tool_calls(message) == tool_calls(peer["choices"][0]["message"])
    assert tool_calls(message), "a forced tool choice makes a call"
    assert all(call["id"] and call["type"] == "function" for call in message["tool_calls"])
    assert mine["choices"][0]["finish_reason"] == peer["choices"][0]["finish_reason"]
    streamed = streamed_reply(stream_events(rest, "/v2/chat/completions", body))
    assert [(c["name"], json.loads(c["args"])) for c in streamed["calls"].values()] == (
        tool_calls(message)
    )
    assert streamed["finish_reasons"] == [mine["choices"][0]["finish_reason"]]


def test_a_tool_result_round_trip_equals_vllm(rest: httpx.Client, vllm_server: str) -> None:
    messages = [
        *WEATHER_QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"celsius": 21, "sky": "clear"}'},
    ]
    body = chat_body(messages, max_completion_tokens=32, tools=[WEATHER_TOOL])
    mine, peer = ours(rest, body), theirs(vllm_server, body)
    assert mine["choices"][0]["message"].get("content") == peer["choices"][0]["message"].get(
        "content"
    )
    assert usage_counts(mine) == usage_counts(peer)


def test_token_ids_equal_vllm(rest: httpx.Client, vllm_server: str) -> None:
    body = chat_body(CAPITAL, max_completion_tokens=8, return_token_ids=True)
    mine, peer = ours(rest, body), theirs(vllm_server, body)
    assert mine["prompt_token_ids"] == peer["prompt_token_ids"]
    assert mine["choices"][0]["token_ids"] == peer["choices"][0]["token_ids"]
    assert len(mine["prompt_token_ids"]) == mine["usage"]["prompt_tokens"]


BAD_REQUESTS = {
    "no messages": ({"messages": []}, 422, grpc.StatusCode.INVALID_ARGUMENT),
    "a bad role": (
        {"messages": [{"role": "robot", "content": "hi"}]},
        422,
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "temperature out of range": ({"temperature": 3}, 422, grpc.StatusCode.INVALID_ARGUMENT),
    "over the context": (
        {"messages": [{"role": "user", "content": "word " * 3000}]},
        400,
        grpc.StatusCode.OUT_OF_RANGE,
    ),
    "an unknown model": ({"model": "nope"}, 404, grpc.StatusCode.NOT_FOUND),
    "a request's own template": (
        {"chat_template": "{{ messages }}"},
        422,
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    # Refused by vLLM's request model (its VLLMValidationError), its renderer (a ValueError)
    # and its lazily validated content parts (pydantic's error, raised while rendering).
    "tool_choice without tools": ({"tool_choice": "auto"}, 422, grpc.StatusCode.INVALID_ARGUMENT),
    "continuing the final message after a generation prompt": (
        {"continue_final_message": True, "add_generation_prompt": True},
        422,
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "an image for a text-only model": (
        {
            "messages": [
                {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}
            ]
        },
        422,
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    "a text part without its text": (
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        422,
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
    # A grammar that admits nothing: the engine ends the request with finish_reason "error".
    "a constraint nothing satisfies": (
        {"guided_grammar": "root ::= root"},
        422,
        grpc.StatusCode.INVALID_ARGUMENT,
    ),
}


@pytest.mark.parametrize("fields", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_requests_are_refused_on_both_surfaces(
    rest: httpx.Client,
    grpc_stub: completions_pb2_grpc.CompletionServiceStub,
    fields: tuple[dict[str, Any], int, grpc.StatusCode],
) -> None:
    values, status, code = fields
    body = {**chat_body(CAPITAL, max_completion_tokens=4), **values}
    response = rest.post("/v2/chat/completions", json=body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    request = json_format.ParseDict(body, CreateChatCompletionRequest())
    with pytest.raises(grpc.RpcError) as raised:
        list(grpc_stub.CreateChatCompletion(request, timeout=60, metadata=GRPC_AUTH))
    assert raised.value.code() == code


def test_the_openai_sdk_chats_streams_and_calls_tools(openai_client: openai.OpenAI) -> None:
    plain = openai_client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_completion_tokens=16
    )
    assert "Paris" in (plain.choices[0].message.content or "")
    assert plain.usage is not None and plain.usage.prompt_tokens > 0
    stream = openai_client.chat.completions.create(
        model=MODEL, messages=CAPITAL, temperature=0, max_completion_tokens=16, stream=True
    )
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
    assert streamed == plain.choices[0].message.content
    called = openai_client.chat.completions.create(
        model=MODEL,
        messages=WEATHER_QUESTION,
        temperature=0,
        max_completion_tokens=64,
        tools=[WEATHER_TOOL],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    (call,) = called.choices[0].message.tool_calls or []
    assert call.function.name == "get_weather"
    json.loads(call.function.arguments)  # a JSON string (what the model chose is vLLM's call)


def test_tokenize_counts_a_conversation_as_the_chat_reply_does(rest: httpx.Client) -> None:
    body = chat_body(CONVERSATIONS["system and turns"], max_completion_tokens=2)
    counted = rest.post("/v2/tokenize", json={"model": MODEL, "messages": body["messages"]}).json()
    assert counted["count"] == ours(rest, body)["usage"]["prompt_tokens"]
    assert len(counted["tokens"]) == counted["count"]
    with_tools = rest.post(
        "/v2/tokenize",
        json={"model": MODEL, "messages": WEATHER_QUESTION, "tools": [WEATHER_TOOL]},
    ).json()
    asked = chat_body(WEATHER_QUESTION, max_completion_tokens=2, tools=[WEATHER_TOOL])
    assert with_tools["count"] == ours(rest, asked)["usage"]["prompt_tokens"]
    both = rest.post(
        "/v2/tokenize", json={"model": MODEL, "prompt": "Hi", "messages": WEATHER_QUESTION}
    )
    assert both.status_code == 422


def test_grpcurl_calls_the_chat_method(stack: TestStack) -> None:
    request = json.dumps(chat_body(CAPITAL, max_completion_tokens=8))
    called = subprocess.run(
        [
            GRPCURL,
            "-plaintext",
            "-H",
            f"authorization: Bearer {API_KEY}",
            "-d",
            request,
            stack.grpc_target,
            "llmcompletions.v2.CompletionService/CreateChatCompletion",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert called.returncode == 0, called.stderr
    reply = json.loads(called.stdout)
    assert reply["object"] == "chat.completion"
    assert "Paris" in reply["choices"][0]["message"]["content"]


def test_a_mid_stream_failure_is_an_error_event(rest: httpx.Client) -> None:
    body = chat_body(CAPITAL, max_completion_tokens=200, ignore_eos=True, stream=True)
    with rest.stream(
        "POST", "/v2/chat/completions", json=body, headers={"x-request-id": fault_request_id(3)}
    ) as response:
        assert response.status_code == 200
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line]
    assert events[-1] != "[DONE]"
    error = json.loads(events[-1])
    assert list(error) == ["error"]
    assert error["error"]["status_code"] == 500
    assert error["error"]["content"]["timestamp"]
    assert all("choices" in json.loads(event) for event in events[:-1])


def test_guided_fields_constrain_a_chat_reply_as_vllms_structured_outputs(
    rest: httpx.Client, vllm_server: str
) -> None:
    choices = ["Lyon", "Marseille", "Nice"]  # Paris, the likely answer, is not among them
    mine = ours(rest, chat_body(CAPITAL, max_completion_tokens=8, guided_choice=choices))
    peer = theirs(
        vllm_server,
        chat_body(CAPITAL, max_completion_tokens=8, structured_outputs={"choice": choices}),
    )
    content = mine["choices"][0]["message"]["content"]
    assert content in choices
    assert content == peer["choices"][0]["message"]["content"]


def test_chat_calls_are_counted_apart(rest: httpx.Client, metrics_url: str) -> None:
    chat_ok = {"method": "CreateChatCompletion", "code": "OK", "tenant": ""}
    before = sample(metrics_url, "llmcompletions_requests_total", **chat_ok)
    ours(rest, chat_body(CAPITAL, max_completion_tokens=2))
    assert sample(metrics_url, "llmcompletions_requests_total", **chat_ok) == before + 1


def test_an_image_for_a_text_only_model_is_refused_before_anything_is_fetched(
    rest: httpx.Client, grpc_stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    images = ImageServer().start()
    try:
        parts = [
            {"type": "image_url", "image_url": {"url": images.url("/red.png")}},
            {"type": "text", "text": "What is this?"},
        ]
        body = chat_body([{"role": "user", "content": parts}], max_completion_tokens=4)
        response = rest.post("/v2/chat/completions", json=body)
        assert response.status_code == 422, response.text
        (violation,) = response.json()["detail"]
        assert violation["loc"] == ["body", "messages", 0, "content", 0]
        assert MODEL in violation["msg"] and "text only" in violation["msg"]
        with pytest.raises(grpc.RpcError) as refused:
            request = json_format.ParseDict(body, CreateChatCompletionRequest())
            list(grpc_stub.CreateChatCompletion(request, metadata=GRPC_AUTH, timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert images.total() == 0
    finally:
        images.stop()
