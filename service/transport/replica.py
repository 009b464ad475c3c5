"""The parent of a replica with several frontend processes (`--api-server-count N`).

It serves no calls. It launches the engine core, starts the frontends while the core loads
(each a gRPC server on the replica's port, shared, and on its own; each a copy of this process
made after its imports, service/model/standby_core.py), serves their metrics as one scrape,
and keeps the replica one thing to the outside: SIGTERM drains every frontend before the
engine core stops, and a frontend or engine core that dies stops the rest (exit 1, for the
orchestrator to restart the replica). Every process it starts dies with it.
"""

from __future__ import annotations

import logging
import multiprocessing
import signal
import socket
import tempfile
import time
from dataclasses import replace
from multiprocessing.connection import wait
from multiprocessing.process import BaseProcess
from pathlib import Path
from types import FrameType

from prometheus_client import multiprocess
from vllm.platforms import current_platform

from service.api.backlog import ReplicaTally
from service.api.rate_limits import DEFAULT_STORE
from service.api.shared_windows import ServedWindows, store_url
from service.model.frontends import EngineCore, FrontendLink, launch_engine_core
from service.model.in_core_worker import may_run_worker_in_core
from service.model.placement import confine_engine_core
from service.model.standby_core import ENGINE_CORE_MODULES, Standby, stand_by, start_process
from service.settings import EngineSettings, ServerSettings
from service.transport.frontend import FrontendRole, run_frontend
from service.transport.frontend_metrics import require_metrics_directory
from service.transport.observability import serve_frontends_metrics

logger = logging.getLogger(__name__)

WATCH_SECONDS = 0.5
# Past the frontends' own drain (delay + grace + engine stop), the time they get to exit.
EXIT_MARGIN_SECONDS = 10.0
# What a frontend runs beyond this process's imports: imported before the copies are made.
# The frontends are copies on vLLM's CPU build; elsewhere (a GPU) they are still spawned, as
# vLLM spawns its API servers, until copies are tried on one.
FRONTEND_MODULES = ("service.transport.server",)


class Stopping:
    """SIGTERM and SIGINT: during the start, end it at once (SystemExit, as `vllm serve`);
    once serving, noted for the watch loop, which then drains."""

    def __init__(self) -> None:
        self.requested = False
        self.serving = False
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, self.handle)

    def handle(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True
        if not self.serving:
            raise SystemExit(0)


def check_ports_free(settings: ServerSettings) -> None:
    """The frontends share the replica's port (SO_REUSEPORT): a server already on it would
    share it too. So nothing may listen on any of the ports before they start. The probe binds
    as gRPC will (SO_REUSEADDR, without SO_REUSEPORT): a port whose only sockets are the last
    run's connections in TIME_WAIT (a drain leaves them for a minute) is free, one a server
    listens on is not."""
    for port in (settings.port, *settings.own_ports()):
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind((settings.host, port))
            except OSError:
                raise SystemExit(
                    f"cannot listen on {settings.host}:{port}: is the port in use? Pick "
                    "others with --port and --frontend-ports"
                ) from None


class Frontends:
    """Starts the frontends as the engine core's launch hands out their links."""

    def __init__(
        self,
        server: ServerSettings,
        engine: EngineSettings,
        log_setup: tuple[str, str],
        copies: list[Standby],
    ) -> None:
        self.server, self.engine, self.log_setup = server, engine, log_setup
        self.copies = copies  # copies of this process standing by to run them (or spawned)
        count = server.api_server_count
        self.sockets_dir = tempfile.TemporaryDirectory(prefix="llm-completions-frontends-")
        self.sockets = [str(Path(self.sockets_dir.name, f"{i}.sock")) for i in range(count)]
        self.context = multiprocessing.get_context("spawn")
        self.tally = self.context.RawArray("q", ReplicaTally.FIELDS * count)
        self.processes: list[BaseProcess] = []
        self.windows: ServedWindows | None = None
        if server.tenants_file is not None and server.limits_store == DEFAULT_STORE:
            # Tenants' windows in memory: one set for the replica, not one per frontend.
            path = str(Path(self.sockets_dir.name, "windows.sock"))
            self.windows = ServedWindows(path)
            self.server = replace(server, limits_store=store_url(path))

    def role(self, link: FrontendLink) -> FrontendRole:
        siblings = tuple(path for i, path in enumerate(self.sockets) if i != link.index)
        own_port = self.server.own_ports()[link.index]
        return FrontendRole(link, own_port, self.sockets[link.index], siblings, self.tally)

    def start(self, links: list[FrontendLink]) -> list[BaseProcess]:
        for link in links:
            copy = self.copies[0] if self.copies else None
            process = start_process(
                copy,
                target=run_frontend,
                args=(self.role(link), self.server, self.engine, self.log_setup),
                name=f"Frontend_{link.index}",
            )
            if copy is not None:
                self.copies.pop(0)  # handed (a start that failed before leaves it to dismiss)
            self.processes.append(process)
        return self.processes

    def stop(self, timeout: float) -> bool:
        """SIGTERM to each (each drains its calls), SIGKILL to any left after `timeout`;
        True if every one exited 0."""
        for copy in self.copies:  # the launch failed before their frontends started
            copy.dismiss()
        for process in self.processes:
            if process.is_alive():
                process.terminate()
        deadline = time.monotonic() + timeout
        for process in self.processes:
            process.join(max(deadline - time.monotonic(), 0))
            if process.is_alive():
                logger.warning(
                    "frontend %s still running after %.0fs: killed", process.name, timeout
                )
                process.kill()
                process.join()
            if process.pid is not None:
                multiprocess.mark_process_dead(process.pid)
        if self.windows is not None:
            self.windows.close()
        self.sockets_dir.cleanup()
        return all(process.exitcode == 0 for process in self.processes)


def run_replica(server: ServerSettings, engine: EngineSettings, log_setup: tuple[str, str]) -> int:
    """Run the engine core and `server.api_server_count` frontends until stopped; the exit
    code. The frontends' metrics directory is set already (frontend_metrics)."""
    require_metrics_directory()
    check_ports_free(server)
    # Before the first thread and socket: the copies that run the engine core and frontends.
    core_copy = may_run_worker_in_core(engine)
    frontend_copies = server.api_server_count if current_platform.is_cpu() else 0
    modules = (*(ENGINE_CORE_MODULES if core_copy else ()), *FRONTEND_MODULES)
    copies = stand_by(int(core_copy) + frontend_copies, modules)
    standby = copies.pop(0) if core_copy and copies else None
    stopping = Stopping()
    frontends = Frontends(server, engine, log_setup, copies)
    if server.metrics_port is not None:
        serve_frontends_metrics(server.metrics_host, server.metrics_port)
    logger.info(
        "starting the engine core and %d frontends on %s:%d (each also on %s)",
        server.api_server_count,
        server.host,
        server.port,
        ",".join(map(str, server.own_ports())),
    )
    core: EngineCore | None = None
    stopped_while_starting = failed = False
    try:
        core = launch_engine_core(engine, server.api_server_count, frontends.start, standby)
        stopping.serving = True
        if current_platform.is_cpu():
            confine_engine_core()
        failed = watch(frontends.processes, core, stopping)
    except SystemExit:
        logger.info("stopped while starting")
        stopped_while_starting = True
    except Exception:
        logger.exception("the engine core failed to start; check --model and the engine arguments")
        failed = True
    stopping.serving = True  # a second signal no longer interrupts the stop
    drained = frontends.stop(drain_seconds(server))
    if standby is not None:
        standby.dismiss()  # not handed if the launch ended before it (nothing if it was)
    if core is not None:
        core.shutdown(timeout=server.engine_stop_seconds)
    logger.info("stopped")
    return 0 if stopped_while_starting or (drained and not failed) else 1


def drain_seconds(server: ServerSettings) -> float:
    return (
        server.drain_delay_seconds
        + server.shutdown_grace_seconds
        + server.engine_stop_seconds
        + EXIT_MARGIN_SECONDS
    )


def watch(frontends: list[BaseProcess], core: EngineCore, stopping: Stopping) -> bool:
    """Until a stop signal (False) or a frontend or engine-core process ends (True)."""
    watched = {process.sentinel: f"frontend {process.name}" for process in frontends}
    watched.update({process.sentinel: "the engine core" for process in core.processes()})
    logger.info("serving through %d frontends", len(frontends))
    while not stopping.requested:
        ended = wait(list(watched), timeout=WATCH_SECONDS)
        if ended:
            logger.error("%s exited: stopping the replica for a restart", watched[ended[0]])
            return True
    logger.info("stopping: draining every frontend")
    return False
