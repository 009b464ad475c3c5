"""Model listing and information, tokenization and detokenization, on both surfaces through the
real Envoy and the real engine; token counts equal what completions count."""

from __future__ import annotations

import grpc
import httpx
import openai
import pytest
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import (
    DetokenizeRequest,
    GetModelInfoRequest,
    ListModelsRequest,
    TokenizeRequest,
)

from tests.conftest import GRPC_AUTH, MAX_MODEL_LEN, MODEL
from tests.helpers import CAPITAL_PROMPT, complete, grpc_request
from tests.processes import TestStack

PROMPTS = {
    "text": CAPITAL_PROMPT,
    "texts": ["Hello there", "The capital of France is"],
    "token ids": [504, 3575, 282],
    "token-id lists": [[504, 3575], [282, 4649, 314]],
    "special tokens as text": "<|im_start|>user\nHi<|im_end|>",
}


def test_rest_lists_the_served_model_in_the_openai_shape(rest: httpx.Client) -> None:
    response = rest.get("/v2/models")
    assert response.status_code == 200, response.text
    listing = response.json()
    assert listing["object"] == "list"
    (model,) = listing["data"]
    assert model["id"] == MODEL and model["object"] == "model"
    assert model["parent"] is None and model["max_model_len"] == MAX_MODEL_LEN
    assert model["created"] > 0 and model["owned_by"]


def test_the_openai_sdk_lists_and_retrieves_models(openai_client: openai.OpenAI) -> None:
    assert [model.id for model in openai_client.models.list()] == [MODEL]
    retrieved = openai_client.models.retrieve(MODEL)
    assert retrieved.id == MODEL and retrieved.object == "model"
    with pytest.raises(openai.NotFoundError):
        openai_client.models.retrieve("no-such-model")


def test_model_information_says_what_a_caller_needs(rest: httpx.Client) -> None:
    info = rest.get(f"/v2/models/{MODEL}").json()
    assert info["vocab_size"] == 49152
    assert info["eos_token_ids"] == [2]
    assert info["structured_outputs_backend"] == "xgrammar"
    assert info["max_model_len"] == MAX_MODEL_LEN
    assert isinstance(info["default_sampling"], dict)
    assert info["adapters"] == []


def test_grpc_lists_and_describes_models(
    grpc_stub: completions_pb2_grpc.CompletionServiceStub,
) -> None:
    listing = grpc_stub.ListModels(ListModelsRequest(), timeout=30, metadata=GRPC_AUTH)
    assert [model.id for model in listing.data] == [MODEL]
    info = grpc_stub.GetModelInfo(GetModelInfoRequest(model=MODEL), timeout=30, metadata=GRPC_AUTH)
    assert info.vocab_size == 49152 and list(info.eos_token_ids) == [2]
    with pytest.raises(grpc.RpcError) as raised:
        grpc_stub.GetModelInfo(GetModelInfoRequest(model="nope"), timeout=30, metadata=GRPC_AUTH)
    assert raised.value.code() == grpc.StatusCode.NOT_FOUND
    assert f"`{MODEL}`" in (raised.value.details() or "")


@pytest.mark.parametrize("special", [True, False])
@pytest.mark.parametrize("prompt", PROMPTS.values(), ids=PROMPTS.keys())
def test_tokenize_counts_what_a_completion_counts(
    rest: httpx.Client, prompt: object, special: bool
) -> None:
    tokenized = rest.post(
        "/v2/tokenize", json={"model": MODEL, "prompt": prompt, "add_special_tokens": special}
    )
    assert tokenized.status_code == 200, tokenized.text
    counted = tokenized.json()
    used = complete(rest, prompt=prompt, max_tokens=1, add_special_tokens=special)["usage"]
    assert counted["count"] == used["prompt_tokens"] == len(counted["tokens"])
    assert counted["max_model_len"] == MAX_MODEL_LEN
    if isinstance(prompt, list) and isinstance(prompt[0], list | str):
        assert sum(counted["counts"]) == counted["count"] and len(counted["counts"]) == 2


def test_special_tokens_in_text_are_single_tokens(rest: httpx.Client) -> None:
    tokens = rest.post("/v2/tokenize", json={"model": MODEL, "prompt": "<|im_start|>"}).json()[
        "tokens"
    ]
    assert len(tokens) == 1


def test_detokenize_inverts_tokenize_on_both_surfaces(
    rest: httpx.Client, grpc_stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    tokens = rest.post("/v2/tokenize", json={"model": MODEL, "prompt": CAPITAL_PROMPT}).json()[
        "tokens"
    ]
    text = rest.post("/v2/detokenize", json={"model": MODEL, "tokens": tokens}).json()["prompt"]
    assert text == CAPITAL_PROMPT
    over_grpc = grpc_stub.Detokenize(
        DetokenizeRequest(model=MODEL, tokens=tokens), timeout=30, metadata=GRPC_AUTH
    )
    assert over_grpc.prompt == CAPITAL_PROMPT
    counted = grpc_stub.Tokenize(
        TokenizeRequest(model=MODEL, prompt=grpc_request(prompt=CAPITAL_PROMPT).prompt),
        timeout=30,
        metadata=GRPC_AUTH,
    )
    assert list(counted.tokens) == tokens


@pytest.mark.parametrize(
    ("path", "payload", "status", "loc"),
    [
        ("/v2/tokenize", {"model": MODEL, "prompt": ""}, 422, ["body", "prompt"]),
        ("/v2/tokenize", {"model": MODEL, "prompt": [49152]}, 422, ["body", "prompt", 0]),
        ("/v2/tokenize", {"model": MODEL, "prompt": ["a"] * 65}, 422, ["body", "prompt"]),
        ("/v2/tokenize", {"model": "nope", "prompt": "Hi"}, 404, None),
        ("/v2/detokenize", {"model": MODEL, "tokens": [-1]}, 422, ["body", "tokens", 0]),
        ("/v2/detokenize", {"model": "nope", "tokens": [1]}, 404, None),
    ],
)
def test_bad_tokenization_requests_get_the_completion_errors(
    rest: httpx.Client, path: str, payload: dict, status: int, loc: list | None
) -> None:
    response = rest.post(path, json=payload)
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    if loc is not None:
        assert response.json()["detail"][0]["loc"] == loc


def test_the_new_routes_need_the_api_key(stack: TestStack) -> None:
    for method, path in (("GET", "/v2/models"), ("POST", "/v2/tokenize")):
        response = httpx.request(
            method, f"{stack.base_url}{path}", json={"model": MODEL, "prompt": "Hi"}, timeout=30
        )
        assert response.status_code == 401, (path, response.text)
