"""Every range limit of the API (docs/calling/fields.md), both sides of each bound, via REST."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from llmcompletions.v2.completions_pb2 import CreateCompletionRequest

from tests.helpers import CAPITAL_PROMPT, body, post

REQUEST_FIELDS = CreateCompletionRequest.DESCRIPTOR.fields

# (field, a value just inside the limit, a value just outside it)
LIMITS: list[tuple[str, Any, Any]] = [
    ("max_tokens", 0, -1),
    ("temperature", 2, 2.01),
    ("temperature", 0, -0.01),
    ("top_p", 1, 1.01),
    ("top_p", 0.01, 0),
    ("top_k", -1, -2),
    ("top_k", 1, -5),
    ("min_p", 1, 1.5),
    ("min_p", 0, -0.1),
    ("frequency_penalty", 2, 2.5),
    ("frequency_penalty", -2, -2.5),
    ("presence_penalty", 2, 2.5),
    ("presence_penalty", -2, -2.5),
    ("repetition_penalty", 0.5, 0),
    ("n", 1, 0),
    ("n", 128, 129),
    ("logprobs", 5, 6),
    ("logprobs", 0, -1),
    ("min_tokens", 0, -1),
]


def error_locs(response: httpx.Response) -> list[list[Any]]:
    assert response.status_code == 422, response.text
    assert response.headers["content-type"].startswith("application/json")
    return [item["loc"] for item in response.json()["detail"]]


@pytest.mark.parametrize(("field", "inside", "outside"), LIMITS)
def test_limit_is_enforced_on_both_sides(
    rest: httpx.Client, field: str, inside: Any, outside: Any
) -> None:
    accepted = post(rest, body(prompt=CAPITAL_PROMPT, **{"max_tokens": 1, field: inside}))
    assert accepted.status_code == 200, accepted.text
    refused = post(rest, body(prompt=CAPITAL_PROMPT, **{"max_tokens": 1, field: outside}))
    assert error_locs(refused) == [["body", field]]
    assert field in refused.json()["detail"][0]["msg"]


def test_min_tokens_may_not_exceed_max_tokens(rest: httpx.Client) -> None:
    assert post(rest, body(prompt="Hi", max_tokens=3, min_tokens=3)).status_code == 200
    assert error_locs(post(rest, body(prompt="Hi", max_tokens=3, min_tokens=4))) == [
        ["body", "min_tokens"]
    ]


@pytest.mark.parametrize(
    ("stop", "loc"),
    [
        ("", ["body", "stop"]),
        ([], ["body", "stop"]),
        (["a", "b", "c", "d", "e"], ["body", "stop"]),
        (["a", ""], ["body", "stop", 1]),
        (["a", 3], ["body", "stop", 1]),
        (7, ["body", "stop"]),
    ],
)
def test_stop_forms_outside_the_reference_are_refused(
    rest: httpx.Client, stop: Any, loc: list[Any]
) -> None:
    assert error_locs(post(rest, body(prompt="Hi", stop=stop))) == [loc]


@pytest.mark.parametrize("stop", ["\n", ["a", "b", "c", "d"], None])
def test_stop_forms_of_the_reference_are_accepted(rest: httpx.Client, stop: Any) -> None:
    assert post(rest, body(prompt="Hi", max_tokens=2, stop=stop)).status_code == 200


@pytest.mark.parametrize(
    ("prompt", "loc"),
    [
        ("", ["body", "prompt"]),
        ([], ["body", "prompt"]),
        ([[]], ["body", "prompt", 0]),
        (["ok", ""], ["body", "prompt", 1]),
        ([1, 49152], ["body", "prompt", 1]),
        ([1, -1], ["body", "prompt", 1]),
        ([1, 2.5], ["body", "prompt", 1]),
        ([[1, 2], "text"], ["body", "prompt", 1]),
        (None, ["body", "prompt"]),
        ({"text": "hi"}, ["body", "prompt"]),
    ],
)
def test_bad_prompts_are_refused(rest: httpx.Client, prompt: Any, loc: list[Any]) -> None:
    assert error_locs(post(rest, body(prompt=prompt))) == [loc]


def test_missing_model_and_prompt_are_reported_together(rest: httpx.Client) -> None:
    locs = error_locs(post(rest, {"temperature": 5}))
    assert locs == [["body", "model"], ["body", "prompt"], ["body", "temperature"]]


def test_stream_options_need_stream(rest: httpx.Client) -> None:
    response = post(rest, body(prompt="Hi", stream_options={"include_usage": True}))
    assert error_locs(response) == [["body", "stream_options"]]


def test_malformed_json_is_a_json_422(rest: httpx.Client) -> None:
    response = rest.post(
        "/v2/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert response.status_code == 422
    assert response.json()["detail"][0]["loc"] == ["body"]


def test_wrong_json_type_is_a_json_422(rest: httpx.Client) -> None:
    response = post(rest, body(prompt="Hi", temperature="hot"))
    assert response.status_code == 422
    assert "temperature" in response.json()["detail"][0]["msg"]


def test_nulls_for_nullable_fields_are_accepted(rest: httpx.Client) -> None:
    nullable = [field.name for field in REQUEST_FIELDS if field.name not in ("model", "prompt")]
    response = post(
        rest, {"model": "smollm2-135m-instruct", "prompt": "Hi", **dict.fromkeys(nullable)}
    )
    assert response.status_code == 200, response.text
    assert len(response.json()["choices"][0]["text"]) > 0


def test_unknown_fields_are_ignored(rest: httpx.Client) -> None:
    assert post(rest, body(prompt="Hi", max_tokens=1, no_such_field=1)).status_code == 200


def test_context_overflow_is_a_400_with_both_numbers(rest: httpx.Client) -> None:
    response = post(rest, body(prompt="Hi", max_tokens=2048))
    assert response.status_code == 400
    detail = response.json()["detail"]
    assert "2048" in detail and "2049" in detail
