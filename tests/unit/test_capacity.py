"""service/model/capacity.py and service/api/backlog.py: the backlog bounds follow the batch the
engine resolved for its device, and a call past them is refused at once with a retry hint,
counting the engine sequences it would run."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from vllm.v1.engine.async_llm import AsyncLLM

from service.api.backlog import Backlog
from service.api.errors import OverloadedError
from service.model.capacity import Capacity, resolve_capacity


def config(
    max_num_seqs: int,
    max_num_batched_tokens: int,
    max_model_len: int = 2048,
    data_parallel_size: int = 1,
    **bounds: int,
) -> Any:
    """The parts of a resolved VllmConfig that capacity reads."""
    scheduler = SimpleNamespace(
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max_num_batched_tokens,
        max_num_queued_reqs=bounds.get("max_num_queued_reqs"),
        max_num_queued_tokens=bounds.get("max_num_queued_tokens"),
    )
    return SimpleNamespace(
        scheduler_config=scheduler,
        parallel_config=SimpleNamespace(data_parallel_size=data_parallel_size),
        model_config=SimpleNamespace(max_model_len=max_model_len),
    )


# vLLM 0.32's API-server batch defaults by device (EngineArgs.get_batch_defaults).
DEVICES = {
    "cpu": (128, 2048, Capacity(128, 2048, 1024, 262_144)),
    "l4 (most GPUs)": (256, 2048, Capacity(256, 2048, 2048, 262_144)),
    "h200": (1024, 8192, Capacity(1024, 8192, 8192, 1_048_576)),
}


@pytest.mark.parametrize("device", DEVICES.values(), ids=DEVICES.keys())
def test_the_backlog_follows_the_batch_the_engine_resolved(
    device: tuple[int, int, Capacity],
) -> None:
    max_num_seqs, max_num_batched_tokens, expected = device
    resolved = config(max_num_seqs, max_num_batched_tokens)
    assert resolve_capacity(resolved) == expected
    # Written where the engine's own admission check reads them.
    assert resolved.scheduler_config.max_num_queued_reqs == expected.max_num_queued_reqs
    assert resolved.scheduler_config.max_num_queued_tokens == expected.max_num_queued_tokens


def test_data_parallel_ranks_each_add_a_batch() -> None:
    capacity = resolve_capacity(config(256, 2048, data_parallel_size=4))
    assert (capacity.max_num_seqs, capacity.max_num_queued_reqs) == (1024, 8192)
    assert capacity.max_num_queued_tokens == 4 * 262_144


def test_operator_bounds_are_kept() -> None:
    resolved = config(128, 2048, max_num_queued_reqs=40, max_num_queued_tokens=5000)
    capacity = resolve_capacity(resolved)
    assert (capacity.max_num_queued_reqs, capacity.max_num_queued_tokens) == (40, 5000)


def test_the_token_bound_holds_at_least_one_whole_context() -> None:
    capacity = resolve_capacity(config(128, 256, max_model_len=131_072))
    assert capacity.max_num_queued_tokens == 131_072


class Engine:
    """The engine's counts that the backlog reads, with vLLM's own admission check."""

    check_admission = AsyncLLM.check_admission

    def __init__(self, capacity: Capacity) -> None:
        self.unfinished = 0
        self.queued_tokens = 0
        self.scheduler_config = SimpleNamespace(
            max_num_queued_reqs=capacity.max_num_queued_reqs,
            max_num_queued_tokens=capacity.max_num_queued_tokens,
        )
        self.admission_stats = None
        self.rejections: list[str] = []

    def get_num_unfinished_requests(self) -> int:
        return self.unfinished

    def get_num_queued_tokens(self) -> int:
        return self.queued_tokens

    def _record_admission_rejection(self, reason: str) -> None:
        self.rejections.append(reason)


CAPACITY = Capacity(
    max_num_seqs=4, max_num_batched_tokens=64, max_num_queued_reqs=10, max_num_queued_tokens=100
)


def backlog() -> tuple[Backlog, Engine]:
    engine = Engine(CAPACITY)
    return Backlog(engine, CAPACITY), engine  # type: ignore[arg-type]


def test_a_call_is_admitted_while_its_sequences_fit() -> None:
    queue, engine = backlog()
    engine.unfinished = 6
    queue.check(4)  # 6 + 4 = 10: at the bound, not past it
    queue.admit(4)
    with pytest.raises(OverloadedError) as refused:
        queue.check(5)
    assert refused.value.grpc_code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert ("retry-after", "1") in refused.value.metadata()
    assert "6 sequences are waiting or running" in refused.value.message
    assert "needs 5" in refused.value.message


def test_calls_being_tokenized_count_against_the_bound() -> None:
    queue, engine = backlog()
    engine.unfinished = 2
    with queue.preparing(4), queue.preparing(3):
        assert queue.preparing_calls == 2
        with pytest.raises(OverloadedError), queue.preparing(2):
            pass  # 2 + 7 + 2 > 10
        queue.check(1)
    assert (queue.preparing_calls, queue.preparing_sequences) == (0, 0)
    queue.check(8)


def test_a_full_prefill_backlog_refuses_whatever_the_sequences() -> None:
    queue, engine = backlog()
    engine.queued_tokens = 99
    queue.check(1)
    engine.queued_tokens = 100
    with pytest.raises(OverloadedError) as refused:
        queue.check(1)
    assert "prompt tokens waiting to be prefilled reached the bound of 100" in refused.value.message


@pytest.mark.parametrize(
    ("unfinished", "queued_tokens", "reason"),
    [(8, 0, "max_num_queued_reqs"), (0, 100, "max_num_queued_tokens")],
)
def test_the_engines_own_check_is_translated_and_recorded(
    unfinished: int, queued_tokens: int, reason: str
) -> None:
    queue, engine = backlog()
    engine.unfinished, engine.queued_tokens = unfinished, queued_tokens
    with pytest.raises(OverloadedError) as refused:
        queue.admit(3)
    assert ("retry-after", "1") in refused.value.metadata()
    assert engine.rejections == [reason]  # vllm:admission_rejections_total counts it
