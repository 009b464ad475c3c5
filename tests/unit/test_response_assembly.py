"""service/api/responses.py: whole responses and stream chunks from hand-made vLLM
RequestOutput / CompletionOutput objects, as vLLM's own output-processing tests build them."""

from __future__ import annotations

import time
from datetime import datetime

import pytest
from google.protobuf import json_format
from llmcompletions.v2.completions_pb2 import CreateCompletionResponse
from unit_fakes import (
    EOS,
    FakeTokenizer,
    completion_output,
    logprob_step,
    request_output,
)
from vllm.logprobs import FlatLogprobs, Logprob
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

from service.api.errors import EngineUnavailableError, InternalError
from service.api.prompts import PreparedPrompt
from service.api.responses import (
    OBJECT_TYPE,
    ChoicePlan,
    EngineSlot,
    ResponseHeader,
    StreamAssembler,
    mean_logprob,
    stream_error_chunk,
    usage,
    whole_response,
)

HEADER = ResponseHeader("cmpl-test", 1_700_000_000, "smollm2-135m-instruct", "fp_0123")
CAPITAL = PreparedPrompt(token_ids=[2, 3, 4, 5, 6], text="The capital of France is")
HI = PreparedPrompt(token_ids=[14], text="Hi")
PARAMS = SamplingParams(max_tokens=4)


def plan(
    prompts: list[PreparedPrompt] | None = None,
    n: int = 1,
    candidates: int | None = None,
    echo: bool = False,
    keep_generated: bool = True,
    logprobs: int | None = None,
    **extras: bool,
) -> ChoicePlan:
    return ChoicePlan(
        prompts=prompts or [CAPITAL],
        n=n,
        candidates=n if candidates is None else candidates,
        echo=echo,
        keep_generated=keep_generated,
        logprobs=logprobs,
        tokenizer=FakeTokenizer(),
        **extras,
    )


def slot(prompt_index: int = 0, first_choice: int = 0) -> EngineSlot:
    return EngineSlot(prompt_index, first_choice, f"req-{prompt_index}-{first_choice}", PARAMS)


def as_json(message: CreateCompletionResponse) -> dict:
    """The message as the REST surface prints it (index 0 and empty lists included)."""
    return json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )


def texts(response: CreateCompletionResponse) -> list[tuple[int, str, str]]:
    return [(c.index, c.text, c.finish_reason) for c in response.choices]


def test_a_new_header_has_a_completion_id_and_the_time() -> None:
    before = int(time.time())
    header = ResponseHeader.new("m", "fp_1")
    assert header.id.startswith("cmpl-") and len(header.id) == len("cmpl-") + 32
    assert int(header.id[5:], 16) >= 0
    assert before <= header.created <= int(time.time())
    assert ResponseHeader.new("m", "fp_1").id != header.id


def test_one_prompt_one_choice() -> None:
    result = request_output([completion_output([7, 8], finish_reason="stop")])
    response = whole_response(HEADER, plan(), [(slot(), result)])
    assert as_json(response) == {
        "id": "cmpl-test",
        "object": OBJECT_TYPE,
        "created": 1_700_000_000,
        "model": "smollm2-135m-instruct",
        "system_fingerprint": "fp_0123",
        "choices": [{"index": 0, "text": " Paris.", "finish_reason": "stop", "stop_reason": None}],
        "usage": {
            "prompt_tokens": 5,
            "completion_tokens": 2,
            "total_tokens": 7,
            "prompt_tokens_details": {"audio_tokens": 0, "cached_tokens": 0},
        },
    }


def test_n_and_several_prompts_give_prompt_index_times_n_plus_i() -> None:
    prompts = [CAPITAL, HI]
    results = [
        (
            slot(0),
            request_output(
                # vLLM may list a request's sequences in any order
                [
                    completion_output([9], index=1),
                    completion_output([7], index=0, finish_reason="stop"),
                ]
            ),
        ),
        (
            slot(1),
            request_output(
                [completion_output([10, 11], index=0), completion_output([12], index=1)],
                prompt_token_ids=[14],
            ),
        ),
    ]
    response = whole_response(HEADER, plan(prompts, n=2), results)
    assert texts(response) == [
        (0, " Paris", "stop"),
        (1, " Lyon", "length"),
        (2, " A B", "length"),
        (3, " C", "length"),
    ]
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (6, 5)
    assert response.usage.total_tokens == 11


def test_greedy_copies_in_separate_engine_requests_become_consecutive_choices() -> None:
    results = [
        (slot(0, copy), request_output([completion_output([7])], request_id=f"r{copy}"))
        for copy in (1, 0, 2)
    ]
    response = whole_response(HEADER, plan(n=3), results)
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert {c.text for c in response.choices} == {" Paris"}
    assert response.usage.completion_tokens == 3


def test_best_of_returns_the_n_best_by_mean_logprob_and_counts_every_candidate() -> None:
    outputs = [
        completion_output([9, 8], index=0, cumulative_logprob=-3.0),  # mean -1.5
        completion_output([7], index=1, cumulative_logprob=-0.5),  # mean -0.5
        completion_output([10, 11, 12, 13], index=2, cumulative_logprob=-2.0),  # mean -0.5
        completion_output([11, 12], index=3, cumulative_logprob=-1.8),  # mean -0.9
    ]
    response = whole_response(HEADER, plan(n=2, candidates=4), [(slot(), request_output(outputs))])
    assert texts(response) == [(0, " Paris", "length"), (1, " A B C D", "length")]
    assert response.usage.completion_tokens == 9


def test_cached_tokens_count_each_prompt_once() -> None:
    """The engine's prefix-cache hits per prompt: greedy copies of one prompt (one engine
    request each) report the prompt's hit once, from its first request."""
    results = [
        (slot(0, 0), request_output([completion_output([7])], num_cached_tokens=16)),
        (slot(0, 1), request_output([completion_output([7])], num_cached_tokens=32)),
        (slot(1, 0), request_output([completion_output([9])], [14], num_cached_tokens=0)),
    ]
    response = whole_response(HEADER, plan([CAPITAL, HI], n=2), results)
    assert response.usage.prompt_tokens_details.cached_tokens == 16


def test_mean_logprob() -> None:
    assert mean_logprob(completion_output([1, 2, 3, 4], cumulative_logprob=-2.0)) == -0.5
    assert mean_logprob(completion_output([], cumulative_logprob=None)) == 0.0
    assert mean_logprob(completion_output([5], cumulative_logprob=None)) == 0.0


def test_echo_puts_the_prompt_first() -> None:
    result = request_output([completion_output([7], finish_reason="stop")])
    response = whole_response(HEADER, plan(echo=True), [(slot(), result)])
    assert texts(response) == [(0, "The capital of France is Paris", "stop")]
    assert response.usage.completion_tokens == 1


def test_max_tokens_zero_with_echo_returns_the_prompt_alone() -> None:
    # The engine ran one step (it must), its token is dropped and not counted.
    result = request_output([completion_output([7], finish_reason="stop")])
    response = whole_response(HEADER, plan(echo=True, keep_generated=False), [(slot(), result)])
    assert texts(response) == [(0, "The capital of France is", "length")]
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (5, 0)


def test_logprobs_of_generated_tokens() -> None:
    output = completion_output(
        [7, 8],
        logprobs=[logprob_step((7, -0.1), (9, -2.5)), logprob_step((8, -0.01), (8, -0.01))],
    )
    response = whole_response(HEADER, plan(logprobs=1), [(slot(), request_output([output]))])
    assert as_json(response)["choices"][0]["logprobs"] == {
        "tokens": [" Paris", "."],
        "token_logprobs": [-0.1, -0.01],
        "top_logprobs": [{" Paris": -0.1, " Lyon": -2.5}, {".": -0.01}],
        "text_offset": [0, 6],
    }


def test_no_logprobs_unless_asked() -> None:
    output = completion_output([7], logprobs=[logprob_step((7, -0.1))])
    response = whole_response(HEADER, plan(), [(slot(), request_output([output]))])
    assert not response.choices[0].HasField("logprobs")


def test_echo_with_logprobs_starts_with_a_null_for_the_first_prompt_token() -> None:
    prompt_logprobs = [None, *(logprob_step((t, -1.0 * t)) for t in (3, 4, 5, 6))]
    output = completion_output([7], logprobs=[logprob_step((7, -0.2))])
    result = request_output([output], prompt_logprobs=prompt_logprobs)
    response = whole_response(HEADER, plan(echo=True, logprobs=0), [(slot(), result)])
    logprobs = as_json(response)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["The", " capital", " of", " France", " is", " Paris"]
    assert logprobs["token_logprobs"] == [None, -3.0, -4.0, -5.0, -6.0, -0.2]
    assert logprobs["top_logprobs"][0] is None
    assert logprobs["top_logprobs"][1] == {" capital": -3.0}
    assert logprobs["text_offset"] == [0, 3, 11, 14, 21, 24]


def test_flat_logprobs_from_vllm_read_like_lists() -> None:
    flat = FlatLogprobs()
    flat.append(logprob_step((7, -0.1), (9, -2.5)))
    flat.append(logprob_step((8, -0.3)))
    output = completion_output([7, 8], logprobs=flat)
    response = whole_response(HEADER, plan(logprobs=1), [(slot(), request_output([output]))])
    logprobs = as_json(response)["choices"][0]["logprobs"]
    assert logprobs["token_logprobs"] == [-0.1, -0.3]
    assert logprobs["top_logprobs"] == [{" Paris": -0.1, " Lyon": -2.5}, {".": -0.3}]


def test_usage() -> None:
    assert as_json(usage(5, 7, 3)) == {
        "prompt_tokens": 5,
        "completion_tokens": 7,
        "total_tokens": 12,
        "prompt_tokens_details": {"audio_tokens": 0, "cached_tokens": 3},
    }


# ---- streaming


def delta(
    token_ids: list[int], index: int = 0, finish_reason: str | None = None, **kwargs: object
) -> RequestOutput:
    return request_output(
        [completion_output(token_ids, index=index, finish_reason=finish_reason)], **kwargs
    )


def stream(assembler: StreamAssembler, *deltas: tuple[EngineSlot, RequestOutput]) -> list[dict]:
    return [as_json(chunk) for s, d in deltas for chunk in assembler.chunks(s, d)]


def choices(chunks: list[dict]) -> list[tuple]:
    return [
        (c["index"], c["text"], c.get("finish_reason"))
        for chunk in chunks
        for c in chunk["choices"]
    ]


def test_each_delta_is_one_chunk_of_one_choice() -> None:
    assembler = StreamAssembler(HEADER, plan())
    chunks = stream(
        assembler,
        (slot(), delta([7])),
        (slot(), delta([8])),
        (slot(), delta([], finish_reason="stop")),
    )
    assert choices(chunks) == [(0, " Paris", None), (0, ".", None), (0, "", "stop")]
    assert all(chunk["id"] == "cmpl-test" and chunk["object"] == OBJECT_TYPE for chunk in chunks)
    assert all("usage" not in chunk for chunk in chunks)
    assert assembler.completion_tokens == 2


def test_an_empty_unfinished_delta_sends_nothing() -> None:
    assembler = StreamAssembler(HEADER, plan())
    assert assembler.chunks(slot(), delta([])) == []


def test_the_usage_chunk_has_no_choices_and_counts_everything_streamed() -> None:
    assembler = StreamAssembler(HEADER, plan([CAPITAL, HI], n=2))
    stream(
        assembler,
        (slot(0), delta([7, 8], index=1)),
        (slot(1), delta([10], index=0, prompt_token_ids=[14])),
        (slot(0), delta([9], index=0, finish_reason="length")),
    )
    final = as_json(assembler.usage_chunk())
    assert final["choices"] == []
    assert final["usage"] == {
        "prompt_tokens": 6,
        "completion_tokens": 4,
        "total_tokens": 10,
        "prompt_tokens_details": {"audio_tokens": 0, "cached_tokens": 0},
    }
    assert final["id"] == "cmpl-test"


def test_the_usage_chunk_reports_the_prompts_cached_tokens() -> None:
    assembler = StreamAssembler(HEADER, plan([CAPITAL, HI]))
    stream(
        assembler,
        (slot(0), delta([7], num_cached_tokens=16)),
        (slot(1), delta([10], prompt_token_ids=[14], num_cached_tokens=0)),
        (slot(0), delta([8], finish_reason="length", num_cached_tokens=16)),
    )
    assert assembler.usage_chunk().usage.prompt_tokens_details.cached_tokens == 16


def test_streamed_indices_follow_prompt_and_choice() -> None:
    assembler = StreamAssembler(HEADER, plan([CAPITAL, HI], n=2))
    chunks = stream(
        assembler,
        (slot(1), delta([10], index=1)),
        (slot(0), delta([7], index=0)),
        (slot(1, 0), delta([11], index=0)),
    )
    assert [index for index, *_ in choices(chunks)] == [3, 0, 2]


def test_greedy_copies_stream_under_their_own_index() -> None:
    assembler = StreamAssembler(HEADER, plan(n=2))
    chunks = stream(assembler, (slot(0, 1), delta([7])), (slot(0, 0), delta([9])))
    assert choices(chunks) == [(1, " Paris", None), (0, " Lyon", None)]


def test_echo_is_sent_once_per_choice_in_its_first_chunk() -> None:
    assembler = StreamAssembler(HEADER, plan(n=2, echo=True))
    chunks = stream(
        assembler,
        (slot(), delta([7], index=0)),
        (slot(), delta([9], index=1)),
        (slot(), delta([8], index=0, finish_reason="stop")),
    )
    assert choices(chunks) == [
        (0, "The capital of France is Paris", None),
        (1, "The capital of France is Lyon", None),
        (0, ".", "stop"),
    ]
    assert assembler.completion_tokens == 3


def test_streamed_echo_with_max_tokens_zero() -> None:
    assembler = StreamAssembler(HEADER, plan(echo=True, keep_generated=False))
    chunks = stream(assembler, (slot(), delta([7], finish_reason="length")))
    assert choices(chunks) == [(0, "The capital of France is", "length")]
    assert assembler.completion_tokens == 0


def test_streamed_text_offsets_continue_across_chunks() -> None:
    assembler = StreamAssembler(HEADER, plan(logprobs=0))
    first = request_output(
        [
            completion_output(
                [7, 9], logprobs=[logprob_step((7, -1)), logprob_step((9, -2))], finish_reason=None
            )
        ]
    )
    second = request_output(
        [completion_output([8], logprobs=[logprob_step((8, -3))], finish_reason="length")]
    )
    chunks = stream(assembler, (slot(), first), (slot(), second))
    offsets = [chunk["choices"][0]["logprobs"]["text_offset"] for chunk in chunks]
    assert offsets == [[0, 6], [11]]
    assert assembler.text_offsets == {0: 12}


def test_stream_error_chunk_carries_only_the_error() -> None:
    message = stream_error_chunk(EngineUnavailableError("The engine has stopped."))
    assert [field.name for field, _ in message.ListFields()] == ["error"]
    chunk = as_json(message)
    assert chunk["error"]["status_code"] == 503
    assert chunk["error"]["content"]["error"] == "The engine has stopped."
    stamp = datetime.fromisoformat(chunk["error"]["content"]["timestamp"])
    assert stamp.utcoffset() is not None and abs(stamp.timestamp() - time.time()) < 60
    assert as_json(stream_error_chunk(InternalError("boom")))["error"]["status_code"] == 500


def test_a_finished_choice_that_was_cut_at_eos_keeps_its_reason() -> None:
    result = request_output([completion_output([7, EOS], finish_reason="stop", text=" Paris")])
    response = whole_response(HEADER, plan(), [(slot(), result)])
    assert texts(response) == [(0, " Paris", "stop")]
    assert response.usage.completion_tokens == 2


# ---- vLLM's extras: stop_reason, token ids, prompt log-probabilities


@pytest.mark.parametrize(
    ("finish_reason", "stop_reason", "expected"),
    [("stop", None, None), ("stop", "\n", "\n"), ("stop", 13, 13), ("length", None, None)],
)
def test_stop_reason_says_what_ended_a_choice(
    finish_reason: str, stop_reason: int | str | None, expected: int | str | None
) -> None:
    output = completion_output([7], finish_reason=finish_reason, stop_reason=stop_reason)
    response = whole_response(HEADER, plan(), [(slot(), request_output([output]))])
    assert as_json(response)["choices"][0]["stop_reason"] == expected


def test_stop_reason_comes_with_a_streamed_choices_last_chunk_only() -> None:
    assembler = StreamAssembler(HEADER, plan())
    chunks = stream(
        assembler,
        (slot(), delta([7], finish_reason=None)),
        (slot(), request_output([completion_output([8], finish_reason="stop", stop_reason=13)])),
    )
    assert "stop_reason" not in chunks[0]["choices"][0]
    assert chunks[1]["choices"][0]["stop_reason"] == 13


def test_token_ids_of_the_output_and_of_the_prompt() -> None:
    result = request_output([completion_output([7, 8])])
    response = whole_response(HEADER, plan(echo=True, return_token_ids=True), [(slot(), result)])
    (choice,) = as_json(response)["choices"]
    assert choice["token_ids"] == [7, 8]  # generated only, also with echo
    assert choice["prompt_token_ids"] == CAPITAL.token_ids
    plain = whole_response(HEADER, plan(), [(slot(), result)])
    assert "token_ids" not in as_json(plain)["choices"][0]


def test_streamed_token_ids_are_deltas_and_the_prompts_come_first() -> None:
    assembler = StreamAssembler(HEADER, plan(return_token_ids=True))
    chunks = stream(
        assembler,
        (slot(), delta([], finish_reason=None)),  # an empty first delta sends nothing
        (slot(), delta([7], finish_reason=None)),
        (slot(), delta([8], finish_reason="length")),
    )
    assert [c["choices"][0]["token_ids"] for c in chunks] == [[7], [8]]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == CAPITAL.token_ids
    assert "prompt_token_ids" not in chunks[1]["choices"][0]


def test_prompt_logprobs_in_vllms_shape() -> None:
    steps = [None, {3: Logprob(-1.5, rank=2, decoded_token=" capital"), 9: Logprob(-0.2, 1, "x")}]
    result = request_output(
        [completion_output([7])], prompt_token_ids=[2, 3], prompt_logprobs=steps
    )
    response = whole_response(
        HEADER,
        plan([PreparedPrompt([2, 3], "The capital")], prompt_logprobs=True),
        [(slot(), result)],
    )
    assert as_json(response)["choices"][0]["prompt_logprobs"] == [
        None,
        {
            "3": {"logprob": -1.5, "rank": 2, "decoded_token": " capital"},
            "9": {"logprob": -0.2, "rank": 1, "decoded_token": "x"},
        },
    ]


def test_logprob_tokens_as_token_ids() -> None:
    step = {7: Logprob(-0.1, rank=1, decoded_token=" Paris"), 9: Logprob(-2.0, 2, " Lyon")}
    result = request_output([completion_output([7], logprobs=[step])])
    response = whole_response(HEADER, plan(logprobs=1, tokens_as_ids=True), [(slot(), result)])
    logprobs = as_json(response)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["token_id:7"]
    assert set(logprobs["top_logprobs"][0]) == {"token_id:7", "token_id:9"}
    assert logprobs["text_offset"] == [0]
