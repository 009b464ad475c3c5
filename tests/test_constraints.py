"""Output constraints (guided_* and response_format) really constrain the output."""

from __future__ import annotations

import json
import re
from typing import Any

import httpx
import jsonschema
import pytest

from tests.helpers import body, complete, post, stream_chunks, streamed_texts

QUESTION = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
PERSON_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 20},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "stream": {"type": "boolean"},
    },
    "required": ["name", "age", "stream"],
    "additionalProperties": False,
}


BAD_NAME = {"name": "a b", "schema": {}}


def texts_of(result: dict[str, Any]) -> list[str]:
    return [choice["text"] for choice in result["choices"]]


def test_guided_choice_answers_one_of_the_choices(rest: httpx.Client) -> None:
    choices = ["Lyon", "Marseille", "Toulouse"]  # not the model's free answer
    result = complete(
        rest, prompt=QUESTION, max_tokens=10, guided_choice=choices, n=3, temperature=1, seed=1
    )
    assert all(text in choices for text in texts_of(result))
    streamed = streamed_texts(
        stream_chunks(rest, prompt=QUESTION, max_tokens=10, guided_choice=choices)
    )
    assert streamed[0] in choices


def test_guided_regex_matches_in_full(rest: httpx.Client) -> None:
    pattern = r"[0-9]{3}-[a-z]{2}"
    result = complete(
        rest, prompt=QUESTION, max_tokens=20, guided_regex=pattern, n=2, temperature=1, seed=2
    )
    assert all(re.fullmatch(pattern, text) for text in texts_of(result)), texts_of(result)


def test_guided_json_validates_against_its_schema(rest: httpx.Client) -> None:
    result = complete(rest, prompt="A person as JSON: ", max_tokens=80, guided_json=PERSON_SCHEMA)
    choice = result["choices"][0]
    assert choice["finish_reason"] == "stop"
    person = json.loads(choice["text"])
    jsonschema.validate(person, PERSON_SCHEMA)
    # The keys come in the schema's order, as the caller wrote it (not the alphabet's).
    assert list(person) == list(PERSON_SCHEMA["properties"])


def test_streamed_guided_json_validates_and_stays_a_stream(rest: httpx.Client) -> None:
    # The schema holds the text "stream" with a true value: the mode must not flip.
    chunks = stream_chunks(
        rest,
        prompt="A person as JSON: ",
        max_tokens=80,
        guided_json={**PERSON_SCHEMA, "examples": [{"stream": True}]},
    )
    person = json.loads(streamed_texts(chunks)[0])
    jsonschema.validate(person, PERSON_SCHEMA)
    assert list(person) == list(PERSON_SCHEMA["properties"])


def test_json_schema_response_format_validates(rest: httpx.Client) -> None:
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "person", "schema": PERSON_SCHEMA, "strict": True},
    }
    result = complete(
        rest, prompt="A person as JSON: ", max_tokens=80, response_format=response_format
    )
    jsonschema.validate(json.loads(result["choices"][0]["text"]), PERSON_SCHEMA)


def test_json_object_response_format_gives_an_object(rest: httpx.Client) -> None:
    result = complete(
        rest, prompt="Some JSON: ", max_tokens=60, response_format={"type": "json_object"}
    )
    choice = result["choices"][0]
    if choice["finish_reason"] == "stop":
        assert isinstance(json.loads(choice["text"]), dict)
    else:
        assert choice["text"].lstrip().startswith("{")


def test_text_response_format_is_unconstrained(rest: httpx.Client) -> None:
    free = complete(rest, prompt=QUESTION, max_tokens=8)
    text = complete(rest, prompt=QUESTION, max_tokens=8, response_format={"type": "text"})
    assert texts_of(free) == texts_of(text)


def test_guided_grammar_constrains_to_the_language(rest: httpx.Client) -> None:
    grammar = 'root ::= answer " " answer\nanswer ::= "yes" | "no"'
    result = complete(
        rest, prompt=QUESTION, max_tokens=10, guided_grammar=grammar, n=3, temperature=1, seed=4
    )
    assert all(re.fullmatch(r"(yes|no) (yes|no)", text) for text in texts_of(result))


def test_guided_whitespace_pattern_is_applied(rest: httpx.Client) -> None:
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    result = complete(
        rest, prompt="JSON: ", max_tokens=30, guided_json=schema, guided_whitespace_pattern=""
    )
    assert " " not in result["choices"][0]["text"] and "\n" not in result["choices"][0]["text"]


def test_the_running_backend_is_accepted(rest: httpx.Client) -> None:
    result = complete(
        rest,
        prompt=QUESTION,
        max_tokens=5,
        guided_choice=["a", "b"],
        guided_decoding_backend="xgrammar",
    )
    assert texts_of(result)[0] in ("a", "b")


def test_an_unavailable_backend_is_refused_with_the_available_ones(rest: httpx.Client) -> None:
    response = post(
        rest, body(prompt="Hi", guided_choice=["a"], guided_decoding_backend="outlines")
    )
    assert response.status_code == 422
    detail = response.json()["detail"][0]
    assert detail["loc"] == ["body", "guided_decoding_backend"]
    assert "xgrammar" in detail["msg"]


@pytest.mark.parametrize(
    ("fields", "loc"),
    [
        ({"guided_choice": []}, ["body", "guided_choice"]),
        ({"guided_choice": ["a", 1]}, ["body", "guided_choice", 1]),
        ({"guided_regex": "(unclosed"}, ["body", "guided_regex"]),
        # Compiles, admits nothing: the engine ends the request with finish_reason "error".
        ({"guided_grammar": "root ::= root"}, ["body", "guided_grammar"]),
        ({"guided_regex": "a", "guided_choice": ["a"]}, ["body", "guided_choice"]),
        ({"response_format": {"type": "xml"}}, ["body", "response_format", "type"]),
        ({"response_format": {"type": "json_schema"}}, ["body", "response_format", "json_schema"]),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a b", "schema": {}},
                }
            },
            ["body", "response_format", "json_schema", "name"],
        ),
    ],
)
def test_invalid_constraints_are_refused(rest: httpx.Client, fields: dict, loc: list) -> None:
    response = post(rest, body(prompt="Hi", **fields))
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == loc
