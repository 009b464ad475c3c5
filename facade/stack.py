"""Run the whole stack: the gRPC completion service and Envoy in front of it.

`make serve` runs this. Ctrl-C (SIGINT) or SIGTERM stops both processes.

Usage: python -m facade.stack [service options...]   (see `python -m service serve --help`)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from facade.render import DEFAULT_ADMIN_PORT, DEFAULT_HTTP_PORT
from facade.tls import UpstreamTls, grpc_channel, upstream_tls_from_env
from plumbing.ports import DEFAULT_GRPC_PORT, frontend_ports

STOP_TIMEOUT_SECONDS = 40.0


def stop_processes(
    processes: Sequence[subprocess.Popen[bytes]], timeout: float = STOP_TIMEOUT_SECONDS
) -> None:
    """SIGTERM to each process still running, then SIGKILL to any still running `timeout`
    seconds later."""
    for process in processes:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    for process in processes:
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class StackError(RuntimeError):
    pass


@dataclass
class Stack:
    """The service and Envoy as child processes."""

    grpc_port: int = DEFAULT_GRPC_PORT
    http_port: int = DEFAULT_HTTP_PORT
    admin_port: int = DEFAULT_ADMIN_PORT
    service_args: Sequence[str] = ()
    env: dict[str, str] | None = None
    service_module: str = "service"  # run with `python -m`
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def upstream_targets(self) -> list[str]:
        """Where Envoy sends calls: the service's port, or with API_SERVER_COUNT > 1 each
        frontend's own port, so that Envoy balances streams over the frontends."""
        count = int(self.environment.get("API_SERVER_COUNT") or 1)
        if count <= 1:
            return [self.grpc_target]
        given = self.environment.get("FRONTEND_PORTS")
        ports = tuple(int(port) for port in given.split(",")) if given else ()
        return [f"127.0.0.1:{port}" for port in frontend_ports(self.grpc_port, count, ports)]

    @property
    def upstream_replica(self) -> str:
        """The replica as Envoy's launcher takes it: 127.0.0.1:PORT, or its frontends' ports
        as 127.0.0.1:PORT+PORT... (one replica: Envoy spreads streams over them by load)."""
        ports = [target.rpartition(":")[2] for target in self.upstream_targets]
        return f"127.0.0.1:{'+'.join(ports)}"

    @property
    def environment(self) -> dict[str, str]:
        return {**os.environ, **(self.env or {})}

    @property
    def base_url(self) -> str:
        scheme = "https" if self.environment.get("TLS_CERT_FILE") else "http"
        return f"{scheme}://127.0.0.1:{self.http_port}"

    @property
    def upstream_tls(self) -> UpstreamTls | None:
        """How Envoy, and the stack's own checks, reach the service."""
        try:
            return upstream_tls_from_env(self.environment)
        except argparse.ArgumentTypeError as error:
            raise StackError(f"UPSTREAM_*_FILE: {error}") from error

    def check_tls(self) -> None:
        """A service on TLS needs the CA that signed its certificate, for Envoy and the
        readiness checks to trust it."""
        serves_tls = bool(self.environment.get("TLS_CERT_FILE")) or any(
            arg.startswith("--tls-cert-file") for arg in self.service_args
        )
        if serves_tls and self.upstream_tls is None:
            raise StackError(
                "the service serves TLS: set UPSTREAM_CA_FILE to the CA certificate that "
                "signed its certificate (and UPSTREAM_CERT_FILE, UPSTREAM_KEY_FILE if it "
                "requires client certificates)"
            )

    def service_command(self) -> list[str]:
        return [sys.executable, "-m", self.service_module, "serve", "--port", str(self.grpc_port)]

    def envoy_command(self) -> list[str]:
        return [
            *(sys.executable, "-m", "facade.launch", "--upstream", self.upstream_replica),
            *("--http-port", str(self.http_port), "--admin-port", str(self.admin_port)),
            *self.tracing_args(),
        ]

    def tracing_args(self) -> list[str]:
        """The service's --otlp-traces-endpoint, for Envoy too (the environment variable
        reaches both by itself)."""
        for index, arg in enumerate(self.service_args):
            flag, equals, value = arg.partition("=")
            if flag == "--otlp-traces-endpoint":
                value = value if equals else next(iter(self.service_args[index + 1 :]), "")
                return [f"--otlp-traces-endpoint={value}"] if value else []
        return []

    def service_popen_options(self) -> dict[str, Any]:
        return {}

    def start(self, with_envoy: bool = True) -> None:
        """Start the service and, unless told not to, Envoy."""
        self.check_tls()
        env = self.environment
        self.processes = [
            subprocess.Popen(
                [*self.service_command(), *self.service_args],
                env=env,
                **self.service_popen_options(),
            )
        ]
        if with_envoy:
            self.processes.append(subprocess.Popen(self.envoy_command(), env=env))

    def wait_ready(self, timeout: float) -> None:
        """Block until the service reports SERVING and Envoy routes to it: Envoy sends no
        request to a replica before its own health check has seen it SERVING."""
        self.wait_until(
            lambda: self.service_serving() and self.envoy_ready() and self.upstream_healthy(),
            timeout,
        )

    def wait_until(self, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self.check_alive()
            if ready():
                return
            time.sleep(1.0)
        raise StackError(f"not ready within {timeout:.0f}s")

    def check_alive(self) -> None:
        for process in self.processes:
            if process.poll() is not None:
                raise StackError(f"{process.args[2]} exited with code {process.returncode}")

    def service_serving(self) -> bool:
        with grpc_channel(self.grpc_target, self.upstream_tls) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(), timeout=2)
            except grpc.RpcError:
                return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def envoy_ready(self) -> bool:
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.admin_port}/ready", timeout=2
            ) as reply:
                return reply.status == 200
        except OSError:
            return False

    def upstream_healthy(self) -> bool:
        """Envoy's health check has seen the service SERVING."""
        try:
            with urllib.request.urlopen(
                f"http://127.0.0.1:{self.admin_port}/clusters", timeout=2
            ) as reply:
                text = reply.read().decode()
        except OSError:
            return False
        return all(f"::{target}::health_flags::healthy" in text for target in self.upstream_targets)

    def stop(self) -> None:
        stop_processes(self.processes)

    def wait(self) -> int:
        """Until either process exits; the exit code of the first one that did."""
        while True:
            for process in self.processes:
                if process.poll() is not None:
                    return process.returncode
            time.sleep(0.5)


def interrupt(signum: int, frame: object) -> None:
    """SIGTERM stops the stack the way Ctrl-C does."""
    raise KeyboardInterrupt


def main() -> None:
    # Ports as the service and the launcher read them: from their environment variables.
    stack = Stack(
        grpc_port=int(os.environ.get("GRPC_PORT") or DEFAULT_GRPC_PORT),
        http_port=int(os.environ.get("HTTP_PORT") or DEFAULT_HTTP_PORT),
        admin_port=int(os.environ.get("ENVOY_ADMIN_PORT") or DEFAULT_ADMIN_PORT),
        service_args=sys.argv[1:],
    )
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)
    exit_code = 0
    try:
        stack.start()
        stack.wait_ready(timeout=900)
        print(
            f"ready: REST {stack.base_url}/v2/completions, gRPC {stack.grpc_target} (Ctrl-C stops)",
            flush=True,
        )
        exit_code = stack.wait()
    except KeyboardInterrupt:
        pass
    except StackError as error:
        print(f"stack failed: {error}", file=sys.stderr)
        exit_code = 1
    finally:
        with contextlib.suppress(KeyboardInterrupt):
            stack.stop()
    sys.exit(exit_code)


if __name__ == "__main__":
    main()
