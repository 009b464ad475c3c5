"""Images in chat on a real vision-language model (the tiny random-weight Idefics3 of
bench/tiny_vlm.py), served by ours and by vLLM's own server with the same media settings:
the same log-probabilities and seeded samples for an inline image, an image fetched from a
loopback host, two images, streamed and whole, over REST and gRPC (an image's bytes in a typed
part too), and the same token count; then every refusal of the media fetcher, each a fast 4xx
that fetched nothing it should not, with the replica serving on."""

from __future__ import annotations

import json
import math
import socket
import time
from collections.abc import Iterator
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import json_format
from llmcompletions.v2 import completions_pb2_grpc
from llmcompletions.v2.completions_pb2 import CreateChatCompletionRequest, TokenizeRequest

from tests.conftest import (
    VLM_FETCH_TIMEOUT_SECONDS,
    VLM_IMAGES_PER_PROMPT,
    VLM_MAX_MEDIA_BYTES,
    VLM_MODEL,
)
from tests.image_server import SLOW_SECONDS, ImageServer, data_url, png
from tests.metrics import sample
from tests.processes import TestStack

QUESTION = "What is in this picture?"
# Greedy text from random weights is mostly newlines: compare log-probabilities, and sample.
SCORED = {"temperature": 0, "max_completion_tokens": 6, "logprobs": True, "top_logprobs": 3}
SAMPLED = {"temperature": 1.0, "seed": 7, "max_completion_tokens": 12}
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def images() -> Iterator[ImageServer]:
    server = ImageServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def rest(vlm_stack: TestStack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=vlm_stack.base_url, timeout=120) as client:
        yield client


@pytest.fixture(scope="module")
def stub(vlm_stack: TestStack) -> Iterator[completions_pb2_grpc.CompletionServiceStub]:
    with grpc.insecure_channel(vlm_stack.grpc_target) as channel:
        yield completions_pb2_grpc.CompletionServiceStub(channel)


def image_part(url: str) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}}


def asking(*urls: str, **fields: Any) -> dict[str, Any]:
    content = [*(image_part(url) for url in urls), {"type": "text", "text": QUESTION}]
    return {"model": VLM_MODEL, "messages": [{"role": "user", "content": content}], **fields}


def ours(rest: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    response = rest.post("/v2/chat/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()


def theirs(vllm_vlm_server: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(f"{vllm_vlm_server}/v1/chat/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def over_grpc(
    stub: completions_pb2_grpc.CompletionServiceStub, body: dict[str, Any]
) -> dict[str, Any]:
    request = json_format.ParseDict(body, CreateChatCompletionRequest())
    (reply,) = stub.CreateChatCompletion(request, timeout=120)
    return json_format.MessageToDict(reply, preserving_proto_field_name=True)


def scores(reply: dict[str, Any]) -> list[list[tuple[str, float]]]:
    """Each generated position's top alternatives: (token, log-probability)."""
    return [
        [(top["token"], top["logprob"]) for top in position["top_logprobs"]]
        for position in reply["choices"][0]["logprobs"]["content"]
    ]


def assert_same_scores(mine: dict[str, Any], peer: dict[str, Any]) -> None:
    ours_, theirs_ = scores(mine), scores(peer)
    assert len(ours_) == len(theirs_) == SCORED["max_completion_tokens"]
    for position, (a, b) in enumerate(zip(ours_, theirs_, strict=True)):
        assert [token for token, _ in a] == [token for token, _ in b], position
        for (_, x), (_, y) in zip(a, b, strict=True):
            assert math.isclose(x, y, abs_tol=TOLERANCE), (position, a, b)


def content(reply: dict[str, Any]) -> str:
    return reply["choices"][0]["message"]["content"]


def test_an_inline_image_answers_as_vllm_does(rest: httpx.Client, vllm_vlm_server: str) -> None:
    body = asking(data_url(png("red")))
    mine, peer = ours(rest, {**body, **SCORED}), theirs(vllm_vlm_server, {**body, **SCORED})
    assert_same_scores(mine, peer)
    assert mine["usage"]["prompt_tokens"] == peer["usage"]["prompt_tokens"]
    sampled = {**body, **SAMPLED}
    assert content(ours(rest, sampled)) == content(theirs(vllm_vlm_server, sampled))


def test_the_image_changes_the_answer(rest: httpx.Client) -> None:
    red = ours(rest, {**asking(data_url(png("red"))), **SCORED})
    blue = ours(rest, {**asking(data_url(png("blue"))), **SCORED})
    text_only = ours(rest, {**asking(), **SCORED})
    assert scores(red) != scores(blue)
    assert red["usage"]["prompt_tokens"] > text_only["usage"]["prompt_tokens"]


def test_an_http_image_is_fetched_once_and_answers_as_vllm_does(
    rest: httpx.Client, vllm_vlm_server: str, images: ImageServer
) -> None:
    body = {**asking(images.url("/green.png")), **SCORED}
    before = images.count("/green.png")
    mine = ours(rest, body)
    assert images.count("/green.png") == before + 1
    assert_same_scores(mine, theirs(vllm_vlm_server, body))
    inline = ours(rest, {**asking(data_url(png("green"))), **SCORED})
    assert_same_scores(mine, inline)  # the same image, however it came


def test_two_images_answer_as_vllm_does(
    rest: httpx.Client, vllm_vlm_server: str, images: ImageServer
) -> None:
    body = asking(data_url(png("red")), images.url("/blue.png"))
    mine = ours(rest, {**body, **SCORED})
    assert_same_scores(mine, theirs(vllm_vlm_server, {**body, **SCORED}))
    one = ours(rest, {**asking(data_url(png("red"))), **SCORED})
    assert mine["usage"]["prompt_tokens"] > one["usage"]["prompt_tokens"]
    sampled = {**body, **SAMPLED}
    assert content(ours(rest, sampled)) == content(theirs(vllm_vlm_server, sampled))


def streamed_content(client: httpx.Client, body: dict[str, Any]) -> str:
    text = ""
    with client.stream("POST", "/v2/chat/completions", json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        payloads = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    assert payloads[-1] == "[DONE]"
    for payload in payloads[:-1]:
        for choice in json.loads(payload)["choices"]:
            text += (choice.get("delta") or {}).get("content") or ""
    return text


def test_a_stream_adds_up_to_the_whole_reply(rest: httpx.Client, vllm_vlm_server: str) -> None:
    body = {**asking(data_url(png("blue"))), **SAMPLED}
    whole = content(theirs(vllm_vlm_server, body))
    assert streamed_content(rest, body) == content(ours(rest, body)) == whole


def test_grpc_answers_as_rest_does_and_takes_an_images_bytes(
    rest: httpx.Client, stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    body = {**asking(data_url(png("red"))), **SCORED}
    over_rest = ours(rest, body)
    assert_same_scores(over_grpc(stub, body), over_rest)
    typed = {
        **body,
        "messages": [
            {
                "role": "user",
                "parts": [
                    {"image": {"data": data_url(png("red")).split(",")[1]}},
                    {"text": QUESTION},
                ],
            }
        ],
    }
    assert_same_scores(over_grpc(stub, typed), over_rest)


def test_tokenize_counts_the_image_tokens_as_vllm_does(
    rest: httpx.Client,
    vllm_vlm_server: str,
    stub: completions_pb2_grpc.CompletionServiceStub,
    images: ImageServer,
) -> None:
    messages = asking(data_url(png("red")), images.url("/blue.png"))["messages"]
    mine = rest.post("/v2/tokenize", json={"model": VLM_MODEL, "messages": messages})
    assert mine.status_code == 200, mine.text
    peer = httpx.post(
        f"{vllm_vlm_server}/tokenize", json={"model": VLM_MODEL, "messages": messages}
    ).json()
    assert mine.json()["count"] == peer["count"]
    assert mine.json()["tokens"] == peer["tokens"]
    reply = ours(rest, {"model": VLM_MODEL, "messages": messages, "max_completion_tokens": 1})
    assert mine.json()["count"] == reply["usage"]["prompt_tokens"]
    request = json_format.ParseDict({"model": VLM_MODEL, "messages": messages}, TokenizeRequest())
    assert stub.Tokenize(request, timeout=60).count == peer["count"]


def test_the_log_and_metrics_count_images_and_their_tokens(
    rest: httpx.Client, vlm_stack: TestStack
) -> None:
    before = sample(vlm_stack.metrics_url, "llmcompletions_images_total", tenant="")
    reply = ours(rest, {**asking(data_url(png("red")), data_url(png("blue"))), **SCORED})
    assert sample(vlm_stack.metrics_url, "llmcompletions_images_total", tenant="") == before + 2
    assert vlm_stack.service_log is not None
    time.sleep(0.5)
    lines = [
        json.loads(line)
        for line in vlm_stack.service_log.read_text().splitlines()
        if '"message": "request"' in line
    ]
    last = lines[-1]
    assert last["images"] == 2
    assert 0 < last["image_tokens"] < last["prompt_tokens"] == reply["usage"]["prompt_tokens"]


def closed_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# Each refusal: the request's image URLs (a callable of the image server), what the message
# says, and the paths the loopback host may have been asked for.
REFUSALS: dict[str, tuple[Any, str, dict[str, int]]] = {
    "too many images": (
        lambda s: [s.url("/red.png")] * (VLM_IMAGES_PER_PROMPT + 1),
        f"at most {VLM_IMAGES_PER_PROMPT} images",
        {},
    ),
    "a host off the list": (lambda s: [s.url("/red.png", "localhost")], "localhost", {}),
    "a redirect": (lambda s: [s.url("/redirect")], "redirect", {"/redirect": 1}),
    "an oversized file": (lambda s: [s.url("/large.png")], "too large", {"/large.png": 1}),
    "an oversized inline image": (
        lambda s: [data_url(bytes(VLM_MAX_MEDIA_BYTES + 1))],
        "too large",
        {},
    ),
    "a pixel bomb": (lambda s: [s.url("/bomb.png")], "pixels", {"/bomb.png": 1}),
    "a dead host": (lambda s: [f"http://127.0.0.1:{closed_port()}/x.png"], "connect", {}),
    "a slow host": (lambda s: [s.url("/slow.png")], "within", {"/slow.png": 1}),
    "a file URL": (lambda s: ["file:///etc/passwd"], "file", {}),
    "an unknown scheme": (lambda s: ["gopher://127.0.0.1/x.png"], "gopher", {}),
}


@pytest.mark.parametrize("case", REFUSALS, ids=REFUSALS.keys())
def test_a_refused_image_is_a_fast_422_that_fetched_nothing_it_should_not(
    rest: httpx.Client, images: ImageServer, case: str
) -> None:
    urls_of, says, fetched = REFUSALS[case]
    before = dict(images.hits)
    started = time.monotonic()
    response = rest.post("/v2/chat/completions", json={**asking(*urls_of(images)), **SCORED})
    elapsed = time.monotonic() - started
    assert response.status_code == 422, response.text
    (violation, *_) = response.json()["detail"]
    assert says in violation["msg"], violation
    asked = {path: count - before.get(path, 0) for path, count in images.hits.items()}
    assert {path: count for path, count in asked.items() if count} == fetched
    # A slow host is given up on at the fetch timeout; every other refusal comes at once.
    limit = VLM_FETCH_TIMEOUT_SECONDS + 2 if case == "a slow host" else 2
    assert elapsed < min(limit, SLOW_SECONDS), elapsed
    assert content(ours(rest, {**asking(data_url(png("red"))), **SAMPLED}))  # serving on


def test_a_content_parts_uuid_is_refused_on_both_surfaces(
    rest: httpx.Client, stub: completions_pb2_grpc.CompletionServiceStub
) -> None:
    """A caller-chosen uuid would be the engine's cache key for the image as given: another
    caller naming it could be served this image."""
    body = asking(data_url(png("red")))
    body["messages"][0]["content"][0]["uuid"] = "shared-key"
    response = rest.post("/v2/chat/completions", json=body)
    assert response.status_code == 422, response.text
    assert response.json()["detail"][0]["loc"] == ["body", "messages", 0, "content", 0, "uuid"]
    with pytest.raises(grpc.RpcError) as refused:
        over_grpc(stub, body)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_tokenize_refuses_what_chat_refuses(rest: httpx.Client, images: ImageServer) -> None:
    before = images.total()
    messages = asking(images.url("/red.png", "localhost"))["messages"]
    response = rest.post("/v2/tokenize", json={"model": VLM_MODEL, "messages": messages})
    assert response.status_code == 422, response.text
    assert images.total() == before
