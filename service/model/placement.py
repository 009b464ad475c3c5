"""Where the engine runs: the CPU cores its threads are bound to (vLLM's CPU build), or the
devices it sees (GPU builds).

vLLM's CPU build binds its worker's OpenMP threads by itself (`VLLM_CPU_OMP_THREADS_BIND`
"auto"), always to the same cores of the NUMA node: two replicas on one host then share them,
and one starves (measured on a 2-core host: requests stuck for over 20 s, a restart beside a busy
replica taking 3 min 40 s instead of 33 s). Each replica of a host needs cores of its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

CPU_BIND_ENV = "VLLM_CPU_OMP_THREADS_BIND"
DEVICES_ENV = "CUDA_VISIBLE_DEVICES"
# The engine's processes as /proc's comm shows them (15 characters: psutil's name() may be
# longer, so match these as prefixes there).
ENGINE_WORKER_NAME = "VLLM::Worker"
ENGINE_CORE_NAME = "VLLM::EngineCor"
ENGINE_PROCESS_NAMES = (ENGINE_WORKER_NAME, ENGINE_CORE_NAME)


class PlacementError(ValueError):
    """A core or device list that cannot be used; the message says why."""


def parse_core_list(text: str, available: set[int]) -> tuple[int, ...]:
    """`0-3`, `0,2` or `0-1,4` into core ids, each one this process may run on."""
    cores: list[int] = []
    for part in text.split(","):
        first, dash, last = part.strip().partition("-")
        if not first.isdigit() or (dash and not last.isdigit()):
            raise PlacementError(f"{text!r} is not a list of cores such as 0-3 or 0,2")
        span = range(int(first), int(last if dash else first) + 1)
        if not span:
            raise PlacementError(f"{part.strip()!r} is an empty range")
        cores.extend(span)
    missing = sorted(set(cores) - available)
    if missing:
        raise PlacementError(
            f"cores {missing} are not available here (this process may use "
            f"{format_cores(available)})"
        )
    if len(set(cores)) != len(cores):
        raise PlacementError(f"{text!r} names a core twice")
    return tuple(cores)


def format_cores(cores: set[int] | tuple[int, ...]) -> str:
    return ",".join(str(core) for core in sorted(cores))


def available_cores() -> set[int]:
    return set(os.sched_getaffinity(0))


def other_engines(proc: Path = Path("/proc")) -> list[int]:
    """Pids of the vLLM engine processes running on this host (before this server starts its
    own: other replicas')."""
    found = []
    for entry in proc.iterdir():
        try:
            if entry.name.isdigit() and (entry / "comm").read_text().strip() in (
                ENGINE_PROCESS_NAMES
            ):
                found.append(int(entry.name))
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return sorted(found)


def binding(cpu_cores: tuple[int, ...], ranks: int) -> str:
    """vLLM's binding value: the cores split evenly over the engine's ranks (tensor x pipeline
    parallel workers), one list per rank separated by `|`."""
    if len(cpu_cores) % ranks:
        raise PlacementError(
            f"{len(cpu_cores)} cores cannot be split evenly over {ranks} engine workers "
            "(tensor x pipeline parallel size)"
        )
    size = len(cpu_cores) // ranks
    return "|".join(format_cores(cpu_cores[i * size : (i + 1) * size]) for i in range(ranks))


def place_engine(cpu_cores: tuple[int, ...], devices: str | None, ranks: int, on_cpu: bool) -> None:
    """Set the environment the engine's processes inherit, and say in one line where it runs
    (with a warning when automatic binding may share cores with another engine)."""
    if devices is not None:
        os.environ[DEVICES_ENV] = devices
        logger.info("engine placement: devices %s", devices)
    if not on_cpu:
        return
    if cpu_cores:
        os.environ[CPU_BIND_ENV] = binding(cpu_cores, ranks)
        logger.info("engine placement: cores %s", os.environ[CPU_BIND_ENV])
        return
    if os.environ.get(CPU_BIND_ENV, "auto") != "auto":
        logger.info("engine placement: %s=%s", CPU_BIND_ENV, os.environ[CPU_BIND_ENV])
        return
    others = other_engines()
    if others:
        logger.warning(
            "engine placement: automatic, beside another vLLM engine on this host (pids %s): "
            "both bind the same cores and one starves; give each replica its own with "
            "--cpu-cores (CPU_CORES)",
            ",".join(map(str, others)),
        )
    else:
        logger.info("engine placement: automatic (vLLM binds its threads)")


def children_by_name(parent: int, proc: Path = Path("/proc")) -> dict[str, list[int]]:
    """The processes beneath `parent` (children, grandchildren, ...) by their /proc comm."""
    children: dict[int, list[tuple[int, str]]] = {}
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        ppid = int(stat[stat.rindex(")") + 2 :].split()[1])
        children.setdefault(ppid, []).append((int(entry.name), name))
    found: dict[str, list[int]] = {}
    frontier = [parent]
    while frontier:
        for pid, name in sorted(children.get(frontier.pop(), [])):
            found.setdefault(name, []).append(pid)
            frontier.append(pid)
    return found


def threads(pids: Sequence[int], proc: Path = Path("/proc")) -> list[int]:
    """The thread ids of the processes (those gone meanwhile left out)."""
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            found.extend(int(task.name) for task in (proc / str(pid) / "task").iterdir())
    return found


def bound_cores(tids: Sequence[int]) -> set[int]:
    """The cores the threads are bound to: the union of every affinity narrower than this
    process's own (an unbound thread may run anywhere and says nothing)."""
    anywhere = available_cores()
    cores: set[int] = set()
    for tid in tids:
        with contextlib.suppress(OSError):
            affinity = os.sched_getaffinity(tid)
            if affinity < anywhere:
                cores |= affinity
    return cores


def confine_engine_core(parent: int | None = None) -> None:
    """Move the engine-core process onto the cores its worker process is bound to (where the
    worker runs in the core, the core is bound already: say where).

    vLLM's CPU build binds only the worker's threads; the engine-core process may run anywhere.
    It waits for each step's result by spinning (yielding, but always runnable), so it sits on
    the cores left for serving requests and the frontend and Envoy wait behind it. Its work and
    the worker's take turns (one schedules a step, the other runs it), so on the worker's cores
    it costs the step nothing (docs/benchmarks/serving-cost.md).
    """
    engine = children_by_name(os.getpid() if parent is None else parent)
    workers = engine.get(ENGINE_WORKER_NAME, [])
    core_pids = engine.get(ENGINE_CORE_NAME, [])
    if core_pids and not workers:  # the worker runs in the core (service/model/in_core_worker.py)
        logger.info(
            "engine placement: engine core (pid %s) runs its worker, on cores %s",
            ",".join(map(str, core_pids)),
            format_cores(bound_cores(threads(core_pids))) or "of its own choosing",
        )
        return
    cores = bound_cores(threads(workers))
    if not cores or not core_pids:
        logger.info("engine placement: the engine core runs where it likes (no bound worker)")
        return
    for tid in threads(core_pids):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cores)
    logger.info(
        "engine placement: engine core (pid %s) on its worker's cores %s",
        ",".join(map(str, core_pids)),
        format_cores(cores),
    )
