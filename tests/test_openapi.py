"""The OpenAPI document: served by Envoy, true to the proto, and true to real responses."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import referencing
from llmcompletions.v2.completions_pb2 import CreateCompletionRequest, CreateCompletionResponse

from tests.helpers import CAPITAL_PROMPT, complete, stream_chunks
from tests.processes import TestStack

DOCUMENT = Path(__file__).resolve().parent.parent / "facade/openapi.json"


def test_envoy_serves_the_document(stack: TestStack) -> None:
    response = httpx.get(f"{stack.base_url}/openapi.json", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    assert response.json() == json.loads(DOCUMENT.read_text())


def test_document_fields_are_the_protos() -> None:
    schemas = json.loads(DOCUMENT.read_text())["components"]["schemas"]
    for message in (CreateCompletionRequest, CreateCompletionResponse):
        proto_fields = {field.json_name for field in message.DESCRIPTOR.fields}
        assert set(schemas[message.DESCRIPTOR.name]["properties"]) == proto_fields


def validator(schema_name: str) -> jsonschema.Draft202012Validator:
    document = json.loads(DOCUMENT.read_text())
    resource = referencing.Resource.from_contents(
        document, default_specification=referencing.jsonschema.DRAFT202012
    )
    registry = referencing.Registry().with_resource("urn:openapi", resource)
    return jsonschema.Draft202012Validator(
        {"$ref": f"urn:openapi#/components/schemas/{schema_name}"}, registry=registry
    )


def test_real_responses_match_the_document(rest: httpx.Client) -> None:
    response_schema = validator("CreateCompletionResponse")
    whole = complete(
        rest, prompt=[CAPITAL_PROMPT, "Hi"], n=2, max_tokens=3, logprobs=2, echo=True, temperature=1
    )
    response_schema.validate(whole)
    extras = complete(
        rest, prompt=CAPITAL_PROMPT, max_tokens=3, return_token_ids=True, prompt_logprobs=1
    )
    response_schema.validate(extras)
    for chunk in stream_chunks(
        rest,
        prompt=CAPITAL_PROMPT,
        max_tokens=3,
        return_token_ids=True,
        stream_options={"include_usage": True},
    ):
        response_schema.validate(chunk)
    errors = rest.post("/v2/completions", json={"prompt": "Hi", "temperature": 9}).json()
    validator("HTTPValidationError").validate(errors)


def test_the_document_accepts_the_reference_forms() -> None:
    request_schema = validator("CreateCompletionRequest")
    for prompt in ("text", ["a", "b"], [1, 2], [[1, 2], [3]]):
        request_schema.validate({"model": "m", "prompt": prompt, "stop": None, "n": None})
