"""REST callers through Envoy: the core completion behaviours of /v2/completions."""

from __future__ import annotations

import json

import httpx
import pytest
from transformers import PreTrainedTokenizerBase

from tests.helpers import (
    CAPITAL_PROMPT,
    body,
    complete,
    post,
    stream_chunks,
    streamed_texts,
)


def test_greedy_capital_of_france_is_paris(rest: httpx.Client) -> None:
    result = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=8)
    assert result["choices"][0]["text"].startswith(" Paris")
    assert result["object"] == "text_completion"
    assert result["id"].startswith("cmpl-")
    assert result["model"] == "smollm2-135m-instruct"
    assert isinstance(result["created"], int)
    assert result["system_fingerprint"]


def test_streamed_deltas_concatenate_to_the_whole_text(rest: httpx.Client) -> None:
    whole = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=24)
    chunks = stream_chunks(rest, prompt=CAPITAL_PROMPT, max_tokens=24)
    assert len(chunks) > 1, "a stream of 24 tokens must arrive in several chunks"
    assert streamed_texts(chunks) == {0: whole["choices"][0]["text"]}
    assert chunks[-1]["choices"][0]["finish_reason"] == whole["choices"][0]["finish_reason"]
    assert all(c["choices"][0].get("finish_reason") is None for c in chunks[:-1])
    assert len({chunk["id"] for chunk in chunks}) == 1


def test_include_usage_ends_with_a_usage_chunk(rest: httpx.Client) -> None:
    chunks = stream_chunks(
        rest, prompt=CAPITAL_PROMPT, max_tokens=6, stream_options={"include_usage": True}
    )
    last = chunks[-1]
    assert last["choices"] == []
    assert last["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 6,
        "total_tokens": 11,
        "prompt_tokens_details": {"audio_tokens": 0, "cached_tokens": 0},
    }
    assert all("usage" not in chunk for chunk in chunks[:-1])


def test_stream_without_include_usage_has_no_usage_chunk(rest: httpx.Client) -> None:
    chunks = stream_chunks(rest, prompt=CAPITAL_PROMPT, max_tokens=4)
    assert all(chunk["choices"] for chunk in chunks)


def test_n_and_prompt_list_give_contract_indices(
    rest: httpx.Client, tokenizer: PreTrainedTokenizerBase
) -> None:
    prompts = [CAPITAL_PROMPT, "One, two, three,"]
    result = complete(rest, prompt=prompts, n=2, max_tokens=5, temperature=1, seed=7)
    assert [choice["index"] for choice in result["choices"]] == [0, 1, 2, 3]
    prompt_tokens = sum(len(tokenizer(p).input_ids) for p in prompts)
    completion_tokens = sum(
        len(tokenizer(c["text"], add_special_tokens=False).input_ids) for c in result["choices"]
    )
    assert result["usage"]["prompt_tokens"] == prompt_tokens
    assert result["usage"]["completion_tokens"] == 4 * 5 == completion_tokens
    assert result["usage"]["total_tokens"] == prompt_tokens + completion_tokens


def test_streamed_n_and_prompts_cover_every_index(rest: httpx.Client) -> None:
    chunks = stream_chunks(
        rest, prompt=[CAPITAL_PROMPT, "One, two,"], n=2, max_tokens=4, temperature=1, seed=3
    )
    finished = {
        choice["index"]
        for chunk in chunks
        for choice in chunk["choices"]
        if choice.get("finish_reason")
    }
    assert finished == {0, 1, 2, 3}


def test_stop_string_is_cut_with_finish_reason_stop(rest: httpx.Client) -> None:
    free = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=12)["choices"][0]["text"]
    assert "." in free, f"the test needs a '.' in the greedy text, got {free!r}"
    result = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=12, stop=".")
    choice = result["choices"][0]
    assert choice["text"] == free.split(".")[0]
    assert choice["finish_reason"] == "stop"
    streamed = stream_chunks(rest, prompt=CAPITAL_PROMPT, max_tokens=12, stop=["."])
    assert streamed_texts(streamed) == {0: free.split(".")[0]}
    assert streamed[-1]["choices"][0]["finish_reason"] == "stop"


def test_max_tokens_gives_finish_reason_length(rest: httpx.Client) -> None:
    result = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=3, ignore_eos=True)
    assert result["choices"][0]["finish_reason"] == "length"
    assert result["usage"]["completion_tokens"] == 3


def test_temperature_3_is_a_422_naming_the_field(rest: httpx.Client) -> None:
    response = post(rest, body(prompt=CAPITAL_PROMPT, temperature=3))
    assert response.status_code == 422
    assert response.headers["content-type"].startswith("application/json")
    detail = response.json()["detail"]
    assert detail[0]["loc"] == ["body", "temperature"]
    assert "temperature" in detail[0]["msg"] and "2" in detail[0]["msg"]


def test_unknown_model_is_a_404(rest: httpx.Client) -> None:
    response = post(rest, {"model": "no-such-model", "prompt": CAPITAL_PROMPT})
    assert response.status_code == 404
    assert "no-such-model" in response.json()["detail"]


@pytest.mark.parametrize(
    "extra",
    [
        {"prompt": 'Reply with {"stream": true} and nothing else'},
        {"prompt": CAPITAL_PROMPT, "stop": ['"stream": true']},
        {"prompt": CAPITAL_PROMPT, "user": '{"stream": true}'},
    ],
)
def test_stream_text_inside_fields_does_not_flip_the_mode(rest: httpx.Client, extra: dict) -> None:
    response = post(rest, body(max_tokens=4, stream=False, **extra))
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["choices"][0]["index"] == 0


def test_stream_mode_follows_the_transcoders_parse_of_stream(rest: httpx.Client) -> None:
    # The transcoder reads the string "true" as true: the framing follows the same parse.
    payload = body(prompt=CAPITAL_PROMPT, max_tokens=2, stream="true")
    with rest.stream("POST", "/v2/completions", json=payload) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in response.iter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0].removeprefix("data: "))["choices"]


def test_greedy_n_gives_n_identical_choices(rest: httpx.Client) -> None:
    single = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=6)["choices"][0]["text"]
    result = complete(rest, prompt=CAPITAL_PROMPT, max_tokens=6, n=3)
    assert [(c["index"], c["text"]) for c in result["choices"]] == [(i, single) for i in range(3)]
    assert result["usage"]["completion_tokens"] == 18


def test_other_paths_and_methods_get_json_errors(rest: httpx.Client) -> None:
    wrong_method = rest.get("/v2/completions")
    assert wrong_method.status_code == 405
    assert wrong_method.json() == {"detail": "Method Not Allowed"}
    unknown = rest.post("/v1/nothing", json={})
    assert unknown.status_code == 404
    assert unknown.json() == {"detail": "Not Found"}
