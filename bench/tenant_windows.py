"""What counting a call against a tenant's limits costs a frontend, by where the windows are
kept: in its own process (`memory://`, one frontend) or in its replica's parent
(`memory://` with several frontends). `python -m bench.tenant_windows`; a few seconds."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

from service.api.rate_limits import DEFAULT_STORE, TenantLimits
from service.api.shared_windows import ServedWindows, store_url
from service.api.tenants import Caller, Limits

CALLS = 2000
CALLER = Caller("bench", "k", None, Limits(rpm=10**9, tpm=10**12))  # never refused


async def admit_microseconds(store: str) -> float:
    failed: list[tuple[str, str]] = []
    limits = TenantLimits(store, counted=lambda *what: failed.append(what))
    await limits.admit(CALLER)  # connected, and the windows started
    started = time.perf_counter()
    for _ in range(CALLS):
        await limits.admit(CALLER)
    elapsed = time.perf_counter() - started
    if failed:
        raise SystemExit(f"the store {store} failed: {failed[0]}")
    return elapsed / CALLS * 1e6


def main() -> None:
    with tempfile.TemporaryDirectory() as scratch:
        path = str(Path(scratch, "windows.sock"))
        windows = ServedWindows(path)
        own = asyncio.run(admit_microseconds(DEFAULT_STORE))
        parents = asyncio.run(admit_microseconds(store_url(path)))
        windows.close()
    print(f"a call's check (rpm and tpm), mean of {CALLS}:")
    print(f"  windows in the frontend's process: {own:8.1f} µs")
    print(f"  windows in the replica's parent:   {parents:8.1f} µs ({parents / own:.0f}x)")


if __name__ == "__main__":
    main()
