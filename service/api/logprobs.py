"""Log-probabilities of returned tokens in the completion API's shape."""

from __future__ import annotations

from collections.abc import Sequence

from google.protobuf import struct_pb2
from llmcompletions.v2.completions_pb2 import Logprobs
from vllm.logprobs import Logprob
from vllm.tokenizers import TokenizerLike

# JSON has no -inf; OpenAI and vLLM clamp impossible tokens to this.
LOGPROB_FLOOR = -9999.0

StepLogprobs = dict[int, Logprob] | None


def decoded(
    token_id: int, logprob: Logprob | None, tokenizer: TokenizerLike, as_token_id: bool = False
) -> str:
    """The token's text, or with `as_token_id` its "token_id:N" stand-in (vLLM's
    return_tokens_as_token_ids: a token that is not valid UTF-8 alone stays apart)."""
    if as_token_id:
        return f"token_id:{token_id}"
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return tokenizer.decode([token_id])


def clamp(logprob: float) -> float:
    return max(logprob, LOGPROB_FLOOR)


def token_logprobs(
    token_ids: Sequence[int],
    steps: Sequence[StepLogprobs],
    top_k: int,
    tokenizer: TokenizerLike,
    first_offset: int,
    as_token_ids: bool = False,
) -> Logprobs:
    """One entry per token: its text, log-probability, the top `top_k` alternatives (the
    chosen token always among them, so up to k+1) and its offset in the returned text.
    A step without log-probabilities (the first prompt token) reports nulls."""
    result = Logprobs()
    offset = first_offset
    for token_id, step in zip(token_ids, steps, strict=True):
        chosen = step.get(token_id) if step is not None else None
        token = decoded(token_id, chosen, tokenizer, as_token_ids)
        result.tokens.append(token)
        result.text_offset.append(offset)
        offset += len(token)
        if step is None or chosen is None:
            result.token_logprobs.add().null_value = 0
            result.top_logprobs.add().null_value = 0
            continue
        result.token_logprobs.add().number_value = clamp(chosen.logprob)
        top = result.top_logprobs.add().struct_value
        # vLLM lists the chosen token first, then the top k by rank.
        for rank, (alternative_id, alternative) in enumerate(step.items()):
            if rank > top_k:
                break
            text = decoded(alternative_id, alternative, tokenizer, as_token_ids)
            top.fields[text].number_value = clamp(alternative.logprob)
    return result


def prompt_logprobs(
    steps: Sequence[StepLogprobs], tokenizer: TokenizerLike
) -> struct_pb2.ListValue:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then for each token an
    object from token id (the token's own and the top alternatives) to its log-probability,
    rank and decoded text."""
    result = struct_pb2.ListValue()
    for step in steps:
        if step is None:
            result.values.add().null_value = 0
            continue
        entries = result.values.add().struct_value
        for token_id, logprob in step.items():
            entry = entries.fields[str(token_id)].struct_value
            entry.fields["logprob"].number_value = clamp(logprob.logprob)
            if logprob.rank is None:
                entry.fields["rank"].null_value = 0
            else:
                entry.fields["rank"].number_value = logprob.rank
            entry.fields["decoded_token"].string_value = decoded(token_id, logprob, tokenizer)
    return result


def next_offset(logprobs: Logprobs, current: int) -> int:
    """The text offset after the tokens of `logprobs` (for the next stream chunk)."""
    if not logprobs.tokens:
        return current
    return logprobs.text_offset[-1] + len(logprobs.tokens[-1])
