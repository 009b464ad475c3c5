"""vLLM's CPU worker, its gloo threads woken about ten times a second instead of a hundred.

The worker sets up its distributed environment even for one rank: 13 gloo process groups
(world, tensor, pipeline, data, expert, ... each a device group and a CPU group). Each group's
TCP device runs a loop thread that waits for socket events at most 10 ms at a time, only to
check whether it should stop, so an idle engine core spent 2.5-3.5 % of a core waking them.

Threads inherit their creator's timer slack (prctl PR_SET_TIMERSLACK): the worker sets its
device up with GLOO_LOOP_SLACK_NS of it, which lets the kernel hold those loops' timeouts until
about 100 ms, and gets the default back after. A socket event still wakes a loop at once; a
timeout only ends a device's loop later when it is destroyed. The other threads made then
(gloo's work threads, OpenMP's) wait without a timeout, which slack does not touch.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
from collections.abc import Iterator

from vllm.v1.worker.cpu_worker import CPUWorker

logger = logging.getLogger(__name__)

PR_SET_TIMERSLACK = 29  # linux/prctl.h; 0 sets the thread's default back
GLOO_LOOP_SLACK_NS = 90_000_000  # a 10 ms timeout then ends within about 100 ms
VLLM_CPU_WORKER = f"{CPUWorker.__module__}.{CPUWorker.__qualname__}"


def set_timer_slack(nanoseconds: int) -> bool:
    libc = ctypes.CDLL(None, use_errno=True)
    return libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(nanoseconds), 0, 0, 0) == 0


@contextlib.contextmanager
def timer_slack(nanoseconds: int) -> Iterator[None]:
    """The calling thread has `nanoseconds` of timer slack meanwhile (so do the threads it
    starts, for good); its default after."""
    if not set_timer_slack(nanoseconds):
        logger.debug("timer slack not set: errno %d", ctypes.get_errno())
        yield
        return
    try:
        yield
    finally:
        set_timer_slack(0)


class QuietGlooCPUWorker(CPUWorker):
    """vLLM's CPU worker, its gloo loop threads started with GLOO_LOOP_SLACK_NS of slack."""

    def init_device(self) -> None:
        with timer_slack(GLOO_LOOP_SLACK_NS):
            super().init_device()


QUIET_GLOO_CPU_WORKER = f"{__name__}.{QuietGlooCPUWorker.__qualname__}"
