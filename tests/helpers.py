"""Small clients for the two surfaces, so tests read like the calls users make."""

from __future__ import annotations

import json
from typing import Any

import httpx
from google.protobuf import json_format
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateCompletionRequest, CreateCompletionResponse

from tests.conftest import GRPC_AUTH, MODEL

CAPITAL_PROMPT = "The capital of France is"


def body(**fields: Any) -> dict[str, Any]:
    """A request body for the served model; greedy unless the test says otherwise."""
    return {"model": MODEL, "temperature": 0, **fields}


def post(rest: httpx.Client, payload: dict[str, Any]) -> httpx.Response:
    return rest.post("/v2/completions", json=payload)


def complete(rest: httpx.Client, **fields: Any) -> dict[str, Any]:
    response = post(rest, body(**fields))
    assert response.status_code == 200, response.text
    assert response.headers["content-type"].startswith("application/json")
    return response.json()


def stream_events(rest: httpx.Client, **fields: Any) -> list[str]:
    """The `data:` payloads of a streamed completion, in order, `[DONE]` included."""
    events = []
    with rest.stream("POST", "/v2/completions", json=body(stream=True, **fields)) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        for line in response.iter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
            else:
                assert line == "", f"unexpected line in the event stream: {line!r}"
    return events


def stream_chunks(rest: httpx.Client, **fields: Any) -> list[dict[str, Any]]:
    """The JSON chunks of a streamed completion; asserts it ended with `[DONE]`."""
    events = stream_events(rest, **fields)
    assert events[-1] == "[DONE]"
    return [json.loads(event) for event in events[:-1]]


def streamed_texts(chunks: list[dict[str, Any]]) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    return texts


def grpc_request(**fields: Any) -> CreateCompletionRequest:
    """The same JSON body as a gRPC request message."""
    return json_format.ParseDict(body(**fields), CreateCompletionRequest())


def grpc_complete(
    stub: completions_pb2_grpc.CompletionServiceStub, **fields: Any
) -> list[CreateCompletionResponse]:
    return list(stub.CreateCompletion(grpc_request(**fields), timeout=120, metadata=GRPC_AUTH))
