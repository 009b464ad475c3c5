"""On vLLM's CPU build, the engine's one worker runs inside the engine-core process.

vLLM's CPU build always starts its worker as a process of its own: it binds the worker's
OpenMP threads to their cores through the environment a new process starts with (libgomp
reads it once, when it loads). The engine core is a new process too. Started with that same
environment (vLLM's own `OMPProcessManager` sets it), it runs the worker in-process, as vLLM
does on a GPU with one device (`UniProcExecutor`). One process fewer imports torch and vLLM
at a start-up, and the core no longer spins waiting for each step's result from another
process (placement.confine_engine_core had to keep that spin off the serving cores). Measured on
a 2-core host (docs/benchmarks/start-up.md): ready in 0.74x the
time and 0.70x the CPU (about 22 s and 22 CPU-seconds against 30 and 32), the same time a step.

Several workers (tensor or pipeline parallel), data parallel ranks, or a backend the operator
chose (`--distributed-executor-backend mp`) keep vLLM's own arrangement.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from vllm.config import VllmConfig
from vllm.platforms import current_platform
from vllm.utils.ompmultiprocessing import OMPProcessManager

from service.model.gloo_timer_slack import QUIET_GLOO_CPU_WORKER, VLLM_CPU_WORKER
from service.model.standby_core import Standby, standing_in
from service.settings import EngineSettings

IN_CORE = "uni"  # vLLM's executor that runs the worker in the engine-core process


def worker_fits_in_core(chosen_backend: str | None, workers: int, data_parallel: int) -> bool:
    """vLLM's CPU build, one worker, one data-parallel rank, and no other backend chosen."""
    return (
        current_platform.is_cpu()
        and chosen_backend in (None, IN_CORE)
        and workers == 1
        and data_parallel == 1
    )


def runs_worker_in_core(config: VllmConfig, chosen_backend: str | None) -> bool:
    """Whether this engine runs its worker inside the engine core (`worker_fits_in_core`)."""
    parallel = config.parallel_config
    return worker_fits_in_core(chosen_backend, parallel.world_size, parallel.data_parallel_size)


def place_worker(config: VllmConfig, chosen_backend: str | None) -> None:
    """Set the executor of a resolved configuration (vLLM's CPU build resolves its own process
    whatever was asked), and vLLM's CPU worker's gloo threads quiet (gloo_timer_slack)."""
    if not runs_worker_in_core(config, chosen_backend):
        return
    parallel = config.parallel_config
    parallel.distributed_executor_backend = IN_CORE
    if parallel.worker_cls == VLLM_CPU_WORKER:
        parallel.worker_cls = QUIET_GLOO_CPU_WORKER


def may_run_worker_in_core(settings: EngineSettings) -> bool:
    """Whether an engine of these settings will run its worker inside the engine core, known
    before vLLM resolves its configuration."""
    return worker_fits_in_core(
        settings.distributed_executor_backend,
        settings.tensor_parallel_size * settings.pipeline_parallel_size,
        settings.data_parallel_size,
    )


@contextlib.contextmanager
def engine_core_environment(config: VllmConfig, standby: Standby | None = None) -> Iterator[None]:
    """Hold while the engine core is launched: when it runs the worker, the OpenMP binding that
    vLLM gives a worker process of rank 0, and the server's standing-by copy as the process
    (service/model/standby_core.py); nothing otherwise (a copy made is then let go)."""
    in_core = config.parallel_config.distributed_executor_backend == IN_CORE
    in_core = in_core and current_platform.is_cpu()
    # A multimodal model's engine core is handed a queue of tensors: open files a copy made
    # before cannot receive.
    if standby is not None and (not in_core or config.model_config.multimodal_config):
        standby.dismiss()
        standby = None
    if not in_core:
        yield
        return
    threads = OMPProcessManager(config)
    cores = () if threads.skip_setup or not threads.cpu_lists else threads.cpu_lists[0]
    with threads.configure_omp_envs(rank=0, local_rank=0), standing_in(standby, cores):
        yield
