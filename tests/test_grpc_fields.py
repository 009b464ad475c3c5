"""The gRPC surface gives what REST gives, field by field (same request, same engine)."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from google.protobuf import json_format
from llmcompletions.v2 import completions_pb2_grpc

from tests.helpers import CAPITAL_PROMPT, complete, grpc_complete

VARIANTS: list[dict[str, Any]] = [
    {"prompt": [CAPITAL_PROMPT, "One, two,"], "n": 2, "temperature": 0.8, "seed": 3},
    {"prompt": CAPITAL_PROMPT, "logprobs": 2, "echo": True},
    {"prompt": CAPITAL_PROMPT, "best_of": 3, "temperature": 1, "seed": 5},
    {"prompt": CAPITAL_PROMPT, "use_beam_search": True, "n": 2, "early_stopping": "never"},
    {"prompt": CAPITAL_PROMPT, "guided_choice": ["Lyon", "Nice"]},
    {"prompt": CAPITAL_PROMPT, "guided_regex": "[0-9]{4}"},
    {"prompt": CAPITAL_PROMPT, "response_format": {"type": "json_object"}, "max_tokens": 12},
    {"prompt": CAPITAL_PROMPT, "stop": ["."], "include_stop_str_in_output": True},
    {"prompt": CAPITAL_PROMPT, "logit_bias": {"12": 100}, "top_k": 5, "min_p": 0.1},
]
SHARED_KEYS = ("choices", "usage", "model", "object", "system_fingerprint")


def as_json(message: Any) -> dict[str, Any]:
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


@pytest.mark.parametrize("fields", VARIANTS)
def test_grpc_equals_rest(
    rest: httpx.Client, grpc_stub: completions_pb2_grpc.CompletionServiceStub, fields: dict
) -> None:
    request = {"max_tokens": 6, **fields}
    over_rest = complete(rest, **request)
    (over_grpc,) = grpc_complete(grpc_stub, **request)
    grpc_json = as_json(over_grpc)
    for key in SHARED_KEYS:
        assert grpc_json[key] == over_rest[key], key
