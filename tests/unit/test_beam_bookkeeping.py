"""service/api/beam_search.py: the scoring and stopping helpers, and the search loop over a tiny
fake engine whose next-token log-probabilities are a fixed table."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from google.protobuf import json_format
from unit_fakes import EOS, FakeTokenizer, completion_output, request_output
from vllm.logprobs import Logprob
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.sampling_params import SamplingParams

from service.api.beam_search import Beam, BeamSearchSettings, beam_search, completion, search_done
from service.api.prompts import PreparedPrompt
from service.api.responses import ChoicePlan, EngineSlot, ResponseHeader, whole_response

PROMPT = [2, 3]
# Generated-so-far -> next-token log-probabilities. Tokens: 10 " A", 11 " B", 12 " C", 13 " D".
TABLE: dict[tuple[int, ...], dict[int, float]] = {
    (): {10: -0.1, 11: -1.0, EOS: -3.0},
    (10,): {EOS: -0.2, 12: -2.0, 11: -2.5},
    (11,): {12: -0.05, EOS: -0.5, 13: -3.0},
}
ELSEWHERE = {EOS: -0.1, 12: -3.0, 13: -4.0}


def prompt_logprob(position: int) -> float:
    return -0.5 - position  # the fake engine's log-probability of the prompt token there


class FakeEngine:
    """Answers each one-token request from TABLE, as vLLM does with `logprobs=k`: the greedy
    token first, then the top k by rank (here the same list, as greedy is rank 1); and with
    `prompt_logprobs`, the prompt's (None for the first token, then each prompt token)."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], SamplingParams, str]] = []
        self.adapters: list[LoRARequest | None] = []
        self.priorities: list[int] = []

    async def generate(
        self,
        prompt: dict,
        params: SamplingParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        token_ids = list(prompt["prompt_token_ids"])
        self.calls.append((token_ids, params, request_id))
        self.adapters.append(lora_request)
        self.priorities.append(priority)
        await asyncio.sleep(0)
        ranked = sorted(
            TABLE.get(tuple(token_ids[len(PROMPT) :]), ELSEWHERE).items(),
            key=lambda item: item[1],
            reverse=True,
        )[: params.logprobs]
        step = {
            token_id: Logprob(logprob=value, rank=rank)
            for rank, (token_id, value) in enumerate(ranked, start=1)
        }
        chosen = ranked[0][0]
        prompt_logprobs = None
        if params.prompt_logprobs is not None:
            prompt_logprobs = [None] + [
                {token_id: Logprob(logprob=prompt_logprob(position), rank=1)}
                for position, token_id in enumerate(token_ids[1:], start=1)
            ]
        yield request_output(
            [completion_output([chosen], logprobs=[step], text="")],
            prompt_token_ids=token_ids,
            prompt_logprobs=prompt_logprobs,
            request_id=request_id,
        )


def run(
    settings: BeamSearchSettings, adapter: LoRARequest | None = None
) -> tuple[RequestOutput, FakeEngine]:
    engine = FakeEngine()
    search = beam_search(engine, FakeTokenizer(), PROMPT, "req", settings, adapter)  # type: ignore[arg-type]
    return asyncio.run(search), engine


def beams(result: RequestOutput) -> list[tuple[list[int], str, str | None]]:
    return [(list(o.token_ids), o.text, o.finish_reason) for o in result.outputs]


# ---- the helpers


def test_score_is_cumulative_logprob_over_length_to_the_penalty() -> None:
    beam = Beam(token_ids=[1, 2, 3, 4], cumulative_logprob=-2.0)
    assert beam.score(1.0) == -0.5
    assert beam.score(0.0) == -2.0
    assert beam.score(2.0) == -0.125
    assert beam.score(-1.0) == -8.0
    assert Beam(cumulative_logprob=-3.0).score(1.0) == -3.0  # empty: length counts as 1


def test_extending_a_beam_leaves_it_unchanged() -> None:
    step = {7: Logprob(-0.5), 9: Logprob(-1.5)}
    beam = Beam(token_ids=[2], cumulative_logprob=-1.0, logprobs=[{2: Logprob(-1.0)}])
    longer = beam.extended(9, step, 1)
    assert (longer.token_ids, longer.cumulative_logprob, longer.finish_reason) == (
        [2, 9],
        -2.5,
        "length",
    )
    assert longer.logprobs == [{2: Logprob(-1.0)}, {9: Logprob(-1.5), 7: Logprob(-0.5)}]
    assert (beam.token_ids, beam.cumulative_logprob, len(beam.logprobs)) == ([2], -1.0, 1)


STEP = {7: Logprob(-0.5, rank=1), 9: Logprob(-1.5, rank=2), 8: Logprob(-2.0, rank=3)}


@pytest.mark.parametrize(
    ("token_id", "shown", "expected"),
    [
        (9, 0, [9]),  # the token alone
        (9, 1, [9, 7]),  # the token, then the most likely
        (8, 2, [8, 7, 9]),  # a token outside the top `shown`: k + 1 entries
        (9, 2, [9, 7]),  # a token among the top `shown` is there once: k entries
        (7, 1, [7]),
        (7, 5, [7, 9, 8]),  # no more than the step holds
    ],
)
def test_a_beams_token_keeps_its_logprobs_first_then_the_top_shown(
    token_id: int, shown: int, expected: list[int]
) -> None:
    kept = Beam().extended(token_id, STEP, shown).logprobs[0]
    assert list(kept) == expected
    assert all(kept[token] is STEP[token] for token in kept)


def settings(**overrides: object) -> BeamSearchSettings:
    values: dict = {"width": 2, "returned": 2, "max_tokens": 10}
    values.update(overrides)
    return BeamSearchSettings(**values)


FINISHED = [Beam([1, 2], -1.0), Beam([1, 2, 3, 4], -2.0)]  # scores -0.5 and -0.5


def test_not_done_before_width_beams_finished() -> None:
    assert not search_done(FINISHED[:1], [Beam([5], -9.0)], settings(early_stopping=True), 1)


def test_early_stopping_true_stops_once_width_beams_finished() -> None:
    assert search_done(FINISHED, [Beam([5], -0.01)], settings(early_stopping=True), 1)


def test_done_when_nothing_runs_any_more() -> None:
    assert search_done(FINISHED, [], settings(early_stopping=False), 3)


def test_heuristic_stop_compares_the_worst_kept_with_the_best_running_now() -> None:
    # worst kept -0.5; a running beam at -0.9 after 2 tokens could reach -0.45 at best
    assert not search_done(FINISHED, [Beam([5, 6], -0.9)], settings(), 2)
    # at -1.1 after 2 tokens: -0.55 < -0.5, nothing running can beat the kept ones
    assert search_done(FINISHED, [Beam([5, 6], -1.1)], settings(), 2)
    # the best running beam counts, not the first
    assert not search_done(FINISHED, [Beam([5, 6], -1.1), Beam([7, 8], -0.9)], settings(), 2)


def test_never_assumes_running_beams_may_grow_to_max_tokens() -> None:
    never = settings(early_stopping="never", max_tokens=10)
    # -1.1 / 10 = -0.11 could still beat -0.5: keep going (the heuristic would stop)
    assert not search_done(FINISHED, [Beam([5, 6], -1.1)], never, 2)
    assert search_done(FINISHED, [Beam([5, 6], -6.0)], never, 2)
    # with a length penalty <= 0 longer is no better: the current length is used
    never_flat = settings(early_stopping="never", max_tokens=10, length_penalty=0.0)
    assert search_done([Beam([1], -1.0), Beam([2], -1.0)], [Beam([5, 6], -1.1)], never_flat, 2)


def test_a_finished_beam_hides_its_eos_from_the_text() -> None:
    tokenizer = FakeTokenizer()
    stopped = Beam([7, 8, EOS], -1.5, [{}, {}, {}], finish_reason="stop")
    output = completion(1, stopped, tokenizer, settings(skip_special_tokens=False), EOS)
    assert (output.index, output.text, list(output.token_ids)) == (1, " Paris.", [7, 8, EOS])
    assert (output.finish_reason, output.stop_reason, output.cumulative_logprob) == (
        "stop",
        EOS,
        -1.5,
    )
    running = Beam([7, EOS, 8], -2.0, [{}, {}, {}])
    shown = completion(0, running, tokenizer, settings(skip_special_tokens=False), EOS)
    assert (shown.text, shown.finish_reason, shown.stop_reason) == (" Paris</s>.", "length", None)
    hidden = completion(0, running, tokenizer, settings(skip_special_tokens=True), EOS)
    assert hidden.text == " Paris."


# ---- the search loop on the fake engine


def test_search_returns_the_best_beams_best_first() -> None:
    result, _ = run(settings(max_tokens=3, early_stopping=True))
    # After two steps three beams ended (" A", " B" + EOS, and EOS at once): done.
    # Scores: " A"+EOS -0.3/2, " B C" -1.05/2 (running), " B"+EOS -1.5/2, EOS -3.0/1.
    assert beams(result) == [([10, EOS], " A", "stop"), ([11, 12], " B C", "length")]
    assert [o.cumulative_logprob for o in result.outputs] == pytest.approx([-0.3, -1.05])
    assert [o.index for o in result.outputs] == [0, 1]
    assert result.finished and result.request_id == "req"
    assert result.prompt_token_ids == PROMPT


def test_each_step_asks_for_one_greedy_token_with_two_width_logprobs() -> None:
    _, engine = run(settings(max_tokens=3, early_stopping=True))
    assert [(tokens, request_id) for tokens, _, request_id in engine.calls] == [
        ([2, 3], "req-1-0"),
        ([2, 3, 10], "req-2-0"),
        ([2, 3, 11], "req-2-1"),
    ]
    for _, params, _ in engine.calls:
        assert (params.max_tokens, params.temperature, params.logprobs) == (1, 0.0, 4)
        assert not params.detokenize and params.prompt_logprobs is None


def test_the_first_step_alone_asks_for_the_prompts_logprobs() -> None:
    result, engine = run(settings(max_tokens=3, early_stopping=True, prompt_logprobs=2))
    asked = [params.prompt_logprobs for _, params, _ in engine.calls]
    assert asked == [2, None, None]  # one request per step for one beam, then two
    assert result.prompt_logprobs == [None, {3: Logprob(prompt_logprob(1), rank=1)}]
    without, _ = run(settings(max_tokens=3, early_stopping=True))
    assert without.prompt_logprobs is None
    # The search itself is the same.
    assert beams(result) == beams(without)


def test_more_logprobs_shown_than_expansions_are_asked_for_but_not_searched() -> None:
    # Width 1 tries 2 next tokens; showing 3 alternatives needs 3 from the engine.
    result, engine = run(settings(width=1, returned=1, max_tokens=5, logprobs=3))
    assert all(params.logprobs == 3 for _, params, _ in engine.calls)
    assert beams(result) == beams(run(settings(width=1, returned=1, max_tokens=5))[0])
    # The first token " A" with " A", " B" and EOS, the three most likely.
    assert list(result.outputs[0].logprobs[0]) == [10, 11, EOS]


def test_only_the_expansions_become_candidates() -> None:
    # Width 1 shows 2 alternatives: EOS (rank 3 at the start) must not end a beam there.
    result, _ = run(settings(width=1, returned=3, max_tokens=1, logprobs=2))
    assert beams(result) == [([10], " A", "length")]


def test_the_heuristic_keeps_searching_while_a_running_beam_could_win() -> None:
    result, engine = run(settings(max_tokens=3, early_stopping=False))
    # At step 2 the worst kept (-0.75) is below what " B C" could reach (-0.525): step 3.
    assert beams(result) == [([10, EOS], " A", "stop"), ([11, 12, EOS], " B C", "stop")]
    assert [o.cumulative_logprob for o in result.outputs] == pytest.approx([-0.3, -1.15])
    assert len(engine.calls) == 5


def test_the_length_penalty_decides_between_finished_beams() -> None:
    # Penalty 0: raw sums. " A"+EOS -0.3, " B C"+EOS -1.15, " B"+EOS -1.5 (" B C" went on).
    result, _ = run(settings(max_tokens=3, returned=3, length_penalty=0.0))
    assert [list(o.token_ids) for o in result.outputs] == [[10, EOS], [11, 12, EOS], [11, EOS]]
    # Penalty 4 favours length: -1.15/3^4 beats everything shorter.
    result, _ = run(settings(max_tokens=3, returned=2, length_penalty=4.0))
    assert [list(o.token_ids) for o in result.outputs] == [[11, 12, EOS], [10, EOS]]


def test_ignore_eos_keeps_eos_beams_running() -> None:
    result, _ = run(settings(max_tokens=3, ignore_eos=True))
    assert beams(result) == [([10, EOS, EOS], " A", "length"), ([11, 12, EOS], " B C", "length")]


def test_width_one_is_greedy() -> None:
    result, engine = run(settings(width=1, returned=1, max_tokens=5))
    assert beams(result) == [([10, EOS], " A", "stop")]
    assert all(params.logprobs == 2 for _, params, _ in engine.calls)


def test_max_tokens_bounds_the_search() -> None:
    result, engine = run(settings(max_tokens=1, returned=2))
    assert beams(result) == [([10], " A", "length"), ([11], " B", "length")]
    assert len(engine.calls) == 1


def response_of(result: RequestOutput, echo: bool, logprobs: int, n: int) -> dict:
    """The whole response the service makes of a beam-search result (as JSON)."""
    plan = ChoicePlan(
        prompts=[PreparedPrompt(token_ids=PROMPT, text="The capital")],
        n=n,
        candidates=n,
        echo=echo,
        keep_generated=True,
        logprobs=logprobs,
        tokenizer=FakeTokenizer(),
    )
    slot = EngineSlot(0, 0, "req", settings())
    return json_format.MessageToDict(
        whole_response(ResponseHeader.new("m", "fp"), plan, [(slot, result)])
    )


@pytest.mark.parametrize("logprobs", [0, 1, 3])
def test_a_beams_chosen_token_is_among_its_top_logprobs(logprobs: int) -> None:
    result, _ = run(settings(max_tokens=2, returned=2, early_stopping=True, logprobs=logprobs))
    assert [list(o.token_ids) for o in result.outputs][1] == [11, 12]  # " B" was rank 2
    choices = response_of(result, echo=False, logprobs=logprobs, n=2)["choices"]
    for choice in choices:
        shown = choice["logprobs"]
        for token, value, top in zip(
            shown["tokens"], shown["token_logprobs"], shown["top_logprobs"], strict=True
        ):
            assert top[token] == value
            assert len(top) in (max(logprobs, 1), logprobs + 1)  # k, or k + 1 with the token
    second = choices[1]["logprobs"]
    assert second["tokens"] == [" B", " C"]
    assert second["token_logprobs"] == [-1.0, -0.05]
    expected_first = {" B": -1.0, " A": -0.1, "</s>": -3.0}
    assert second["top_logprobs"][0] == dict(list(expected_first.items())[: logprobs + 1])


def test_beam_search_echo_with_logprobs_scores_the_prompt() -> None:
    result, _ = run(settings(max_tokens=2, returned=1, early_stopping=True, prompt_logprobs=0))
    logprobs = response_of(result, echo=True, logprobs=0, n=1)["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["The", " capital", " A", "</s>"]
    assert logprobs["token_logprobs"] == [None, prompt_logprob(1), -0.1, -0.2]
    assert logprobs["top_logprobs"][:2] == [None, {" capital": prompt_logprob(1)}]


def test_every_step_runs_with_the_requests_adapter() -> None:
    adapter = LoRARequest("a1", 1, "/adapters/a1")
    _, engine = run(BeamSearchSettings(width=2, returned=2, max_tokens=3), adapter)
    assert len(engine.adapters) > 1
    assert all(used is adapter for used in engine.adapters)
    _, engine = run(BeamSearchSettings(width=2, returned=2, max_tokens=3))
    assert set(engine.adapters) == {None}


def test_every_step_runs_with_the_requests_priority() -> None:
    _, engine = run(BeamSearchSettings(width=2, returned=2, max_tokens=3, priority=-4))
    assert len(engine.priorities) > 1 and set(engine.priorities) == {-4}
