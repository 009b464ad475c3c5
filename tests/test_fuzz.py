"""Hostile input, generated: malformed and extreme requests to REST and gRPC, and requests
built from the proto's fields (tests/request_strategies.py) for completions, chat and
tokenization, with values in and out of range, of wrong types and in refused combinations.

Every answer is a result or a 4xx with a JSON body (on gRPC: a status other than INTERNAL or
UNKNOWN; in a stream, no error event with a 5xx); no crash, no hang, and the service still
answers a normal request afterwards. Bounded in count (FUZZ_EXAMPLES and PROPERTY_EXAMPLES
each), derandomized, and in time (per-request timeouts, at most a few generated tokens).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import json_format
from google.protobuf.message import Message
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import (
    CreateChatCompletionRequest,
    CreateCompletionRequest,
    TokenizeRequest,
)

from tests.conftest import AUTH_HEADERS, GRPC_AUTH, MODEL
from tests.helpers import CAPITAL_PROMPT, complete
from tests.metrics import sample
from tests.processes import TestStack, lua_errors
from tests.request_strategies import chat_bodies, completion_bodies, tokenize_bodies

FUZZ_EXAMPLES = 150
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
# Requests from the proto's fields, per method and surface: about 60 s in all on 2 cores.
PROPERTY_EXAMPLES = 80
PROPERTY_SETTINGS = settings(FUZZ_SETTINGS, max_examples=PROPERTY_EXAMPLES, database=None)
ACCEPTED_REST = {200, 400, 404, 413, 422, 429}
# However long the values an error quotes, its body and its metadata stay small.
MAX_ERROR_BODY_BYTES = 4096
MAX_ERROR_METADATA_BYTES = 8192
REFUSED_GRPC = {grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN}
FIELDS = [
    field.name for field in CreateCompletionRequest.DESCRIPTOR.fields if field.name != "model"
]

extreme_numbers = st.sampled_from(
    [
        0,
        -1,
        1,
        2**31,
        -(2**31) - 1,
        2**63,
        -(2**63),
        2**64,
        1e308,
        -1e308,
        5e-324,
        0.5,
        49152,
        10**30,
    ]
)
json_scalars = (
    st.none()
    | st.booleans()
    | extreme_numbers
    | st.integers(-1000, 60000)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
    | st.sampled_from(["NaN", "Infinity", "-Infinity", "never", "json_object", "true"])
)
json_values = st.recursive(
    json_scalars,
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=12,
)
# Values an error message may quote: long, multi-byte, needing escapes.
long_texts = st.sampled_from(
    ["m" * 100_000, "\u00e9" * 50_000, "\u4e2d" * 40_000, '"\\' * 30_000, "\n\t" * 30_000]
)
hostile_values = long_texts | st.sampled_from(
    [
        "(a+)+$",
        "(.*a){25}",
        "[",
        "\\",
        "a{99999}",
        "(?<=a)b",
        {"$ref": "#"},
        {"type": "object", "properties": {"a": {"$ref": "#"}}},
        {"type": "array", "items": {"type": "array", "items": {"type": "array"}}},
        {"not": {}},
        {"type": "string", "pattern": "(a+)+$"},
        {"enum": []},
        {"-1": 5},
        {"abc": 1},
        {"49152": 1},
        {"1": 1e300},
        [-1],
        [49152],
        [[]],
        [[-5, 3]],
        [0.5],
        "\ud800",
        "root ::= root",
        'root ::= "a" | root "a"',
        "x" * 70000,
    ]
)
models = st.sampled_from([MODEL, MODEL, "", "other"]) | json_values | long_texts
prompts = st.sampled_from(["Hi", ["a", "b"], [1, 2]]) | json_values | hostile_values
bodies = st.fixed_dictionaries(
    {
        "model": models,
        "prompt": prompts,
        "max_tokens": st.sampled_from([1, 2, 0, -1, None, "x", 2**40, 10**9]),
    },
    optional={
        field: json_values | hostile_values
        for field in FIELDS
        if field not in ("prompt", "max_tokens")
    },
)
raw_bodies = st.sampled_from(
    [
        b"",
        b"{",
        b"[]",
        b"null",
        b"\xff\xfe\xfd",
        b'{"model": "\xff"}',
        b"[" * 10000,
        b'{"a":' * 5000,
        b'{"model": "m", "prompt": 1e400}',
        b'{"model": "m", "prompt": NaN}',
        b'{"prompt": "' + b"a" * 1_000_000 + b'", "model": "' + MODEL.encode() + b'"}',
        b'{"model": "m", "prompt": "x", "n": 99999999999999999999999}',
    ]
) | st.binary(max_size=200)


def check_rest_reply(response: httpx.Response) -> None:
    assert response.status_code in ACCEPTED_REST, (response.status_code, response.text[:500])
    content_type = response.headers.get("content-type", "")
    if response.status_code == 200 and content_type.startswith("text/event-stream"):
        check_events(response.text)
        return
    assert content_type.startswith("application/json"), (response.status_code, content_type)
    json.loads(response.text)
    if response.status_code != 200:
        assert len(response.content) <= MAX_ERROR_BODY_BYTES, response.text[:500]


def check_events(text: str) -> None:
    """A stream's error event, if any, carries a 4xx."""
    for line in text.splitlines():
        if line.startswith("data: {"):
            event = json.loads(line[len("data: ") :])
            status = (event.get("error") or {}).get("status_code", 200)
            assert status < 500, event


def check_grpc_error(error: grpc.RpcError) -> None:
    assert error.code() not in REFUSED_GRPC, (error.code(), error.details())
    metadata = error.trailing_metadata() or ()
    size = sum(len(key) + len(value) for key, value in metadata) + len(error.details() or "")
    assert size <= MAX_ERROR_METADATA_BYTES, (error.code(), size)


def fuzz_rest(client: httpx.Client, json_bodies: st.SearchStrategy[dict[str, Any]]) -> None:
    """Posts generated JSON bodies, then raw bytes, and checks every reply."""

    @FUZZ_SETTINGS
    @given(body=json_bodies)
    def send_json(body: dict[str, Any]) -> None:
        # json.dumps escapes lone surrogates (\ud800) that httpx would refuse to encode.
        content = json.dumps(body).encode()
        response = client.post(
            "/v2/completions", content=content, headers={"content-type": "application/json"}
        )
        check_rest_reply(response)

    @FUZZ_SETTINGS
    @given(raw=raw_bodies)
    def send_raw(raw: bytes) -> None:
        response = client.post(
            "/v2/completions", content=raw, headers={"content-type": "application/json"}
        )
        check_rest_reply(response)

    send_json()
    send_raw()


def test_rest_survives_hostile_bodies(stack: TestStack) -> None:
    with httpx.Client(base_url=stack.base_url, headers=AUTH_HEADERS, timeout=120) as client:
        fuzz_rest(client, bodies)


def grpc_message(
    body: dict[str, Any], message: type[Message] = CreateCompletionRequest
) -> Message | None:
    """The body as a gRPC request, if protobuf's JSON mapping can represent it."""
    try:
        return json_format.ParseDict(body, message())
    except (json_format.ParseError, ValueError, TypeError, OverflowError, RecursionError):
        return None
    except SystemError:  # protobuf's upb looking up a lone surrogate as a field name
        return None


def fuzz_grpc(
    stub: completions_pb2_grpc.CompletionServiceStub,
    json_bodies: st.SearchStrategy[dict[str, Any]],
    metadata: tuple[tuple[str, str], ...] = (),
) -> None:
    """Sends the generated bodies protobuf can represent, and checks every error."""

    @FUZZ_SETTINGS
    @given(body=json_bodies)
    def send(body: dict[str, Any]) -> None:
        request = grpc_message(body)
        if request is None:
            return
        try:
            list(stub.CreateCompletion(request, timeout=120, metadata=metadata))
        except grpc.RpcError as error:
            check_grpc_error(error)

    send()


def test_grpc_survives_hostile_requests(stack: TestStack) -> None:
    with grpc.insecure_channel(stack.grpc_target) as channel:
        fuzz_grpc(completions_pb2_grpc.CompletionServiceStub(channel), bodies, GRPC_AUTH)


# At most a few generated tokens a request: a length either small or refused.
SHORT_GENERATION = st.sampled_from([0, 1, 2, -1, 2**31 - 1, 10**6])
SHORT_LENGTHS = {
    "max_tokens": SHORT_GENERATION,
    "max_completion_tokens": SHORT_GENERATION,
    "min_tokens": SHORT_GENERATION,
}
PROPERTY_METHODS = {
    "completion": (
        "/v2/completions",
        CreateCompletionRequest,
        "CreateCompletion",
        completion_bodies(MODEL, wrong_types=True, overrides=SHORT_LENGTHS),
    ),
    "chat": (
        "/v2/chat/completions",
        CreateChatCompletionRequest,
        "CreateChatCompletion",
        chat_bodies(MODEL, wrong_types=True, overrides=SHORT_LENGTHS),
    ),
    "tokenize": (
        "/v2/tokenize",
        TokenizeRequest,
        "Tokenize",
        tokenize_bodies(MODEL, wrong_types=True),
    ),
}


def grpc_call(stub: completions_pb2_grpc.CompletionServiceStub, method: str) -> Callable[..., Any]:
    """The stub's method, its replies read to the end (a stream's or the one reply)."""
    call = getattr(stub, method)

    def read_all(request: Message, **options: Any) -> None:
        replies = call(request, **options)
        if hasattr(replies, "__iter__"):
            list(replies)

    return read_all


@pytest.mark.parametrize("method", PROPERTY_METHODS)
def test_requests_from_the_proto_fields_never_fail_the_server(
    stack: TestStack, method: str
) -> None:
    path, message, rpc, json_bodies = PROPERTY_METHODS[method]
    with (
        httpx.Client(base_url=stack.base_url, headers=AUTH_HEADERS, timeout=120) as client,
        grpc.insecure_channel(stack.grpc_target) as channel,
    ):
        call = grpc_call(completions_pb2_grpc.CompletionServiceStub(channel), rpc)

        @PROPERTY_SETTINGS
        @given(body=json_bodies)
        def send(body: dict[str, Any]) -> None:
            response = client.post(
                path,
                content=json.dumps(body).encode(),
                headers={"content-type": "application/json"},
            )
            check_rest_reply(response)
            request = grpc_message(body, message)
            if request is None:
                return
            try:
                call(request, timeout=120, metadata=GRPC_AUTH)
            except grpc.RpcError as error:
                check_grpc_error(error)

        send()


def test_service_is_healthy_after_fuzzing(
    stack: TestStack, rest: httpx.Client, metrics_url: str
) -> None:
    # A Lua filter that fails lets the reply pass without the REST framing it applies.
    assert lua_errors(f"http://127.0.0.1:{stack.admin_port}") == 0
    assert complete(rest, prompt=CAPITAL_PROMPT, max_tokens=4)["choices"][0]["text"].startswith(
        " Paris"
    )
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    assert rest.post("/v2/chat/completions", json=chat).status_code == 200
    assert sample(metrics_url, "llmcompletions_engine_unfinished_requests") == 0
    assert sample(metrics_url, "llmcompletions_requests_in_flight") == 0
