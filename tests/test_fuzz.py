"""Hostile input, generated: malformed and extreme requests to REST and gRPC.

Every answer is a result or a 4xx with a JSON body (on gRPC: a status other than INTERNAL or
UNKNOWN); no crash, no hang, and the service still answers a normal request afterwards. Bounded
in count (FUZZ_EXAMPLES each) and time (per-request timeouts).
"""

from __future__ import annotations

import json
from typing import Any

import grpc
import httpx
from google.protobuf import json_format
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateCompletionRequest

from tests.conftest import AUTH_HEADERS, GRPC_AUTH, MODEL
from tests.helpers import CAPITAL_PROMPT, complete
from tests.metrics import sample
from tests.processes import TestStack, lua_errors

FUZZ_EXAMPLES = 150
FUZZ_SETTINGS = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
    derandomize=True,
)
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
        return
    assert content_type.startswith("application/json"), (response.status_code, content_type)
    json.loads(response.text)
    if response.status_code != 200:
        assert len(response.content) <= MAX_ERROR_BODY_BYTES, response.text[:500]


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


def grpc_message(body: dict[str, Any]) -> CreateCompletionRequest | None:
    """The body as a gRPC request, if protobuf's JSON mapping can represent it."""
    try:
        return json_format.ParseDict(body, CreateCompletionRequest())
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


def test_service_is_healthy_after_fuzzing(
    stack: TestStack, rest: httpx.Client, metrics_url: str
) -> None:
    # A Lua filter that fails lets the reply pass without the REST framing it applies.
    assert lua_errors(f"http://127.0.0.1:{stack.admin_port}") == 0
    assert complete(rest, prompt=CAPITAL_PROMPT, max_tokens=4)["choices"][0]["text"].startswith(
        " Paris"
    )
    assert sample(metrics_url, "llmcompletions_engine_unfinished_requests") == 0
    assert sample(metrics_url, "llmcompletions_requests_in_flight") == 0
