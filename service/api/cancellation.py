"""Cancel by request id: the completion and chat calls running or queued here, by their
x-request-id, and who started each (the API key's principal), so that CancelCompletion can stop
a caller's own calls, whichever connection it comes on.

A cancel marks the call cancelled and aborts its engine requests (every one whose id starts
with the call's prefix: its choices, greedy copies and beam-search steps); the call notices at
its next step (service.api.completions, service.api.chat) and ends with RequestCancelledError,
in-band first if it streamed anything.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from service.api.errors import (
    CancelForbiddenError,
    CancelTargetNotFoundError,
    FieldViolation,
    RequestCancelledError,
    RequestValidationError,
)
from service.model.engine import ServedModel, abort_matching


@dataclass(eq=False)
class CancellableCall:
    request_id: str
    principal: str  # "" without authentication: anyone may cancel
    engine_prefix: str | None = None  # set once the call knows its engine request ids
    cancelled: bool = False

    def check(self) -> None:
        """Raises RequestCancelledError once the call was cancelled."""
        if self.cancelled:
            raise RequestCancelledError(self.request_id)


class Cancellations:
    def __init__(self, model: ServedModel) -> None:
        self.model = model
        self.calls: dict[str, list[CancellableCall]] = {}

    @contextlib.contextmanager
    def track(self, request_id: str, principal: str) -> Iterator[CancellableCall]:
        """Holds the call, cancellable by its id, while it runs."""
        call = CancellableCall(request_id, principal)
        self.calls.setdefault(request_id, []).append(call)
        try:
            yield call
        finally:
            held = self.calls[request_id]
            held.remove(call)
            if not held:
                del self.calls[request_id]

    async def cancel(self, request_id: str, principal: str) -> int:
        """Cancels the caller's calls with this id; returns how many."""
        if not request_id:
            missing = FieldViolation(("request_id",), "request_id is required", "missing")
            raise RequestValidationError([missing])
        held = self.calls.get(request_id, [])
        if not held:
            raise CancelTargetNotFoundError(request_id)
        own = [call for call in held if call.principal == principal and not call.cancelled]
        if not own:
            if all(call.principal != principal for call in held):
                raise CancelForbiddenError(request_id)
            raise CancelTargetNotFoundError(request_id)  # already cancelled
        for call in own:
            call.cancelled = True
        prefixes = [call.engine_prefix for call in own if call.engine_prefix is not None]
        await abort_matching(self.model.engine, prefixes)
        return len(own)
