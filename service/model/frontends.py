"""One engine core, several frontend processes over it (vLLM's `--api-server-count`).

The parent launches the engine core with vLLM's own functions, as `vllm serve` does
(`bind_engine_zmq_listeners`, `launch_core_engines`): one input and one output queue per
frontend, bound before the core starts. Each frontend builds its `AsyncLLM` as a client of
that core (`client_addresses`, `client_count`, `client_index`); vLLM's admission counters in
shared memory let each frontend's check count the requests of all of them.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

from vllm.v1.engine.admission_control import SharedAdmissionStats
from vllm.v1.engine.utils import bind_engine_zmq_listeners, launch_core_engines
from vllm.v1.executor import Executor

from service.model.adapters import build_catalog
from service.model.default_model import model_directory
from service.model.engine import api_server_config, engine_args, prepare_engine_processes
from service.model.in_core_worker import engine_core_environment
from service.model.standby_core import Standby
from service.settings import EngineSettings

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FrontendLink:
    """What frontend `index` of `count` connects to the engine core with. It crosses to the
    spawned frontend process (multiprocessing passes the queues' sockets along)."""

    index: int
    count: int
    client_addresses: dict[str, Any] = field(default_factory=dict)
    adapter_snapshots: str = ""  # where runtime adapters' copies go, shared by every frontend

    def client_arguments(self) -> dict[str, Any]:
        """AsyncLLM.from_vllm_config's arguments for a client of an external engine core."""
        return {
            "client_addresses": dict(self.client_addresses),
            "client_count": self.count,
            "client_index": self.index,
        }


@dataclass
class EngineCore:
    """The launched engine core: its processes, for the parent to watch and stop."""

    manager: Any  # vLLM's CoreEngineProcManager
    scratch: tempfile.TemporaryDirectory[str]
    # The frontends' queues, bound here. Held until the core stops: when vLLM's listeners are
    # collected they unlink their IPC paths, and an engine core still connecting to a frontend
    # then never reaches it (that frontend's calls hung).
    listeners: Any

    def processes(self) -> list[BaseProcess]:
        return list(getattr(self.manager, "processes", []))

    def shutdown(self, timeout: float) -> None:
        self.manager.shutdown(timeout=timeout)
        self.listeners.cleanup()
        self.scratch.cleanup()


def links(count: int, listeners: Any, counters: Any, snapshots: Path) -> list[FrontendLink]:
    return [
        FrontendLink(
            index,
            count,
            {
                "input_address": inputs.address,
                "output_address": outputs.address,
                "input_listener": inputs.socket,
                "output_listener": outputs.socket,
                "mp_admission_counters": counters,
            },
            str(snapshots),
        )
        for index, (inputs, outputs) in enumerate(
            zip(listeners.inputs, listeners.outputs, strict=True)
        )
    ]


def launch_engine_core(
    settings: EngineSettings,
    count: int,
    start_frontends: Callable[[list[FrontendLink]], list[BaseProcess]],
    standby: Standby | None = None,
) -> EngineCore:
    """Launch the engine core (the `standby` copy of this process, where one was made) for
    `count` frontends and start them (`start_frontends`, which returns their processes) while
    it loads; returns once the core is ready. A frontend that exits meanwhile ends the launch
    with vLLM's error."""
    scratch = tempfile.TemporaryDirectory(prefix="llm-completions-core-")
    args = engine_args(
        settings, model_directory(settings.model), build_catalog(settings, Path(scratch.name))
    )
    prepare_engine_processes(settings, Path(scratch.name))
    config = api_server_config(args, count, -1)
    listeners = bind_engine_zmq_listeners(config, count)
    counters = multiprocessing.get_context("spawn").RawArray(
        "q", SharedAdmissionStats.num_counters(count)
    )
    with contextlib.ExitStack() as launched:
        # Only the engine core is spawned with its worker's binding, not the frontends.
        with engine_core_environment(config, standby):
            launch = launched.enter_context(
                launch_core_engines(
                    config,
                    Executor.get_class(config),
                    not args.disable_log_stats,
                    listeners.addresses,
                )
            )
        snapshots = Path(scratch.name) / "adapters"
        frontends = start_frontends(links(count, listeners, counters, snapshots))
        for listener in (*listeners.inputs, *listeners.outputs):
            listener.close()  # the frontends hold them now
        launch.watched_frontend_processes = frontends
    logger.info("engine core ready for %d frontends", count)
    return EngineCore(launch.engine_manager, scratch, listeners)
