"""Run the whole stack: the gRPC completion service and Envoy in front of it.

`make serve` runs this; the tests start the same stack on free ports. Ctrl-C (SIGINT) or
SIGTERM stops both processes.

Usage: python -m facade.stack [service options...]   (see `python -m service serve --help`)
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

STOP_TIMEOUT_SECONDS = 40.0


def free_port() -> int:
    """A TCP port on loopback that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class StackError(RuntimeError):
    pass


@dataclass
class Stack:
    """The service and Envoy as child processes."""

    grpc_port: int = 50051
    http_port: int = 8080
    admin_port: int = 9901
    service_args: Sequence[str] = ()
    env: dict[str, str] | None = None
    service_log: Path | None = None  # the service's output goes here instead of the terminal
    source: Path | None = None  # run the code of this checkout (e.g. an older one) instead
    service_module: str = "service"  # `python -m` this to run the service
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def grpc_target(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def start(self, with_envoy: bool = True) -> None:
        """Start the service (its output to `service_log`) and, unless told not to, Envoy."""
        python = sys.executable
        env = {**os.environ, **(self.env or {})}
        service = [
            python,
            "-m",
            self.service_module,
            "serve",
            "--port",
            str(self.grpc_port),
            *self.service_args,
        ]
        envoy = [
            python,
            "-m",
            "facade.launch",
            "--http-port",
            str(self.http_port),
            "--admin-port",
            str(self.admin_port),
            "--upstream",
            self.grpc_target,
        ]
        log = self.service_log.open("ab") if self.service_log else None
        self.processes = [
            subprocess.Popen(
                service,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT if log else None,
                cwd=self.source,  # `python -m` imports from the working directory first
            )
        ]
        if with_envoy:
            self.processes.append(subprocess.Popen(envoy, env=env, cwd=self.source))

    def wait_ready(self, timeout: float) -> None:
        """Block until the service reports SERVING and Envoy is live."""
        self.wait_until(lambda: self.service_serving() and self.envoy_ready(), timeout)

    def wait_ready_service(self, timeout: float) -> None:
        """Block until the service reports SERVING (for a stack without Envoy)."""
        self.wait_until(self.service_serving, timeout)

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
        with grpc.insecure_channel(self.grpc_target) as channel:
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

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=STOP_TIMEOUT_SECONDS)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()

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
    stack = Stack(
        grpc_port=int(os.environ.get("GRPC_PORT", 50051)),
        http_port=int(os.environ.get("HTTP_PORT", 8080)),
        admin_port=int(os.environ.get("ENVOY_ADMIN_PORT", 9901)),
        service_args=sys.argv[1:],
    )
    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, interrupt)
    stack.start()
    exit_code = 0
    try:
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
