"""Keeps the replica picker running beside Envoy: starts it, starts it again when it exits
(Envoy balances by hashing meanwhile: the picker fails open), and stops it when Envoy, this
process's parent, exits.

Usage: python -m facade.picker.supervisor ARGS (facade.picker.server's arguments)
"""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import threading
import time
from types import FrameType

from plumbing.lifetime import signal_on_parent_death

# A picker that ran this long before exiting is restarted at once; one that exits sooner
# waits, twice as long each time up to the maximum, so a picker that cannot start does not
# spin.
STEADY_SECONDS = 10.0
FIRST_DELAY_SECONDS = 1.0
MAX_DELAY_SECONDS = 30.0
logger = logging.getLogger("facade.picker")


def next_delay(delay: float, ran_seconds: float) -> float:
    """The wait before the next restart, after a picker that ran `ran_seconds`."""
    if ran_seconds >= STEADY_SECONDS:
        return 0.0
    return min(max(delay * 2, FIRST_DELAY_SECONDS), MAX_DELAY_SECONDS)


def start(args: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "facade.picker.server", *args],
        preexec_fn=lambda: signal_on_parent_death(signal.SIGTERM),
    )


def supervise(args: list[str]) -> None:
    stopping = threading.Event()
    picker = start(args)

    def stop(signum: int, frame: FrameType | None) -> None:
        stopping.set()
        picker.terminate()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    delay = 0.0
    while True:
        started = time.monotonic()
        code = picker.wait()
        if stopping.is_set():
            return
        delay = next_delay(delay, time.monotonic() - started)
        logger.warning(
            "the picker exited (code %s); Envoy balances by consistent hashing until it is "
            "back; restarting it in %.0f s",
            code,
            delay,
        )
        if stopping.wait(delay):
            return
        picker = start(args)
        if stopping.is_set():  # stopped while it was starting
            picker.terminate()


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="envoy picker: %(message)s")
    supervise(sys.argv[1:])


if __name__ == "__main__":
    main()
