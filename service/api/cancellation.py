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
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

from service.api.errors import (
    AdapterUnloadedError,
    CancelForbiddenError,
    CancelTargetNotFoundError,
    CompletionError,
    FieldViolation,
    RequestCancelledError,
    RequestValidationError,
)
from service.model.adapter_registry import Lease
from service.model.engine import ServedModel, abort_matching


@dataclass(eq=False)
class CancellableCall:
    request_id: str
    principal: str  # "" without authentication: anyone may cancel
    engine_prefix: str | None = None  # set once the call knows its engine request ids
    cancelled: bool = False
    # What ended the call when it was not its caller's cancel (an adapter's unload).
    reason: CompletionError | None = None
    leases: list[Lease] = field(default_factory=list)  # the adapter versions it runs with
    abort: Callable[[list[str]], Awaitable[None]] | None = None  # aborts engine requests

    def check(self) -> None:
        """Raises RequestCancelledError (or what else ended it) once the call was ended."""
        if self.cancelled:
            raise self.reason or RequestCancelledError(self.request_id)

    def hold(self, lease: Lease) -> None:
        """Holds `lease` until the call ends."""
        self.leases.append(lease)

    async def end_with_reason(self, reason: str) -> None:
        """Ends the call with AdapterUnloadedError(reason), its engine requests aborted."""
        self.reason = AdapterUnloadedError(reason)
        self.cancelled = True
        if self.abort is not None and self.engine_prefix is not None:
            await self.abort([self.engine_prefix])


class Cancellations:
    def __init__(self, model: ServedModel) -> None:
        self.model = model
        self.calls: dict[str, list[CancellableCall]] = {}

    @contextlib.contextmanager
    def track(self, request_id: str, principal: str) -> Iterator[CancellableCall]:
        """Holds the call, cancellable by its id, while it runs."""
        call = CancellableCall(request_id, principal, abort=self.abort)
        self.calls.setdefault(request_id, []).append(call)
        try:
            yield call
        finally:
            for lease in call.leases:
                lease.release()
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
        await self.abort(prefixes)
        return len(own)

    async def abort(self, prefixes: list[str]) -> None:
        await abort_matching(self.model.engine, prefixes)
