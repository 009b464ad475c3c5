"""Beam search over the engine, with `length_penalty` and `early_stopping` as in Hugging Face
transformers (vLLM's own helper has no early stopping). Each step asks the engine for one
token per running beam with the top 2*width log-probabilities (more if the response shows
more); prefix caching makes the repeated prompt cheap."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import islice

from vllm.inputs import TokensPrompt
from vllm.logprobs import Logprob, PromptLogprobs
from vllm.lora.request import LoRARequest
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
    logprobs: int = 0  # the most likely alternatives each returned token shows
    prompt_logprobs: int | None = None  # echo with logprobs: the prompt's, as for sampling
    priority: int = 0  # the scheduling priority of every step's engine requests

    @property
    def expansions(self) -> int:
        """Next tokens tried per running beam: enough that `width` go on even if one is EOS."""
        return 2 * self.width


@dataclass
class Beam:
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str = "length"

    def score(self, length_penalty: float) -> float:
        return self.cumulative_logprob / (max(len(self.token_ids), 1) ** length_penalty)

    def extended(self, token_id: int, step: dict[int, Logprob], shown: int) -> Beam:
        """The beam one token longer. That token's log-probabilities are kept as vLLM reports
        a sampled token's: the token first, then the `shown` most likely (`step`, a greedy
        step's, lists the greedy token and then the rest by rank: the most likely first)."""
        chosen = step[token_id]
        return Beam(
            [*self.token_ids, token_id],
            self.cumulative_logprob + chosen.logprob,
            [*self.logprobs, {token_id: chosen, **dict(islice(step.items(), shown))}],
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


def step_params(settings: BeamSearchSettings, first: bool) -> SamplingParams:
    """One greedy token with the log-probabilities the search and the response need; on the
    first step (a single beam: the prompt alone) also the prompt's, if asked for."""
    return SamplingParams(
        max_tokens=1,
        temperature=0.0,
        logprobs=max(settings.expansions, settings.logprobs),
        prompt_logprobs=settings.prompt_logprobs if first else None,
        detokenize=False,
    )


async def next_steps(
    engine: AsyncLLM,
    prompt_ids: list[int],
    beams: Sequence[Beam],
    request_id: str,
    params: SamplingParams,
    adapter: LoRARequest | None = None,
    priority: int = 0,
) -> list[RequestOutput]:
    """Each beam's one-token engine request, run together (with the request's adapter, if
    any); their final outputs."""
    steps = await asyncio.gather(
        *(
            collect_from_async_generator(
                engine.generate(
                    TokensPrompt(prompt_token_ids=prompt_ids + beam.token_ids),
                    params,
                    f"{request_id}-{index}",
                    lora_request=adapter,
                    priority=priority,
                )
            )
            for index, beam in enumerate(beams)
        )
    )
    return [outputs[-1] for outputs in steps]


def expand(
    running: Sequence[Beam],
    outputs: Sequence[RequestOutput],
    settings: BeamSearchSettings,
    eos: int,
) -> tuple[list[Beam], list[Beam]]:
    """Each running beam extended by each of its `expansions` most likely next tokens: the
    candidates that may go on, best first, and those that ended with EOS."""
    going_on: list[Beam] = []
    ended: list[Beam] = []
    for beam, output in zip(running, outputs, strict=True):
        step = output.outputs[0].logprobs[0]
        for token_id in islice(step, settings.expansions):
            candidate = beam.extended(token_id, step, settings.logprobs)
            if token_id == eos and not settings.ignore_eos:
                candidate.finish_reason = "stop"
                ended.append(candidate)
            else:
                going_on.append(candidate)
    going_on.sort(key=lambda beam: beam.cumulative_logprob, reverse=True)
    return going_on, ended


async def beam_search(
    engine: AsyncLLM,
    tokenizer: TokenizerLike,
    prompt_ids: list[int],
    request_id: str,
    settings: BeamSearchSettings,
    adapter: LoRARequest | None = None,
) -> RequestOutput:
    """The `returned` best beams, best first, as one finished RequestOutput (with the
    prompt's log-probabilities if `prompt_logprobs` asks for them)."""
    eos_token_id = tokenizer.eos_token_id
    running = [Beam()]
    finished: list[Beam] = []
    prompt_logprobs: PromptLogprobs | None = None
    cached_tokens: int | None = None
    for length in range(1, settings.max_tokens + 1):
        params = step_params(settings, first=length == 1)
        outputs = await next_steps(
            engine,
            prompt_ids,
            running,
            f"{request_id}-{length}",
            params,
            adapter,
            settings.priority,
        )
        if length == 1:
            prompt_logprobs = outputs[0].prompt_logprobs
            cached_tokens = outputs[0].num_cached_tokens
        candidates, ended = expand(running, outputs, settings, eos_token_id)
        finished += ended
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
        prompt_logprobs=prompt_logprobs,
        outputs=[
            completion(index, beam, tokenizer, settings, eos_token_id)
            for index, beam in enumerate(best)
        ],
        finished=True,
        num_cached_tokens=cached_tokens,
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
