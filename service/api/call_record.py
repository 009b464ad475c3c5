"""What a request handler tells the transport about its call, for the call's log line and
metrics. The transport's record of each call (service.transport.observability.RequestRecord)
is one; the handlers depend only on this shape, not on the transport."""

from __future__ import annotations

from typing import Protocol


class CallRecord(Protocol):
    request_id: str
    started: float  # time.monotonic() when the call arrived
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int  # prompt tokens found in the engine's prefix cache
    images: int  # images in the prompt
    image_tokens: int  # the prompt tokens they take (counted in prompt_tokens too)

    def tokenized(self, prompt_tokens: int) -> None:
        """The prompt's tokens, as soon as they are known (a tenant's limits charge them)."""
