"""How loaded the engine is right now: sequences running and waiting, and KV-cache use, for the
load reports each reply carries (service.transport.load_reports).

The engine's total is exact (the requests it has not finished); how that total splits into
running and waiting, and the KV-cache use, come from the scheduler's latest step, which vLLM
reports to its stat loggers (one of them is EngineLoad's).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.config import VllmConfig
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats


@dataclass(frozen=True)
class LoadSnapshot:
    running: int  # sequences in the running batch
    waiting: int  # sequences queued in the engine's scheduler
    kv_cache_usage: float  # the share of KV-cache blocks in use, 0..1 (the ranks' mean)
    max_num_seqs: int  # the batch the engine runs at once
    max_num_queued_reqs: int  # sequences held (running or waiting) past which it refuses
    adapters: tuple[str, ...] = ()  # the LoRA adapters in the engine's memory

    @property
    def utilization(self) -> float:
        """Requests held as a share of the batch: 1 when the batch is full, above when some
        wait."""
        return (self.running + self.waiting) / self.max_num_seqs


@dataclass
class EngineLoad:
    """The scheduler's latest step per data-parallel rank, kept by a stat logger of the
    engine (`stat_logger`, passed to the engine when it is built)."""

    max_num_seqs: int
    max_num_queued_reqs: int
    steps: dict[int, SchedulerStats] = field(default_factory=dict)

    def stat_logger(self, vllm_config: VllmConfig, engine_index: int = 0) -> StatLoggerBase:
        return LatestStep(self, engine_index)

    def snapshot(self, engine: AsyncLLM) -> LoadSnapshot:
        held = engine.get_num_unfinished_requests()
        steps = list(self.steps.values())
        waiting = min(held, sum(step.num_waiting_reqs for step in steps))
        kv_cache_usage = sum(step.kv_cache_usage for step in steps) / len(steps) if steps else 0.0
        return LoadSnapshot(
            held - waiting, waiting, kv_cache_usage, self.max_num_seqs, self.max_num_queued_reqs
        )


class LatestStep(StatLoggerBase):
    """Keeps each step's scheduler stats on an EngineLoad; logs nothing."""

    def __init__(self, load: EngineLoad, engine_index: int = 0) -> None:
        self.load = load
        self.engine_index = engine_index

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        if scheduler_stats is not None:
            self.load.steps[engine_idx] = scheduler_stats

    def log_engine_initialized(self) -> None:
        pass
