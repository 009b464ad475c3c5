"""Tenants' limits per minute: completion and chat requests (rpm), and their tokens (tpm:
prompt and completion tokens, every choice's), in fixed windows of a minute that the `limits`
library keeps: in memory (exact on one replica: with several frontend processes, in its
parent's, service/api/shared_windows.py) or in a shared store (a Redis URL: one budget per
tenant across every replica).

A request is counted as it arrives and refused before any work once the tenant's requests or
tokens of the window are spent; its tokens are charged as the transport learns them (a
completion's or chat's prompt once tokenized, the rest when it ends, whatever ended it). A
store that fails lets requests pass (its errors counted), unless told to refuse them."""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc
from limits import RateLimitItem, RateLimitItemPerMinute
from limits.aio.storage import Storage
from limits.aio.strategies import FixedWindowRateLimiter
from limits.errors import ConfigurationError
from limits.storage import storage_from_string

from service.api.errors import CompletionError
from service.api.shared_windows import FrontendsStorage
from service.api.tenants import Caller

logger = logging.getLogger(__name__)
DEFAULT_STORE = "memory://"
# Defining it registers its scheme with `limits`: a frontend's store may be its parent's.
STORES = (FrontendsStorage,)


class RateLimitedError(CompletionError):
    """A tenant's limit is spent until its window frees."""

    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED

    def __init__(self, tenant: str, limit: str, amount: int, retry_after: int) -> None:
        what = "requests" if limit == "rpm" else "tokens"
        super().__init__(
            f"Rate limit reached for tenant {tenant!r}: {amount} {what} a minute ({limit}); "
            f"retry in {retry_after} s."
        )
        self.limit = limit
        self.retry_after = retry_after

    def metadata(self) -> tuple[tuple[str, str], ...]:
        return (("retry-after", str(self.retry_after)),)


class LimitsStoreError(CompletionError):
    """The shared store cannot be reached and the service refuses rather than guess."""

    grpc_code = grpc.StatusCode.UNAVAILABLE


@dataclass(frozen=True)
class Window:
    """One limit's state after a request was counted: for OpenAI's rate-limit headers."""

    name: str  # "requests" or "tokens"
    limit: int
    remaining: int
    reset_seconds: int

    def headers(self) -> tuple[tuple[str, str], ...]:
        return (
            (f"x-ratelimit-limit-{self.name}", str(self.limit)),
            (f"x-ratelimit-remaining-{self.name}", str(self.remaining)),
            (f"x-ratelimit-reset-{self.name}", f"{self.reset_seconds}s"),
        )


# A refusal by a limit, or a store error: counted by the transport ("rpm"/"tpm", and the
# store's error).
Counted = Callable[[str, str], None]


def store_options(store: str) -> dict[str, object]:
    """A Redis store through redis-py's asyncio client, giving up on a call after half a
    second (a store that hangs must not hold every tenant's calls)."""
    if not store.startswith("redis"):  # memory://, or its parent's for a frontend
        return {}
    return {"implementation": "redispy", "socket_connect_timeout": 0.5, "socket_timeout": 0.5}


def store_problem(store: str) -> str | None:
    """Why `store` cannot be used as a limits store (None: it can), checked at start."""
    try:
        storage_from_string(f"async+{store}", **store_options(store))
    except ConfigurationError as error:
        return str(error)
    return None


class TenantLimits:
    """Counts each tenant's requests and tokens against its limits."""

    def __init__(
        self, store: str = DEFAULT_STORE, fail_closed: bool = False, counted: Counted | None = None
    ) -> None:
        self.store_url = store
        self.storage: Storage = storage_from_string(f"async+{store}", **store_options(store))
        self.limiter = FixedWindowRateLimiter(self.storage)
        self.fail_closed = fail_closed
        self.counted = counted or (lambda kind, detail: None)
        self.charges: set[asyncio.Task[None]] = set()

    async def admit(self, caller: Caller) -> tuple[Window, ...]:
        """Counts a request; raises RateLimitedError if a limit is spent. The windows after it."""
        windows: list[Window] = []
        try:
            if caller.limits.rpm is not None:
                item = RateLimitItemPerMinute(caller.limits.rpm)
                if not await self.limiter.hit(item, caller.tenant, "requests"):
                    raise await self.refusal(caller, "rpm", item, "requests")
                windows.append(await self.window(item, caller, "requests"))
            if caller.limits.tpm is not None:
                item = RateLimitItemPerMinute(caller.limits.tpm)
                tokens = await self.window(item, caller, "tokens")
                if tokens.remaining <= 0:
                    raise await self.refusal(caller, "tpm", item, "tokens")
                windows.append(tokens)
        except RateLimitedError:
            raise
        except Exception as error:  # the store: its client's errors vary by backend
            self.store_failed(error)
            return ()
        return tuple(windows)

    async def refusal(
        self, caller: Caller, limit: str, item: RateLimitItem, name: str
    ) -> RateLimitedError:
        window = await self.window(item, caller, name)
        self.counted(limit, caller.tenant)
        return RateLimitedError(caller.tenant, limit, item.amount, max(1, window.reset_seconds))

    async def window(self, item: RateLimitItem, caller: Caller, name: str) -> Window:
        stats = await self.limiter.get_window_stats(item, caller.tenant, name)
        reset = math.ceil(stats.reset_time - time.time())
        if reset <= 0:  # no window yet: the next starts now
            reset = item.get_expiry()
        return Window(name, item.amount, max(0, stats.remaining), reset)

    def store_failed(self, error: Exception) -> None:
        self.counted("store", type(error).__name__)
        logger.warning(
            "the limits store %s failed (%s: %s); %s",
            self.store_url,
            type(error).__name__,
            error,
            "refusing the request" if self.fail_closed else "letting the request pass",
        )
        if self.fail_closed:
            raise LimitsStoreError("The rate-limit store is unavailable; retry shortly.") from error

    def charge(self, caller: Caller, tokens: int) -> None:
        """Charges a finished request's tokens, in the background (a call that ends by being
        cancelled must still be charged)."""
        if caller.limits.tpm is None or tokens <= 0:
            return
        task = asyncio.ensure_future(self.charge_now(caller, tokens))
        self.charges.add(task)
        task.add_done_callback(self.charges.discard)

    async def charge_now(self, caller: Caller, tokens: int) -> None:
        assert caller.limits.tpm is not None
        item = RateLimitItemPerMinute(caller.limits.tpm)
        try:
            # A fixed window's hit adds the cost even past the limit: what was used is charged.
            await self.limiter.hit(item, caller.tenant, "tokens", cost=tokens)
        except Exception as error:
            self.counted("store", type(error).__name__)
            logger.warning("charging %d tokens of %s failed: %s", tokens, caller.tenant, error)
