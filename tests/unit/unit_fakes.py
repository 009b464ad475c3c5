"""Small stand-ins for the unit tests: a word-level tokenizer, request builders, hand-made
vLLM outputs and a served model whose engine takes nothing (the handlers run up to it). Nothing
here starts an engine or reads a model."""

from __future__ import annotations

import re
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from google.protobuf import json_format
from google.protobuf.message import Message
from llmcompletions.v2.completions_pb2 import CreateCompletionRequest
from vllm.logprobs import Logprob
from vllm.outputs import CompletionOutput, RequestOutput

from service.api.cancellation import CancellableCall
from service.api.chat import ChatHandler
from service.api.completions import CompletionHandler
from service.model.adapter_registry import AdapterRegistry
from service.model.adapters import ModelCatalog
from service.model.capacity import Capacity
from service.model.engine import ServedModel
from service.settings import EngineSettings
from service.transport.observability import RequestRecord

MODEL = "smollm2-135m-instruct"
VOCAB_SIZE = 100
MAX_MODEL_LEN = 2048
BOS, EOS = 0, 1
# Token id -> text. Ids 0 and 1 are special; the rest are words with their leading space.
WORDS = {
    BOS: "<s>",
    EOS: "</s>",
    2: "The",
    3: " capital",
    4: " of",
    5: " France",
    6: " is",
    7: " Paris",
    8: ".",
    9: " Lyon",
    10: " A",
    11: " B",
    12: " C",
    13: " D",
    14: "Hi",
    15: "é",
}
PIECE = re.compile(r"\s?[^\s.]+|\.")


class FakeTokenizer:
    """A word-level tokenizer over WORDS with the parts of vLLM's TokenizerLike the service
    uses: encode, decode, bos/eos ids."""

    bos_token_id = BOS
    eos_token_id = EOS

    def __init__(self) -> None:
        self.ids = {text: token_id for token_id, text in WORDS.items()}
        self.decode_calls: list[list[int]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.ids[piece] for piece in PIECE.findall(text)]
        return [BOS, *ids] if add_special_tokens else ids

    def decode(self, token_ids: Iterable[int], skip_special_tokens: bool = False) -> str:
        ids = list(token_ids)
        self.decode_calls.append(ids)
        return "".join(
            WORDS.get(token_id, f"<{token_id}>")
            for token_id in ids
            if not (skip_special_tokens and token_id in (BOS, EOS))
        )


OMIT = object()  # make_request(model=OMIT) leaves the field out of the body


def make_request(**fields: Any) -> CreateCompletionRequest:
    """A request as the JSON body `fields` would give it; `model` and `prompt` are filled in
    unless given (or left out with OMIT)."""
    body: dict[str, Any] = {"model": MODEL, "prompt": "The capital of France is", **fields}
    present = {name: value for name, value in body.items() if value is not OMIT}
    return json_format.ParseDict(present, CreateCompletionRequest())


def logprob_step(*entries: tuple[int, float], decoded: bool = True) -> dict[int, Logprob]:
    """One position's log-probabilities in vLLM's order: the chosen token first, then by
    rank. With `decoded`, each carries its text as vLLM's detokenizer fills it in."""
    return {
        token_id: Logprob(
            logprob=value, rank=rank, decoded_token=WORDS.get(token_id) if decoded else None
        )
        for rank, (token_id, value) in enumerate(entries, start=1)
    }


def completion_output(
    token_ids: Sequence[int],
    index: int = 0,
    finish_reason: str | None = "length",
    logprobs: list[dict[int, Logprob]] | None = None,
    cumulative_logprob: float | None = None,
    text: str | None = None,
    stop_reason: int | str | None = None,
) -> CompletionOutput:
    return CompletionOutput(
        index=index,
        text="".join(WORDS[token_id] for token_id in token_ids) if text is None else text,
        token_ids=list(token_ids),
        cumulative_logprob=cumulative_logprob,
        logprobs=logprobs,
        finish_reason=finish_reason,
        stop_reason=stop_reason,
    )


def request_output(
    outputs: list[CompletionOutput],
    prompt_token_ids: Sequence[int] = (2, 3, 4, 5, 6),
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None,
    request_id: str = "req",
    num_cached_tokens: int = 0,
) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        prompt=None,
        prompt_token_ids=list(prompt_token_ids),
        prompt_logprobs=prompt_logprobs,
        outputs=outputs,
        finished=all(output.finish_reason is not None for output in outputs),
        num_cached_tokens=num_cached_tokens,
    )


class ReachedEngine(Exception):
    """The request was built and handed to the engine."""


class AnyTextTokenizer(FakeTokenizer):
    """The word-level tokenizer, taking any text (a word it does not know is a token of its
    own): generated prompts are not its vocabulary."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [self.ids.get(piece, 2 + len(piece) % (VOCAB_SIZE - 2)) for piece in text.split()]
        return [BOS, *ids] if add_special_tokens else ids


class StandInEngine:
    """An idle engine that takes nothing: a request that gets to it was built."""

    model_config = SimpleNamespace(renderer_num_workers=1, is_multimodal_model=False)

    def get_num_unfinished_requests(self) -> int:
        return 0

    def get_num_queued_tokens(self) -> int:
        return 0

    def check_admission(self, sequences: int) -> None:
        pass

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        raise ReachedEngine

    async def abort(self, request_ids: list[str]) -> None:
        pass


EMPTY_ADAPTER_ROOT = Path(tempfile.mkdtemp(prefix="unit-adapter-root-"))


def served_model(engine: StandInEngine | None = None) -> ServedModel:
    """A served model with what the handlers read of one, on a stand-in engine."""
    engine = engine or StandInEngine()
    return ServedModel(
        engine=engine,  # type: ignore[arg-type]
        name=MODEL,
        tokenizer=AnyTextTokenizer(),  # type: ignore[arg-type]
        max_model_len=MAX_MODEL_LEN,
        vocab_size=VOCAB_SIZE,
        system_fingerprint="fp",
        default_sampling={},
        structured_outputs_backend="xgrammar",
        adapters=AdapterRegistry(
            engine,  # type: ignore[arg-type]
            ModelCatalog(MODEL),
            # An empty adapter root: every model name a request brings is looked up there.
            EngineSettings(None, MODEL, adapter_root=EMPTY_ADAPTER_ROOT),
            Path("/"),
            Path("/"),
        ),
        scratch=None,  # type: ignore[arg-type]
        capacity=Capacity(256, 2048, 1024, 1_000_000),
        load=None,  # type: ignore[arg-type]
    )


async def run_until_engine(handler: CompletionHandler | ChatHandler, request: Message) -> None:
    """The handler's call of `request`, its replies read (with StandInEngine: ReachedEngine)."""
    record = RequestRecord("req", "m", MODEL, "", stream=False)
    async for _ in handler.complete(request, record, CancellableCall("req", "")):  # type: ignore[arg-type]
        pass
