"""The test and benchmark harness over facade.stack: stacks on free ports, with the service's
output in a log file, another module or checkout as the service, and readiness of the
service alone."""

from __future__ import annotations

import contextlib
import os
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc
import httpx
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

from facade.picker.fleet import read_clusters
from facade.stack import Stack, StackError, stop_processes
from tests.engines import STARTS

__all__ = [
    "HealthWatch",
    "HelperServer",
    "StackError",
    "TestStack",
    "free_port",
    "healthy_upstreams",
    "is_engine",
    "left_running",
    "lua_errors",
    "port_open",
    "shared_picker",
    "start_helper_server",
    "still_running",
]


EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
FREE_PORTS_BELOW_EPHEMERAL = 12_000
# A test's own Envoy or picker gets a short grace after SIGTERM, then SIGKILL: no test that
# starts one checks how it exits (Stack.stop, which the operator's path uses, keeps its 40 s).
# With TLS files to watch, Envoy took 30-110 s to exit on a host loaded by both shards, its main
# thread in close(2) the whole time, and those waits were a tenth of a shard's time.
HELPER_STOP_SECONDS = 5.0
handed_out: set[int] = set()


def ephemeral_low() -> int:
    """The lowest port the kernel gives outgoing connections (32768 where unknown)."""
    try:
        return int(EPHEMERAL_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now, and that this process has not
    handed out before. It lies below the kernel's ephemeral range: a port from that range can
    become the source port of any outgoing connection before the process meant to bind it
    does (an Envoy's admin port did, while its launcher waited minutes for its pools)."""
    low = ephemeral_low()
    while True:
        port = random.randrange(max(1024, low - FREE_PORTS_BELOW_EPHEMERAL), low)
        if port in handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        handed_out.add(port)
        return port


def lua_errors(admin_url: str) -> int:
    """Envoy's count of errors raised by its Lua filters' scripts."""
    stats = httpx.get(f"{admin_url}/stats", params={"filter": r"\.lua\.errors$"}, timeout=10)
    return sum(int(line.rpartition(": ")[2]) for line in stats.text.splitlines() if line)


def envoy_counter(admin_url: str, name: str) -> int:
    """An Envoy counter by its full name, e.g. cluster.replica_picker.upstream_cx_total (0
    while Envoy does not answer yet)."""
    name_only = f"^{re.escape(name)}$"
    try:
        stats = httpx.get(f"{admin_url}/stats", params={"filter": name_only}, timeout=5)
    except httpx.HTTPError:
        return 0
    return sum(int(line.rpartition(": ")[2]) for line in stats.text.splitlines() if line)


def healthy_upstreams(admin_url: str, cluster: str) -> set[str]:
    """The hosts of `cluster` that Envoy's admin /clusters shows healthy (none if Envoy does
    not answer yet)."""
    try:
        hosts = read_clusters(admin_url).get(cluster, {})
    except OSError:
        return set()
    return {host for host, replica in hosts.items() if replica.healthy}


def clean_environment(**settings: str) -> dict[str, str]:
    """This process's environment without the variables that set the facade's TLS, pools,
    balancing or picker (a test says what it tests), plus `settings`."""
    ours = ("TLS_", "UPSTREAM_", "PICKER", "POOLS", "BALANCE", "GRPC_PORT")
    return {**{k: v for k, v in os.environ.items() if not k.startswith(ours)}, **settings}


def port_open(port: int) -> bool:
    """Whether something accepts connections on the loopback port."""
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
        return True
    return False


@contextlib.contextmanager
def shared_picker(
    port: int,
    upstreams: list[str],
    log: Path | None = None,
    options: Sequence[str] = (),
    timeout: float = 30,
) -> Iterator[subprocess.Popen[bytes]]:
    """A replica picker for several Envoys (each started with --picker 127.0.0.1:PORT),
    checking the replicas' health itself, once it accepts calls; its output to `log` if given,
    with more of its `options` (TLS)."""
    command = [sys.executable, "-m", "facade.picker.server", "--listen", f"127.0.0.1:{port}"]
    for upstream in upstreams:
        command += ["--upstream", upstream]
    command += options
    output = log.open("ab") if log else None
    picker = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT if log else None)
    try:
        deadline = time.monotonic() + timeout
        while not port_open(port):
            if picker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the shared picker did not start (exit code {picker.poll()})")
            time.sleep(0.2)
        yield picker
    finally:
        stop_helpers([picker])
        if output:
            output.close()


@dataclass
class HelperServer:
    """A server the tests need beside the stack (Redis, S3), run as a plain process on a
    loopback port."""

    port: int
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


Helper = TypeVar("Helper", bound=HelperServer)


def start_helper_server(
    kind: type[Helper],
    name: str,
    command: list[str],
    port: int,
    log: Path,
    ready: Callable[[Helper], bool],
    start_seconds: float,
) -> Helper:
    """`command` started (its output in `log`) as a `kind` on `port`, once `ready` says it
    serves; stopped, with an error naming `log`, if it exits or takes over `start_seconds`."""
    with log.open("ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server = kind(port, process)
    deadline = time.monotonic() + start_seconds
    while not ready(server):
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"{name} did not start on port {port}: {log}")
        time.sleep(0.05)
    return server


def stop_helpers(processes: Sequence[subprocess.Popen[bytes]]) -> None:
    """Stop a test's own Envoys and pickers, whose exit no test checks."""
    stop_processes(processes, timeout=HELPER_STOP_SECONDS)


@dataclass
class TestStack(Stack):
    service_log: Path | None = None  # the service's output goes here instead of the terminal
    source: Path | None = None  # run the code of this checkout (e.g. an older one) instead
    # Which of tests/engines.py's configurations this is: each start is counted against its
    # budget ("": not counted, for the benchmarks' stacks).
    engine: str = ""
    envoy_args: Sequence[str] = ()  # more of facade.launch's options

    __test__ = False  # a harness, not a test class

    @property
    def metrics_url(self) -> str:
        port = self.service_args[list(self.service_args).index("--metrics-port") + 1]
        return f"http://127.0.0.1:{port}/metrics"

    def start(self, with_envoy: bool = True) -> None:
        if self.engine:
            STARTS.record(self.engine)
        super().start(with_envoy)

    def envoy_command(self) -> list[str]:
        return [*super().envoy_command(), *self.envoy_args]

    def service_popen_options(self) -> dict[str, Any]:
        log = self.service_log.open("ab") if self.service_log else None
        return {
            "stdout": log,
            "stderr": subprocess.STDOUT if log else None,
            "cwd": self.source,  # `python -m` imports from the working directory first
        }

    @contextlib.contextmanager
    def running(self, timeout: float) -> Iterator[TestStack]:
        """Started and ready (the service SERVING, Envoy routing to it) until the block ends."""
        self.start()
        try:
            self.wait_ready(timeout)
            yield self
        finally:
            self.stop()

    def wait_ready_service(self, timeout: float) -> None:
        """Block until the service reports SERVING (for a stack without Envoy)."""
        self.wait_until(self.service_serving, timeout)


# What vLLM names its engine processes (the title it gives them, their name in /proc).
ENGINE_PROCESS_PREFIX = "VLLM::"


def is_engine(process: psutil.Process) -> bool:
    """Whether it is one of vLLM's engine processes (core, worker, frontend), by its title."""
    try:
        return process.name().startswith(ENGINE_PROCESS_PREFIX) or any(
            part.startswith(ENGINE_PROCESS_PREFIX) for part in process.cmdline()[:1]
        )
    except psutil.NoSuchProcess:
        return False


# /proc/PID/stat's flags: the kernel has begun the process's exit (PF_EXITING).
PF_EXITING = 0x4


def still_running(process: psutil.Process) -> bool:
    """Whether it may still run code: not gone, not a zombie, and not in the kernel's exit. (A
    killed engine worker's address space of several GiB took the kernel over 15 s to tear down
    on a host busy with the other shard, in disk-sleep, long after the process had ended for
    every other purpose.)"""
    try:
        if not process.is_running() or process.status() == psutil.STATUS_ZOMBIE:
            return False
        stat = Path(f"/proc/{process.pid}/stat").read_text()
    except (psutil.NoSuchProcess, OSError):
        return False
    flags = int(stat.rsplit(")", 1)[1].split()[6])
    return not flags & PF_EXITING


def left_running(processes: Sequence[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Those of `processes` still running `timeout` seconds from now (or as soon as none is)."""
    deadline = time.monotonic() + timeout
    while True:
        running = [process for process in processes if still_running(process)]
        if not running or time.monotonic() > deadline:
            return running
        time.sleep(0.2)


def thread_affinities(process: psutil.Process) -> list[set[int]]:
    """Each of the process's threads' CPU affinity (threads that ended meanwhile left out)."""
    found = []
    for thread in process.threads():
        try:
            found.append(os.sched_getaffinity(thread.id))
        except OSError:
            continue
    return found


@dataclass
class HealthWatch:
    """Every status a server's health Watch stream reports, from before it listens."""

    target: str
    statuses: list[int] = field(default_factory=list)
    done: threading.Event = field(default_factory=threading.Event)

    def start(self) -> HealthWatch:
        threading.Thread(target=self.run, daemon=True).start()
        return self

    def run(self) -> None:
        while not self.done.is_set():
            try:
                with grpc.insecure_channel(self.target) as channel:
                    stub = health_pb2_grpc.HealthStub(channel)
                    for reply in stub.Watch(health_pb2.HealthCheckRequest()):
                        self.statuses.append(reply.status)
            except grpc.RpcError:
                time.sleep(0.2)

    def wait_for(self, status: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while status not in self.statuses:
            assert time.monotonic() < deadline, f"health never reported {status}: {self.statuses}"
            time.sleep(0.1)
