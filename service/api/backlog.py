"""The replica's backlog bounds, checked before a call's work starts: nothing waits in this
frontend, every call within the bounds goes to the engine, whose scheduler decides what runs.

A call counts the engine sequences it will run (prompts x best_of or n, or x the beam width).
It is refused at once (RESOURCE_EXHAUSTED / 429 with a retry hint) when:
- its sequences, with those waiting or running in the engine and those of calls still being
  validated and tokenized here, would pass `max_num_queued_reqs`;
- the prompt tokens of requests not yet past prefill have reached `max_num_queued_tokens`.
These are vLLM's own bounds, checked by the engine once more as the call's requests are added.

With several frontend processes over one engine, the bounds hold for the whole replica: the
sequences come from vLLM's admission counters (each frontend's unfinished requests, in shared
memory), and each frontend publishes its queued prompt tokens and calls in preparation in a
ReplicaTally that every check sums. The sequences are exact at each change (vLLM updates its
counters as requests come and go); another frontend's queued tokens are as fresh as its last
check or its last tick (service.transport.observability.GAUGE_SECONDS), so calls it added
since are missing for that long. Two frontends admitting in the same instant can each pass a
bound the other then fills, by at most one call each, as in vLLM's own multi-server mode.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, MutableSequence

from vllm.exceptions import MaxQueuedTokensError, QueueOverflowError
from vllm.v1.engine.async_llm import AsyncLLM

from service.api.errors import OverloadedError
from service.model.capacity import Capacity

EngineRefusal = QueueOverflowError | MaxQueuedTokensError


class ReplicaTally:
    """Every frontend's queued prompt tokens, sequences in preparation and interactive calls
    in flight (those batch jobs yield to), in shared memory (a multiprocessing RawArray of
    three counters per frontend): each writes its own slot."""

    FIELDS = 3

    def __init__(self, counters: MutableSequence[int], count: int, index: int) -> None:
        self.counters = counters
        self.count = count
        self.slot = index * self.FIELDS

    def publish(self, queued_tokens: int, preparing_sequences: int) -> None:
        self.counters[self.slot] = queued_tokens
        self.counters[self.slot + 1] = preparing_sequences

    def publish_interactive_calls(self, running: int) -> None:
        self.counters[self.slot + 2] = running

    def interactive_calls(self) -> int:
        """Interactive calls in flight over every frontend."""
        return sum(
            self.counters[slot + 2] for slot in range(0, self.count * self.FIELDS, self.FIELDS)
        )

    def totals(self) -> tuple[int, int]:
        """Queued prompt tokens and sequences in preparation, over every frontend."""
        slots = range(0, self.count * self.FIELDS, self.FIELDS)
        return (
            sum(self.counters[slot] for slot in slots),
            sum(self.counters[slot + 1] for slot in slots),
        )


class Backlog:
    def __init__(
        self, engine: AsyncLLM, capacity: Capacity, tally: ReplicaTally | None = None
    ) -> None:
        self.engine = engine
        self.capacity = capacity
        self.tally = tally
        self.preparing_calls = 0
        self.preparing_sequences = 0

    def publish(self) -> None:
        """This frontend's figures, for the other frontends' checks."""
        if self.tally is not None:
            self.tally.publish(self.engine.get_num_queued_tokens(), self.preparing_sequences)

    def held(self) -> tuple[int, int]:
        """Sequences waiting, running or in preparation, and queued prompt tokens: the
        replica's, over every frontend."""
        if self.tally is None:
            unfinished = self.engine.get_num_unfinished_requests()
            return unfinished + self.preparing_sequences, self.engine.get_num_queued_tokens()
        self.publish()
        queued_tokens, preparing = self.tally.totals()
        shared = self.engine.admission_stats
        unfinished = (
            self.engine.get_num_unfinished_requests()
            if shared is None
            else shared.get_num_requests()
        )
        return unfinished + preparing, queued_tokens

    @contextlib.contextmanager
    def preparing(self, sequences: int) -> Iterator[None]:
        """Around a call's tokenization: refused at once past the bounds, counted meanwhile
        (a flood of calls cannot pile up in front of the tokenizer)."""
        self.check(sequences)
        self.preparing_calls += 1
        self.preparing_sequences += sequences
        self.publish()
        try:
            yield
        finally:
            self.preparing_calls -= 1
            self.preparing_sequences -= sequences
            self.publish()

    def check(self, sequences: int) -> None:
        held, queued_tokens = self.held()
        if held + sequences > self.capacity.max_num_queued_reqs:
            raise OverloadedError(
                f"The server is at capacity: {held} sequences are waiting or running and "
                f"this request needs {sequences}, over the bound of "
                f"{self.capacity.max_num_queued_reqs}; "
                f"retry after {OverloadedError.retry_after_seconds}s."
            )
        if queued_tokens >= self.capacity.max_num_queued_tokens:
            raise self.refusal(MaxQueuedTokensError())

    def admit(self, sequences: int) -> None:
        """Just before the call's engine requests are added: the engine's own check, since
        the backlog may have grown while the call was tokenized."""
        try:
            self.engine.check_admission(sequences)
        except (QueueOverflowError, MaxQueuedTokensError) as error:
            raise self.refusal(error) from error
        if self.tally is not None:
            self.check_replica_tokens()

    def check_replica_tokens(self) -> None:
        """vLLM's check counts this frontend's queued tokens only: the replica's count too."""
        if self.held()[1] >= self.capacity.max_num_queued_tokens:
            raise self.refusal(MaxQueuedTokensError())

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
