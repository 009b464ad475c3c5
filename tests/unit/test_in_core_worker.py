"""Where the engine's worker runs: inside the engine core on vLLM's CPU build with one worker,
spawned with the OpenMP binding vLLM gives its own worker processes."""

from __future__ import annotations

import os
from types import SimpleNamespace
from typing import Any

import pytest

from service.model import in_core_worker
from service.model.gloo_timer_slack import QUIET_GLOO_CPU_WORKER, VLLM_CPU_WORKER


def config(
    world_size: int = 1,
    data_parallel: int = 1,
    backend: str = "mp",
    worker_cls: str = VLLM_CPU_WORKER,  # as vLLM's CPU build resolves "auto"
) -> Any:
    parallel = SimpleNamespace(
        world_size=world_size,
        local_world_size=world_size,
        data_parallel_size=data_parallel,
        data_parallel_rank_local=None,
        _api_process_count=1,
        distributed_executor_backend=backend,
        worker_cls=worker_cls,
    )
    model = SimpleNamespace(multimodal_config=None)
    return SimpleNamespace(parallel_config=parallel, kv_transfer_config=None, model_config=model)


@pytest.mark.parametrize("chosen", [None, "uni"])
def test_one_cpu_worker_runs_in_the_engine_core(chosen: str | None) -> None:
    resolved = config()  # vLLM's CPU build resolves a process of its own ("mp")
    in_core_worker.place_worker(resolved, chosen)
    assert resolved.parallel_config.distributed_executor_backend == "uni"
    assert resolved.parallel_config.worker_cls == QUIET_GLOO_CPU_WORKER


def test_a_worker_class_the_operator_chose_is_kept() -> None:
    resolved = config(worker_cls="their.own.Worker")
    in_core_worker.place_worker(resolved, None)
    assert resolved.parallel_config.distributed_executor_backend == "uni"
    assert resolved.parallel_config.worker_cls == "their.own.Worker"


@pytest.mark.parametrize(
    ("resolved", "chosen"),
    [
        (config(world_size=2), None),  # tensor or pipeline parallel workers
        (config(data_parallel=2), None),
        (config(), "mp"),  # the operator asked for vLLM's own arrangement
        (config(), "ray"),
    ],
)
def test_other_engines_keep_vllms_arrangement(resolved: Any, chosen: str | None) -> None:
    in_core_worker.place_worker(resolved, chosen)
    assert resolved.parallel_config.distributed_executor_backend == "mp"
    assert resolved.parallel_config.worker_cls == VLLM_CPU_WORKER


def test_a_gpu_engine_keeps_vllms_arrangement(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(in_core_worker, "current_platform", SimpleNamespace(is_cpu=lambda: False))
    resolved = config()
    in_core_worker.place_worker(resolved, None)
    assert resolved.parallel_config.distributed_executor_backend == "mp"


@pytest.fixture
def bound_to_core_1(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "1")
    monkeypatch.setenv("LD_PRELOAD", "/lib/libgomp.so.1")  # vLLM's CPU build preloads it
    for name in ("GOMP_CPU_AFFINITY", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.usefixtures("bound_to_core_1")
def test_the_engine_core_is_spawned_with_its_workers_binding_and_only_it() -> None:
    with in_core_worker.engine_core_environment(config(backend="uni")):
        assert os.environ["GOMP_CPU_AFFINITY"] == "1"
        assert os.environ["OMP_NUM_THREADS"] == "1"
    assert "GOMP_CPU_AFFINITY" not in os.environ
    assert "OMP_NUM_THREADS" not in os.environ


@pytest.mark.usefixtures("bound_to_core_1")
def test_an_engine_core_with_worker_processes_is_spawned_as_vllm_spawns_it() -> None:
    with in_core_worker.engine_core_environment(config(backend="mp")):
        assert "GOMP_CPU_AFFINITY" not in os.environ


class FakeStandby:
    """A copy that records being let go."""

    def __init__(self) -> None:
        self.dismissed = False

    def dismiss(self) -> None:
        self.dismissed = True


@pytest.mark.usefixtures("bound_to_core_1")
@pytest.mark.parametrize("multimodal", [False, True])
def test_a_copy_made_for_an_engine_that_cannot_use_it_is_let_go(multimodal: bool) -> None:
    resolved = config(backend="mp")  # vLLM's worker processes: the core is spawned
    if multimodal:
        resolved = config(backend="uni")
        resolved.model_config.multimodal_config = object()  # hands the core a tensor queue
    copy = FakeStandby()
    with in_core_worker.engine_core_environment(resolved, copy):  # type: ignore[arg-type]
        pass
    assert copy.dismissed
