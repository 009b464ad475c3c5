"""The `prompt` union: which of its four JSON forms arrived, and the token ids it stands for."""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf import struct_pb2
from vllm.tokenizers import TokenizerLike

from service.api.errors import Loc


class PromptFormError(ValueError):
    """The prompt is missing, empty, of a form the reference does not list, or off-vocabulary."""

    def __init__(self, msg: str, type_: str = "value_error", loc: Loc = ()) -> None:
        super().__init__(msg)
        self.msg = msg
        self.type = type_
        self.loc = loc


@dataclass(frozen=True)
class PromptInput:
    """One prompt as the caller gave it: text, or token ids."""

    text: str | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(frozen=True)
class PreparedPrompt:
    """One prompt ready for the engine: its token ids and the text echoed back for it."""

    token_ids: list[int]
    text: str


FORMS = "a string, a list of strings, a list of token ids or a list of token-id lists"


def parse_prompt(value: struct_pb2.Value | None, vocab_size: int) -> list[PromptInput]:
    kind = value.WhichOneof("kind") if value is not None else None
    if kind in (None, "null_value"):
        raise PromptFormError("prompt is required", "missing")
    if kind == "string_value":
        return [parse_text(value, ())]
    if kind != "list_value":
        raise PromptFormError(f"prompt must be {FORMS}", "type_error")
    items = value.list_value.values
    if not items:
        raise PromptFormError("prompt must not be an empty list", "too_short")
    first_kind = items[0].WhichOneof("kind")
    if first_kind == "string_value":
        return [parse_text(item, (index,)) for index, item in enumerate(items)]
    if first_kind == "number_value":
        return [PromptInput(token_ids=parse_token_ids(value.list_value, vocab_size, ()))]
    if first_kind == "list_value":
        return [
            PromptInput(token_ids=parse_token_ids(item.list_value, vocab_size, (index,)))
            if item.WhichOneof("kind") == "list_value"
            else mixed_forms((index,))
            for index, item in enumerate(items)
        ]
    raise PromptFormError(f"prompt must be {FORMS}", "type_error", (0,))


def mixed_forms(loc: Loc) -> PromptInput:
    raise PromptFormError(f"prompt items must all have one form: {FORMS}", "type_error", loc)


def parse_text(item: struct_pb2.Value, loc: Loc) -> PromptInput:
    if item.WhichOneof("kind") != "string_value":
        mixed_forms(loc)
    if not item.string_value:
        raise PromptFormError("prompt strings must not be empty", "string_too_short", loc)
    return PromptInput(text=item.string_value)


def parse_token_ids(items: struct_pb2.ListValue, vocab_size: int, loc: Loc) -> tuple[int, ...]:
    if not items.values:
        raise PromptFormError("token-id lists must not be empty", "too_short", loc)
    token_ids = []
    for index, item in enumerate(items.values):
        if item.WhichOneof("kind") != "number_value" or not item.number_value.is_integer():
            raise PromptFormError("token ids must be integers", "int_type", (*loc, index))
        token_id = int(item.number_value)
        if not 0 <= token_id < vocab_size:
            raise PromptFormError(
                f"token id must be in [0, {vocab_size - 1}] (the model's vocabulary), "
                f"got {token_id}",
                "value_error",
                (*loc, index),
            )
        token_ids.append(token_id)
    return tuple(token_ids)


def prepare_prompts(
    prompts: list[PromptInput], tokenizer: TokenizerLike, add_special_tokens: bool
) -> list[PreparedPrompt]:
    """Tokenize text prompts and decode token prompts, so each has both forms."""
    prepared = []
    for prompt in prompts:
        if prompt.text is not None:
            token_ids = tokenizer.encode(prompt.text, add_special_tokens=add_special_tokens)
            prepared.append(PreparedPrompt(token_ids=list(token_ids), text=prompt.text))
        else:
            token_ids = list(prompt.token_ids or ())
            prepared.append(PreparedPrompt(token_ids=token_ids, text=tokenizer.decode(token_ids)))
    return prepared


def truncated(
    prompts: list[PreparedPrompt], keep: int, side: str, tokenizer: TokenizerLike
) -> list[PreparedPrompt]:
    """Each prompt cut to `keep` tokens: its last ones (`left`) or its first (`right`), its
    text then decoded from what was kept."""
    cut = []
    for prompt in prompts:
        if len(prompt.token_ids) <= keep:
            cut.append(prompt)
            continue
        token_ids = prompt.token_ids[-keep:] if side == "left" else prompt.token_ids[:keep]
        cut.append(PreparedPrompt(token_ids=token_ids, text=tokenizer.decode(token_ids)))
    return cut
