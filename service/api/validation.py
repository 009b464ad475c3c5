"""Checks a completion request against every limit of the API (docs/calling/fields.md),
collecting all violations."""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from google.protobuf import struct_pb2
from llmcompletions.v2.completions_pb2 import (
    CreateChatCompletionRequest,
    CreateCompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

from service.api.declared_ranges import (
    DECLARED_RANGES,
    MAX_BEST_OF,
    Bound,
    Range,
)
from service.api.errors import FieldViolation, Loc, RequestValidationError, quote
from service.api.prompts import PreparedPrompt, PromptFormError, PromptInput, parse_prompt
from service.api.sampling import requested_max_tokens
from service.settings import RequestLimits

MAX_STOP_STRINGS = 4
TRUNCATION_SIDES = ("left", "right")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
SCHEMA_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
EARLY_STOPPING_WORD = "never"
DEFAULT_LIMITS = RequestLimits()


# The sampling, constraint and token-id fields that both kinds of request carry, under the
# same names and rules.
GenerationRequest = CreateCompletionRequest | CreateChatCompletionRequest


# Checked with the rules that also involve another field (best_of >= n) or map entries.
NUMERIC_RANGES = {
    name: bounds
    for name, bounds in DECLARED_RANGES.items()
    if name not in ("best_of", "logit_bias")
}
LOGIT_BIAS_RANGE = DECLARED_RANGES["logit_bias"]


class Violations:
    """Collects field violations so that all of them are reported together."""

    def __init__(self) -> None:
        self.items: list[FieldViolation] = []

    def add(self, loc: Loc, msg: str, type_: str = "value_error") -> None:
        self.items.append(FieldViolation(loc=loc, msg=msg, type=type_))


def validate_request(
    request: CreateCompletionRequest,
    vocab_size: int,
    structured_outputs_backend: str,
    limits: RequestLimits = DEFAULT_LIMITS,
) -> list[PromptInput]:
    """Return the request's prompts, or raise RequestValidationError listing every violation."""
    found = Violations()
    if not request.model:
        found.add(("model",), "model is required", "missing")
    prompts = check_prompt(request, vocab_size, found)
    check_numeric_ranges(request, found)
    check_counts(request, found)
    check_stop(request.stop if request.HasField("stop") else None, found)
    check_token_ids(request, vocab_size, found)
    check_early_stopping(request, found)
    check_output_constraints(request, found)
    check_backend(request, structured_outputs_backend, found)
    check_sizes(request, len(prompts), limits, found)
    check_streaming(request, found)
    check_extras(request, found)
    if request.HasField("suffix") and request.suffix:
        found.add(("suffix",), "suffix is not supported: this server does not insert text")
    if found.items:
        raise RequestValidationError(found.items)
    return prompts


def check_prompt(
    request: CreateCompletionRequest | TokenizeRequest, vocab_size: int, found: Violations
) -> list[PromptInput]:
    try:
        return parse_prompt(request.prompt if request.HasField("prompt") else None, vocab_size)
    except PromptFormError as error:
        found.add(("prompt", *error.loc), error.msg, error.type)
        return []


def describe_range(low: Bound | None, high: Bound | None) -> str:
    if low and high:
        left = "[" if low.inclusive else "("
        right = "]" if high.inclusive else ")"
        return f"in {left}{low.value:g}, {high.value:g}{right}"
    if low:
        return f"{'>=' if low.inclusive else '>'} {low.value:g}"
    if high:
        return f"{'<=' if high.inclusive else '<'} {high.value:g}"
    return "a finite number"


def range_violation(value: float, low: Bound | None, high: Bound | None) -> str | None:
    """The pydantic-style type of the broken bound, or None when value is within range."""
    if not math.isfinite(value):
        return "finite_number"
    if low and (value < low.value or (value == low.value and not low.inclusive)):
        return "greater_than_equal" if low.inclusive else "greater_than"
    if high and (value > high.value or (value == high.value and not high.inclusive)):
        return "less_than_equal" if high.inclusive else "less_than"
    return None


def check_numeric_ranges(
    request: GenerationRequest, found: Violations, ranges: dict[str, Range] = NUMERIC_RANGES
) -> None:
    for name, (low, high) in ranges.items():
        if not request.HasField(name):
            continue
        value = getattr(request, name)
        broken = range_violation(value, low, high)
        if broken:
            found.add((name,), f"{name} must be {describe_range(low, high)}, got {value:g}", broken)


def check_counts(request: CreateCompletionRequest, found: Violations) -> None:
    max_tokens = requested_max_tokens(request)
    if request.HasField("min_tokens") and 0 <= max_tokens < request.min_tokens:
        found.add(
            ("min_tokens",),
            f"min_tokens must be <= max_tokens ({max_tokens}), got {request.min_tokens}",
            "less_than_equal",
        )
    if request.HasField("best_of"):
        n = request.n if request.HasField("n") else 1
        if not n <= request.best_of <= MAX_BEST_OF:
            found.add(
                ("best_of",),
                f"best_of must be in [n, {MAX_BEST_OF}] (n is {n}), got {request.best_of}",
                "value_error",
            )


def check_stop(stop: struct_pb2.Value | None, found: Violations) -> None:
    if stop is None:
        return
    kind = stop.WhichOneof("kind")
    if kind in (None, "null_value"):
        return
    if kind == "string_value":
        if not stop.string_value:
            found.add(("stop",), "stop must be a non-empty string", "string_too_short")
        return
    if kind != "list_value":
        found.add(("stop",), "stop must be a string or a list of strings", "type_error")
        return
    items = stop.list_value.values
    if not 1 <= len(items) <= MAX_STOP_STRINGS:
        found.add(
            ("stop",),
            f"stop must hold 1 to {MAX_STOP_STRINGS} strings, got {len(items)}",
            "too_long" if items else "too_short",
        )
    for index, item in enumerate(items):
        if item.WhichOneof("kind") != "string_value" or not item.string_value:
            found.add(("stop", index), "each stop must be a non-empty string", "string_type")


def token_id_problem(token_id: int, vocab_size: int) -> str | None:
    if 0 <= token_id < vocab_size:
        return None
    return f"token id must be in [0, {vocab_size - 1}] (the model's vocabulary), got {token_id}"


def check_token_ids(request: GenerationRequest, vocab_size: int, found: Violations) -> None:
    for index, token_id in enumerate(request.stop_token_ids):
        problem = token_id_problem(token_id, vocab_size)
        if problem:
            found.add(("stop_token_ids", index), f"stop_token_ids: {problem}")
    for token_id, bias in request.logit_bias.items():
        problem = token_id_problem(token_id, vocab_size)
        if problem:
            found.add(("logit_bias", str(token_id)), f"logit_bias key: {problem}")
        broken = range_violation(bias, *LOGIT_BIAS_RANGE)
        if broken:
            found.add(
                ("logit_bias", str(token_id)),
                f"logit_bias values must be {describe_range(*LOGIT_BIAS_RANGE)}, got {bias:g}",
                broken,
            )
    for index, token_id in enumerate(request.allowed_token_ids):
        problem = token_id_problem(token_id, vocab_size)
        if problem:
            found.add(("allowed_token_ids", index), f"allowed_token_ids: {problem}")


def check_extras(request: CreateCompletionRequest, found: Violations) -> None:
    """vLLM's completion extras beyond the numeric ranges the proto declares."""
    if request.HasField("truncate_prompt_tokens") and request.truncate_prompt_tokens == 0:
        found.add(
            ("truncate_prompt_tokens",),
            "truncate_prompt_tokens must be at least 1, or -1 for the model's context length, "
            "got 0",
        )
    if request.HasField("truncation_side") and request.truncation_side not in TRUNCATION_SIDES:
        found.add(
            ("truncation_side",),
            f"truncation_side must be left or right, got {quote(request.truncation_side)}",
            "literal_error",
        )
    if request.HasField("prompt_logprobs"):
        if request.stream:
            found.add(("prompt_logprobs",), "prompt_logprobs cannot be streamed")
        if request.use_beam_search:
            found.add(("prompt_logprobs",), "prompt_logprobs are not available with beam search")


def check_early_stopping(request: CreateCompletionRequest, found: Violations) -> None:
    if not request.HasField("early_stopping"):
        return
    value = request.early_stopping
    kind = value.WhichOneof("kind")
    if kind in ("null_value", "bool_value", None):
        return
    if kind == "string_value" and value.string_value == EARLY_STOPPING_WORD:
        return
    found.add(("early_stopping",), 'early_stopping must be true, false or "never"', "literal_error")


def check_output_constraints(request: GenerationRequest, found: Violations) -> None:
    given = [
        name
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
        if request.HasField(name)
    ]
    if request.HasField("response_format"):
        check_response_format(request, found)
        if request.response_format.type in ("json_object", "json_schema"):
            given.append(f"response_format {request.response_format.type}")
    if len(given) > 1:
        found.add(
            (given[1].split()[0],),
            f"at most one output constraint may be given, got {', '.join(given)}",
        )
    if request.HasField("guided_choice"):
        choices = request.guided_choice.values
        if not choices:
            found.add(
                ("guided_choice",), "guided_choice must hold at least one string", "too_short"
            )
        for index, choice in enumerate(choices):
            if choice.WhichOneof("kind") != "string_value":
                found.add(
                    ("guided_choice", index), "each guided_choice must be a string", "string_type"
                )


def check_backend(request: GenerationRequest, available: str, found: Violations) -> None:
    if request.HasField("guided_regex"):
        try:
            re.compile(request.guided_regex)
        except (re.error, RecursionError, OverflowError) as error:
            found.add(("guided_regex",), f"guided_regex does not compile: {error}", "value_error")
    if not request.HasField("guided_decoding_backend"):
        return
    if request.guided_decoding_backend not in (available, ""):
        found.add(
            ("guided_decoding_backend",),
            f"guided_decoding_backend {quote(request.guided_decoding_backend)} is not available; "
            f"this server runs: {available}",
            "literal_error",
        )


def constraint_sizes(request: GenerationRequest) -> dict[str, int]:
    """The size in bytes of each output constraint (and of the stop strings) it carries."""
    sizes = {
        "stop": request.stop.ByteSize() if request.HasField("stop") else 0,
        "guided_json": request.guided_json.ByteSize() if request.HasField("guided_json") else 0,
        "guided_regex": len(request.guided_regex.encode()),
        "guided_grammar": len(request.guided_grammar.encode()),
        "guided_whitespace_pattern": len(request.guided_whitespace_pattern.encode()),
        "guided_choice": request.guided_choice.ByteSize(),
        "response_format": request.response_format.json_schema.schema.ByteSize(),
    }
    return {name: size for name, size in sizes.items() if size}


def check_prompt_count(prompt_count: int, limits: RequestLimits, found: Violations) -> None:
    if prompt_count > limits.max_prompts:
        found.add(
            ("prompt",),
            f"at most {limits.max_prompts} prompts per request, got {prompt_count}",
            "too_long",
        )


def check_sizes(
    request: CreateCompletionRequest, prompt_count: int, limits: RequestLimits, found: Violations
) -> None:
    check_prompt_count(prompt_count, limits, found)
    candidates = request.best_of if request.HasField("best_of") else max(request.n, 1)
    if prompt_count * candidates > limits.max_choices:
        found.add(
            ("n",),
            f"prompts x {'best_of' if request.HasField('best_of') else 'n'} is "
            f"{prompt_count * candidates}; at most {limits.max_choices} per request",
            "too_long",
        )
    check_constraint_sizes(constraint_sizes(request), limits, found)
    check_logit_bias_count(request, limits, found)


def check_constraint_sizes(sizes: dict[str, int], limits: RequestLimits, found: Violations) -> None:
    for name, size in sizes.items():
        if size > limits.max_constraint_bytes:
            found.add(
                (name,),
                f"{name} is {size} bytes; at most {limits.max_constraint_bytes}",
                "too_long",
            )


def check_logit_bias_count(
    request: GenerationRequest, limits: RequestLimits, found: Violations
) -> None:
    if len(request.logit_bias) > limits.max_logit_bias:
        found.add(
            ("logit_bias",),
            f"at most {limits.max_logit_bias} logit_bias entries, got {len(request.logit_bias)}",
            "too_long",
        )


def check_response_format(request: GenerationRequest, found: Violations) -> None:
    response_format = request.response_format
    if response_format.type not in RESPONSE_FORMAT_TYPES:
        found.add(
            ("response_format", "type"),
            f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, "
            f"got {quote(response_format.type)}",
            "literal_error",
        )
    if response_format.type != "json_schema":
        return
    if not response_format.HasField("json_schema"):
        found.add(("response_format", "json_schema"), "json_schema is required", "missing")
        return
    json_schema = response_format.json_schema
    if not SCHEMA_NAME.match(json_schema.name):
        found.add(
            ("response_format", "json_schema", "name"),
            "json_schema.name must match ^[A-Za-z0-9_-]{1,64}$",
            "string_pattern_mismatch",
        )
    if not json_schema.HasField("schema"):
        found.add(
            ("response_format", "json_schema", "schema"),
            "json_schema.schema must be a JSON object",
            "missing",
        )


def check_streaming(request: CreateCompletionRequest, found: Violations) -> None:
    if request.stream:
        n = request.n if request.HasField("n") else 1
        if request.HasField("best_of") and request.best_of > n:
            found.add(("stream",), "results cannot be streamed when best_of > n")
        if request.use_beam_search:
            found.add(("stream",), "results cannot be streamed with use_beam_search")
    elif request.HasField("stream_options"):
        found.add(("stream_options",), "stream_options is only allowed with stream=true")


def check_prompt_tokens(prompts: Sequence[PreparedPrompt], limit: int) -> None:
    total = sum(len(prompt.token_ids) for prompt in prompts)
    if total > limit:
        raise RequestValidationError(
            [
                FieldViolation(
                    ("prompt",),
                    f"the prompts hold {total} tokens; at most {limit} are allowed per request",
                    "too_long",
                )
            ]
        )


def validate_tokenize_request(
    request: TokenizeRequest, vocab_size: int, limits: RequestLimits = DEFAULT_LIMITS
) -> list[PromptInput]:
    """The prompts to tokenize, under the same rules as a completion's prompts."""
    found = Violations()
    if not request.model:
        found.add(("model",), "model is required", "missing")
    prompts = check_prompt(request, vocab_size, found)
    check_prompt_count(len(prompts), limits, found)
    if found.items:
        raise RequestValidationError(found.items)
    return prompts


def validate_detokenize_request(
    request: DetokenizeRequest, vocab_size: int, limits: RequestLimits = DEFAULT_LIMITS
) -> None:
    found = Violations()
    if not request.model:
        found.add(("model",), "model is required", "missing")
    if len(request.tokens) > limits.max_prompt_tokens:
        found.add(
            ("tokens",),
            f"at most {limits.max_prompt_tokens} tokens, got {len(request.tokens)}",
            "too_long",
        )
    for index, token_id in enumerate(request.tokens):
        problem = token_id_problem(token_id, vocab_size)
        if problem:
            found.add(("tokens", index), problem)
    if found.items:
        raise RequestValidationError(found.items)
