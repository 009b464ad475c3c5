"""One frontend process of a replica with several: what the parent hands it (its engine-core
link, its own port and socket, its siblings') and its entry point."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from plumbing.lifetime import exit_now
from service.api.backlog import ReplicaTally
from service.model.frontends import FrontendLink
from service.settings import EngineSettings, ServerSettings
from service.transport.logs import configure_logging
from service.transport.siblings import Siblings


@dataclass(frozen=True)
class FrontendRole:
    link: FrontendLink  # how it reaches the engine core, and its index among `link.count`
    own_port: int  # besides the replica's port, shared by every frontend
    own_socket: str  # a unix socket for its siblings' cancels
    sibling_sockets: tuple[str, ...]
    tally_counters: Any  # the shared memory of service.api.backlog.ReplicaTally

    def siblings(self) -> Siblings:
        return Siblings(self.sibling_sockets)

    def tally(self) -> ReplicaTally:
        return ReplicaTally(self.tally_counters, self.link.count, self.link.index)


def run_frontend(
    role: FrontendRole, server: ServerSettings, engine: EngineSettings, logging: tuple[str, str]
) -> None:
    """The frontend process's target: serve until stopped, exit with the server's code."""
    from vllm.utils.system_utils import set_process_title

    from service.transport.server import run_server  # not at the top: server imports this module

    set_process_title("Frontend", str(role.link.index))  # as vLLM names its API servers
    configure_logging(*logging, frontend=role.link.index)
    exit_now(run_server(server, engine, role))
