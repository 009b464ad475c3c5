"""service/api/sampling.py: requests as vLLM SamplingParams and beam-search settings."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf import json_format, struct_pb2
from unit_fakes import make_request
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    SamplingType,
    StructuredOutputsParams,
)
from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

from service.api.beam_search import BeamSearchSettings
from service.api.sampling import (
    DEFAULT_MAX_TOKENS,
    beam_search_settings,
    early_stopping,
    engine_seed,
    is_greedy,
    requested_candidates,
    requested_max_tokens,
    requested_n,
    sampling_params,
    stop_strings,
)

# What a model's generation_config.json may contribute (vLLM's get_diff_sampling_param()).
MODEL_DEFAULTS = {"temperature": 0.6, "top_p": 0.9, "top_k": 50, "repetition_penalty": 1.1}


def params(
    engine_n: int = 1, defaults: dict[str, Any] | None = None, **fields: Any
) -> SamplingParams:
    """SamplingParams for an engine request of `engine_n` sequences of a request with `fields`."""
    return sampling_params(make_request(**fields), defaults or {}, engine_n)


def test_an_empty_request_gets_the_documented_defaults() -> None:
    built = params()
    assert built.n == 1
    assert built.max_tokens == DEFAULT_MAX_TOKENS == 16
    assert (built.temperature, built.top_p, built.top_k, built.min_p) == (1.0, 1.0, 0, 0.0)
    assert (built.frequency_penalty, built.presence_penalty, built.repetition_penalty) == (
        0.0,
        0.0,
        1.0,
    )
    assert built.stop == [] and built.stop_token_ids == []
    assert built.logprobs is None and built.prompt_logprobs is None
    assert built.seed is None and built.logit_bias is None and built.structured_outputs is None
    assert built.skip_special_tokens and built.spaces_between_special_tokens
    assert not built.ignore_eos and not built.include_stop_str_in_output
    assert built.output_kind == RequestOutputKind.FINAL_ONLY


def test_model_defaults_fill_unset_fields_and_the_request_wins() -> None:
    built = params(defaults=MODEL_DEFAULTS)
    assert (built.temperature, built.top_p, built.top_k, built.repetition_penalty) == (
        0.6,
        0.9,
        50,
        1.1,
    )
    built = params(defaults=MODEL_DEFAULTS, temperature=1.5, top_p=0.5, top_k=3)
    assert (built.temperature, built.top_p, built.top_k, built.repetition_penalty) == (
        1.5,
        0.5,
        3,
        1.1,
    )


def test_every_passthrough_field_reaches_vllm() -> None:
    built = params(
        temperature=0.7,
        top_p=0.8,
        min_p=0.05,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.2,
        seed=12345,
        ignore_eos=True,
        min_tokens=4,
        max_tokens=9,
        logprobs=3,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        include_stop_str_in_output=True,
    )
    assert built.temperature == 0.7 and built.top_p == 0.8 and built.min_p == 0.05
    assert (built.frequency_penalty, built.presence_penalty, built.repetition_penalty) == (
        0.5,
        -0.5,
        1.2,
    )
    assert built.seed == 12345  # a non-negative seed is passed on as it is
    assert built.ignore_eos and built.min_tokens == 4 and built.max_tokens == 9
    assert built.logprobs == 3
    assert not built.skip_special_tokens and not built.spaces_between_special_tokens
    assert built.include_stop_str_in_output


@pytest.mark.parametrize(("top_k", "expected"), [(-1, 0), (0, 0), (1, 1), (40, 40)])
def test_top_k_minus_one_and_zero_both_mean_all_tokens(top_k: int, expected: int) -> None:
    assert params(top_k=top_k).top_k == expected
    assert params(defaults={"top_k": 20}, top_k=top_k).top_k == expected


def test_stream_asks_vllm_for_deltas() -> None:
    assert params(stream=True).output_kind == RequestOutputKind.DELTA
    assert params(stream=False).output_kind == RequestOutputKind.FINAL_ONLY


@pytest.mark.parametrize(
    ("stop", "expected"), [("\n", ["\n"]), (["a", "bc"], ["a", "bc"]), (None, [])]
)
def test_stop_strings(stop: Any, expected: list[str]) -> None:
    assert params(stop=stop).stop == expected


def test_stop_strings_of_each_value_kind() -> None:
    assert stop_strings(json_format.ParseDict("x", struct_pb2.Value())) == ["x"]
    assert stop_strings(json_format.ParseDict(["x", "y"], struct_pb2.Value())) == ["x", "y"]
    assert stop_strings(json_format.ParseDict(None, struct_pb2.Value())) is None
    assert stop_strings(struct_pb2.Value()) is None


def test_stop_token_ids_and_logit_bias() -> None:
    built = params(stop_token_ids=[7, 8], logit_bias={"7": 100, "9": -100, "3": 0.5})
    assert built.stop_token_ids == [7, 8]
    assert built.logit_bias == {7: 100.0, 9: -100.0, 3: 0.5}


@pytest.mark.parametrize(("max_tokens", "engine_max"), [(0, 1), (1, 1), (300, 300)])
def test_max_tokens_zero_still_runs_one_engine_step(max_tokens: int, engine_max: int) -> None:
    assert params(max_tokens=max_tokens).max_tokens == engine_max


def test_prompt_logprobs_only_for_echo_with_logprobs() -> None:
    assert params(echo=True, logprobs=2).prompt_logprobs == 2
    assert params(echo=True, logprobs=0).prompt_logprobs == 0
    assert params(echo=True).prompt_logprobs is None
    assert params(logprobs=2).prompt_logprobs is None


@pytest.mark.parametrize(
    ("fields", "logprobs", "prompt_logprobs"),
    [
        ({}, 0, None),
        ({"logprobs": 3}, 3, None),
        ({"echo": True}, 0, None),
        ({"echo": True, "logprobs": 0}, 0, 0),
        ({"echo": True, "logprobs": 2}, 2, 2),
    ],
)
def test_beam_search_asks_for_the_logprobs_sampling_would(
    fields: dict[str, Any], logprobs: int, prompt_logprobs: int | None
) -> None:
    settings = beam_search_settings(make_request(use_beam_search=True, **fields))
    assert (settings.logprobs, settings.prompt_logprobs) == (logprobs, prompt_logprobs)
    assert settings.prompt_logprobs == params(**fields).prompt_logprobs


def test_best_of_above_n_asks_for_logprobs_to_rank_candidates() -> None:
    assert params(n=4, best_of=4).logprobs is None
    assert params(4, n=1, best_of=4).logprobs == 0
    assert params(4, n=1, best_of=4, logprobs=3).logprobs == 3
    assert params(4, n=1, best_of=4).n == 4


def test_greedy_sampling_resets_the_other_samplers() -> None:
    built = params(temperature=0, top_p=0.5, top_k=5, min_p=0.3)
    assert (built.temperature, built.top_p, built.top_k, built.min_p) == (0.0, 1.0, 0, 0.0)


def test_greedy_with_more_than_one_sequence_is_vllms_error() -> None:
    # Why the handler sends greedy candidates as separate engine requests of n=1.
    with pytest.raises(VLLMValidationError):
        params(2, temperature=0, n=2)


def test_an_output_constraint_is_attached() -> None:
    built = params(guided_choice=["yes", "no"])
    assert built.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])


@pytest.mark.parametrize(
    ("fields", "defaults", "greedy"),
    [
        ({"temperature": 0}, {}, True),
        ({"temperature": 1e-6}, {}, True),
        ({"temperature": 1e-5}, {}, False),
        ({"temperature": 0.5}, {}, False),
        ({}, {}, False),
        ({}, {"temperature": 0.0}, True),
        ({"temperature": 1}, {"temperature": 0.0}, False),
    ],
)
def test_is_greedy(fields: dict, defaults: dict, greedy: bool) -> None:
    assert is_greedy(make_request(**fields), defaults) is greedy


def test_requested_counts() -> None:
    assert requested_max_tokens(make_request()) == 16
    assert requested_max_tokens(make_request(max_tokens=0)) == 0
    assert requested_n(make_request()) == 1
    assert requested_n(make_request(n=3)) == 3
    assert requested_candidates(make_request(n=3)) == 3
    assert requested_candidates(make_request(n=3, best_of=5)) == 5
    assert requested_candidates(make_request(best_of=2)) == 2


@pytest.mark.parametrize(
    ("json_value", "expected"), [(True, True), (False, False), ("never", "never"), (None, False)]
)
def test_early_stopping_values(json_value: Any, expected: bool | str) -> None:
    assert early_stopping(json_format.ParseDict(json_value, struct_pb2.Value())) == expected
    assert early_stopping(struct_pb2.Value()) is False


def test_beam_search_settings_defaults() -> None:
    assert beam_search_settings(make_request(use_beam_search=True)) == BeamSearchSettings(
        width=1,
        returned=1,
        max_tokens=16,
        length_penalty=1.0,
        early_stopping=False,
        ignore_eos=False,
        skip_special_tokens=True,
    )


def test_beam_search_settings_from_a_full_request() -> None:
    settings = beam_search_settings(
        make_request(
            use_beam_search=True,
            n=2,
            best_of=5,
            max_tokens=0,
            length_penalty=-0.5,
            early_stopping="never",
            ignore_eos=True,
            skip_special_tokens=False,
        )
    )
    assert settings == BeamSearchSettings(
        width=5,
        returned=2,
        max_tokens=1,
        length_penalty=-0.5,
        early_stopping="never",
        ignore_eos=True,
        skip_special_tokens=False,
    )
    assert beam_search_settings(make_request(n=3, early_stopping=True)).width == 3
    assert beam_search_settings(make_request(n=3, early_stopping=True)).early_stopping is True


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@pytest.mark.parametrize("seed", [-1, -2, INT64_MIN, INT64_MIN + 1])
def test_negative_seeds_are_seeds_like_any_other(seed: int) -> None:
    built = params(seed=seed, temperature=1.0)
    # vLLM would read -1 as no seed; every accepted seed must seed the engine.
    assert built.seed is not None and 0 <= built.seed < 2**64
    assert built.sampling_type == SamplingType.RANDOM_SEED
    assert params(seed=seed, temperature=1.0).seed == built.seed  # the same every time


def test_seed_minus_one_survives_the_trip_to_the_engine_core() -> None:
    # The engine core decodes the params again, running __post_init__ (-1 -> None) once more.
    built = params(seed=-1, temperature=1.0)
    sent = MsgpackDecoder(SamplingParams).decode(MsgpackEncoder().encode(built))
    assert sent.seed == built.seed == 2**63


def test_distinct_seeds_stay_distinct() -> None:
    seeds = [INT64_MIN, INT64_MIN + 1, -2, -1, 0, 1, 2, INT64_MAX - 1, INT64_MAX]
    mapped = [engine_seed(seed, 1) for seed in seeds]
    assert len(set(mapped)) == len(seeds)
    assert mapped[4:] == seeds[4:]  # non-negative seeds unchanged (as before the fix)
    assert (mapped[0], mapped[3]) == (2**64 - 1, 2**63)
    assert all(0 <= value < 2**64 for value in mapped)


@pytest.mark.parametrize("n", [2, 128])
def test_every_sequence_seed_fits_vllms_range(n: int) -> None:
    # vLLM seeds the i-th of n sequences with seed + i; msgpack carries at most 2**64 - 1.
    for seed in (INT64_MIN, INT64_MIN + 1, -1, INT64_MAX):
        assert engine_seed(seed, n) + n - 1 < 2**64
        assert params(engine_n=n, seed=seed, temperature=1.0).seed == engine_seed(seed, n)
    assert engine_seed(-1, n) == 2**63 and engine_seed(INT64_MIN, n) == 2**64 - n


def test_prompt_logprobs_as_asked_win_over_echos() -> None:
    assert params(prompt_logprobs=2).prompt_logprobs == 2
    assert params(prompt_logprobs=0, echo=True, logprobs=3).prompt_logprobs == 0
    assert params(echo=True, logprobs=3).prompt_logprobs == 3


def test_allowed_token_ids_reach_vllm() -> None:
    assert params(allowed_token_ids=[3, 7]).allowed_token_ids == [3, 7]
    assert params().allowed_token_ids is None
