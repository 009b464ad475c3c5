"""Beam search over the engine, with `length_penalty` and `early_stopping` as in Hugging Face
transformers (vLLM's own helper has no early stopping). Each step asks the engine for one
token per running beam with the top 2*width log-probabilities; prefix caching makes the
repeated prompt cheap."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from vllm.inputs import TokensPrompt
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput
from vllm.sampling_params import SamplingParams
from vllm.tokenizers import TokenizerLike
from vllm.utils.async_utils import collect_from_async_generator
from vllm.v1.engine.async_llm import AsyncLLM

EarlyStopping = bool | str  # True, False or "never"


@dataclass(frozen=True)
class BeamSearchSettings:
    width: int
    returned: int  # the best `returned` beams become choices
    max_tokens: int
    length_penalty: float = 1.0
    early_stopping: EarlyStopping = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True


@dataclass
class Beam:
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str = "length"

    def score(self, length_penalty: float) -> float:
        return self.cumulative_logprob / (max(len(self.token_ids), 1) ** length_penalty)

    def extended(self, token_id: int, step: dict[int, Logprob]) -> Beam:
        return Beam(
            [*self.token_ids, token_id],
            self.cumulative_logprob + step[token_id].logprob,
            [*self.logprobs, step],
        )


def search_done(
    finished: list[Beam], running: Sequence[Beam], settings: BeamSearchSettings, length: int
) -> bool:
    """Hugging Face's stopping rule for beam hypotheses."""
    if len(finished) < settings.width:
        return False
    if settings.early_stopping is True or not running:
        return True
    penalty = settings.length_penalty
    best_running = max(beam.cumulative_logprob for beam in running)
    if settings.early_stopping == "never" and penalty > 0:
        length = settings.max_tokens  # the best score a running beam could still reach
    attainable = best_running / (length**penalty)
    worst_kept = sorted(beam.score(penalty) for beam in finished)[-settings.width]
    return worst_kept >= attainable


async def next_tokens(
    engine: AsyncLLM, prompt_ids: list[int], beams: Sequence[Beam], request_id: str, top: int
) -> list[dict[int, Logprob]]:
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=top, detokenize=False)
    steps = await asyncio.gather(
        *(
            collect_from_async_generator(
                engine.generate(
                    TokensPrompt(prompt_token_ids=prompt_ids + beam.token_ids),
                    params,
                    f"{request_id}-{index}",
                )
            )
            for index, beam in enumerate(beams)
        )
    )
    return [outputs[-1].outputs[0].logprobs[0] for outputs in steps]


async def beam_search(
    engine: AsyncLLM,
    tokenizer: TokenizerLike,
    prompt_ids: list[int],
    request_id: str,
    settings: BeamSearchSettings,
) -> RequestOutput:
    """The `returned` best beams, best first, as one finished RequestOutput."""
    eos_token_id = tokenizer.eos_token_id
    running = [Beam()]
    finished: list[Beam] = []
    for length in range(1, settings.max_tokens + 1):
        steps = await next_tokens(
            engine, prompt_ids, running, f"{request_id}-{length}", 2 * settings.width
        )
        candidates: list[Beam] = []
        for beam, step in zip(running, steps, strict=True):
            for token_id in step:
                candidate = beam.extended(token_id, step)
                if token_id == eos_token_id and not settings.ignore_eos:
                    candidate.finish_reason = "stop"
                    finished.append(candidate)
                else:
                    candidates.append(candidate)
        candidates.sort(key=lambda beam: beam.cumulative_logprob, reverse=True)
        running = candidates[: settings.width]
        if search_done(finished, running, settings, length):
            break
    best = sorted(
        [*finished, *running], key=lambda beam: beam.score(settings.length_penalty), reverse=True
    )[: settings.returned]
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=prompt_ids,
        prompt_logprobs=None,
        outputs=[
            completion(index, beam, tokenizer, settings, eos_token_id)
            for index, beam in enumerate(best)
        ],
        finished=True,
    )


def completion(
    index: int, beam: Beam, tokenizer: TokenizerLike, settings: BeamSearchSettings, eos: int
) -> CompletionOutput:
    visible = beam.token_ids[:-1] if beam.finish_reason == "stop" else beam.token_ids
    return CompletionOutput(
        index=index,
        text=tokenizer.decode(visible, skip_special_tokens=settings.skip_special_tokens),
        token_ids=beam.token_ids,
        cumulative_logprob=beam.cumulative_logprob,
        logprobs=beam.logprobs,
        finish_reason=beam.finish_reason,
        stop_reason=eos if beam.finish_reason == "stop" else None,
    )
