"""Translation of a validated CreateCompletionRequest into vLLM's SamplingParams."""

from __future__ import annotations

from typing import Any

from google.protobuf import struct_pb2
from llmcompletions.v2.completions_pb2 import CreateCompletionRequest
from vllm.sampling_params import RequestOutputKind, SamplingParams

from service.api.beam_search import BeamSearchSettings, EarlyStopping
from service.api.constraints import structured_outputs

DEFAULT_MAX_TOKENS = 16

# Request fields passed to SamplingParams under the same name when the caller set them.
OPTIONAL_PASSTHROUGH = (
    "temperature",
    "top_p",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "ignore_eos",
    "min_tokens",
    "logprobs",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "include_stop_str_in_output",
)


GREEDY_TEMPERATURE = 1e-5  # vLLM samples greedily below this
SEED_LIMIT = 2**64  # vLLM's seeds are below this (msgpack and torch.Generator)


def engine_seed(seed: int, sequences: int) -> int:
    """The request's signed 64-bit seed as the non-negative seed vLLM is given.

    vLLM reads seed -1 as "no seed" (SamplingParams.__post_init__, run again where the engine
    core decodes the params), and a negative seed s seeds torch.Generator like 2**64 - 1 + s.
    It carries seeds up to 2**64 - 1 (msgpack's limit; torch's too), and seeds the i-th of `n`
    sequences with seed + i. So seeds >= 0 are kept and s < 0 becomes 2**63 - 1 - s: one to
    one onto [0, 2**64), -1 to 2**63, -2**63 to 2**64 - 1. Only for the seeds nearest -2**63
    with n > 1 would seed + i pass the limit; those are lowered to 2**64 - n (reproducible
    still, sharing a sequence's seed with the neighbouring seeds, as seed + i always does).
    """
    unsigned = seed if seed >= 0 else 2**63 - 1 - seed
    return min(unsigned, SEED_LIMIT - sequences)


def requested_max_tokens(request: CreateCompletionRequest) -> int:
    return request.max_tokens if request.HasField("max_tokens") else DEFAULT_MAX_TOKENS


def stop_strings(stop: struct_pb2.Value) -> list[str] | None:
    kind = stop.WhichOneof("kind")
    if kind == "string_value":
        return [stop.string_value]
    if kind == "list_value":
        return [item.string_value for item in stop.list_value.values]
    return None


def requested_n(request: CreateCompletionRequest) -> int:
    return request.n if request.HasField("n") else 1


def requested_candidates(request: CreateCompletionRequest) -> int:
    """Sequences sampled per prompt: best_of, else n."""
    return request.best_of if request.HasField("best_of") else requested_n(request)


def requested_logprobs(request: CreateCompletionRequest) -> int | None:
    return request.logprobs if request.HasField("logprobs") else None


def prompt_logprobs(request: CreateCompletionRequest) -> int | None:
    """Log-probabilities per prompt token: as `prompt_logprobs` asks, else for echo with
    logprobs (the response shows them for the echoed prompt), as vLLM's server does."""
    if request.HasField("prompt_logprobs"):
        return request.prompt_logprobs
    return requested_logprobs(request) if request.echo else None


def is_greedy(request: CreateCompletionRequest, model_defaults: dict[str, Any]) -> bool:
    temperature = (
        request.temperature
        if request.HasField("temperature")
        else model_defaults.get("temperature", 1.0)
    )
    return temperature < GREEDY_TEMPERATURE


def sampling_params(
    request: CreateCompletionRequest, model_defaults: dict[str, Any], n: int
) -> SamplingParams:
    """SamplingParams for one engine request of `n` sequences.

    Unset fields take the model's generation-config defaults, then vLLM's, as vLLM's own
    OpenAI server does. `max_tokens: 0` still runs one engine step (echo and prompt
    log-probabilities need the prompt pass); the response drops that token.
    """
    params: dict[str, Any] = {
        name: model_defaults[name]
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
        if name in model_defaults
    }
    for name in OPTIONAL_PASSTHROUGH:
        if request.HasField(name):
            params[name] = getattr(request, name)
    if request.HasField("seed"):
        params["seed"] = engine_seed(request.seed, n)
    if request.HasField("top_k"):
        params["top_k"] = max(request.top_k, 0)  # -1 and 0 both mean all tokens
    if request.HasField("stop"):
        params["stop"] = stop_strings(request.stop)
    if request.stop_token_ids:
        params["stop_token_ids"] = list(request.stop_token_ids)
    if request.logit_bias:
        params["logit_bias"] = dict(request.logit_bias)
    if request.allowed_token_ids:
        params["allowed_token_ids"] = list(request.allowed_token_ids)
    constraint = structured_outputs(request)
    if constraint is not None:
        params["structured_outputs"] = constraint
    if requested_candidates(request) > requested_n(request) and "logprobs" not in params:
        params["logprobs"] = 0  # ranking best_of candidates needs their log-probabilities
    params["prompt_logprobs"] = prompt_logprobs(request)
    max_tokens = requested_max_tokens(request)
    return SamplingParams.from_optional(
        **params,
        n=n,
        max_tokens=max(max_tokens, 1),
        output_kind=RequestOutputKind.DELTA if request.stream else RequestOutputKind.FINAL_ONLY,
    )


def early_stopping(value: struct_pb2.Value) -> EarlyStopping:
    kind = value.WhichOneof("kind")
    if kind == "bool_value":
        return value.bool_value
    if kind == "string_value":
        return value.string_value  # validated: "never"
    return False


def beam_search_settings(request: CreateCompletionRequest) -> BeamSearchSettings:
    return BeamSearchSettings(
        width=requested_candidates(request),
        returned=requested_n(request),
        max_tokens=max(requested_max_tokens(request), 1),
        length_penalty=request.length_penalty if request.HasField("length_penalty") else 1.0,
        early_stopping=early_stopping(request.early_stopping),
        ignore_eos=request.ignore_eos,
        skip_special_tokens=(
            request.skip_special_tokens if request.HasField("skip_special_tokens") else True
        ),
        logprobs=requested_logprobs(request) or 0,
        prompt_logprobs=prompt_logprobs(request),
        priority=request.priority,
    )
