"""The timer slack vLLM's CPU worker sets its device up with: inherited by the threads started
meanwhile (gloo's loops), the worker's own thread back at its default after."""

from __future__ import annotations

import threading
from pathlib import Path

from vllm.utils.import_utils import resolve_obj_by_qualname

from service.model.gloo_timer_slack import (
    GLOO_LOOP_SLACK_NS,
    QUIET_GLOO_CPU_WORKER,
    QuietGlooCPUWorker,
    timer_slack,
)


def own_slack() -> int:
    return int(Path(f"/proc/{threading.get_native_id()}/timerslack_ns").read_text())


def slack_of_a_thread_started_now() -> int:
    seen: list[int] = []
    thread = threading.Thread(target=lambda: seen.append(own_slack()))
    thread.start()
    thread.join()
    return seen[0]


def test_threads_started_meanwhile_keep_the_slack_and_the_caller_gets_its_default_back() -> None:
    default = own_slack()
    assert default < GLOO_LOOP_SLACK_NS
    with timer_slack(GLOO_LOOP_SLACK_NS):
        assert own_slack() == GLOO_LOOP_SLACK_NS
        assert slack_of_a_thread_started_now() == GLOO_LOOP_SLACK_NS
    assert own_slack() == default
    assert slack_of_a_thread_started_now() == default


def test_vllm_resolves_the_worker_by_its_name() -> None:
    assert resolve_obj_by_qualname(QUIET_GLOO_CPU_WORKER) is QuietGlooCPUWorker
