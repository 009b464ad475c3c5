"""The replica's backlog bounds, checked before a call's work starts: nothing waits in this
frontend, every call within the bounds goes to the engine, whose scheduler decides what runs.

A call counts the engine sequences it will run (prompts x best_of or n, or x the beam width).
It is refused at once (RESOURCE_EXHAUSTED / 429 with a retry hint) when:
- its sequences, with those waiting or running in the engine and those of calls still being
  validated and tokenized here, would pass `max_num_queued_reqs`;
- the prompt tokens of requests not yet past prefill have reached `max_num_queued_tokens`.
These are vLLM's own bounds, checked by the engine once more as the call's requests are added.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError
from vllm.v1.engine.async_llm import AsyncLLM

from service.api.errors import OverloadedError
from service.model.capacity import Capacity

EngineRefusal = QueueOverflowError | MaxQueuedTokensError


class Backlog:
    def __init__(self, engine: AsyncLLM, capacity: Capacity) -> None:
        self.engine = engine
        self.capacity = capacity
        self.preparing_calls = 0
        self.preparing_sequences = 0

    @contextlib.contextmanager
    def preparing(self, sequences: int) -> Iterator[None]:
        """Around a call's tokenization: refused at once past the bounds, counted meanwhile
        (a flood of calls cannot pile up in front of the tokenizer)."""
        self.check(sequences)
        self.preparing_calls += 1
        self.preparing_sequences += sequences
        try:
            yield
        finally:
            self.preparing_calls -= 1
            self.preparing_sequences -= sequences

    def check(self, sequences: int) -> None:
        held = self.engine.get_num_unfinished_requests() + self.preparing_sequences
        if held + sequences > self.capacity.max_num_queued_reqs:
            raise OverloadedError(
                f"The server is at capacity: {held} sequences are waiting or running and "
                f"this request needs {sequences}, over the bound of "
                f"{self.capacity.max_num_queued_reqs}; "
                f"retry after {OverloadedError.retry_after_seconds}s."
            )
        if self.engine.get_num_queued_tokens() >= self.capacity.max_num_queued_tokens:
            raise self.refusal(MaxQueuedTokensError())

    def admit(self, sequences: int) -> None:
        """Just before the call's engine requests are added: the engine's own check, since
        the backlog may have grown while the call was tokenized."""
        try:
            self.engine.check_admission(sequences)
        except (QueueOverflowError, MaxQueuedTokensError) as error:
            raise self.refusal(error) from error

    def refusal(self, error: EngineRefusal) -> OverloadedError:
        """The engine's refusal (from `admit`, or as a request was added) as the API's."""
        if isinstance(error, MaxQueuedTokensError):
            return OverloadedError(
                "The server is at capacity: the prompt tokens waiting to be prefilled reached "
                f"the bound of {self.capacity.max_num_queued_tokens}; "
                f"retry after {OverloadedError.retry_after_seconds}s."
            )
        return OverloadedError(
            "The server is at capacity: the sequences waiting or running reached the bound "
            f"of {self.capacity.max_num_queued_reqs}; "
            f"retry after {OverloadedError.retry_after_seconds}s."
        )
