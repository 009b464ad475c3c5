"""A real S3-compatible server for the tests, on loopback: moto's server mode (as s3fs's own
tests use it), from its venv (.venv/tools/moto, `make moto`), started as a plain process, with
the environment a client needs to reach it (credentials it accepts, AWS_ENDPOINT_URL)."""

from __future__ import annotations

import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from tests.processes import free_port

SERVER = Path(__file__).resolve().parents[1] / ".venv" / "tools" / "moto" / "bin" / "moto_server"
START_SECONDS = 30.0


@dataclass
class S3Server:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def client_environment(self) -> dict[str, str]:
        return {
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ACCESS_KEY_ID": "test",
            "AWS_SECRET_ACCESS_KEY": "test",
            "AWS_DEFAULT_REGION": "us-east-1",
        }

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def start_s3(log: Path) -> S3Server:
    if not SERVER.exists():
        raise RuntimeError(f"{SERVER} is missing: `make test` installs it (make moto)")
    port = free_port()
    with log.open("ab") as out:
        command = [str(SERVER), "-H", "127.0.0.1", "-p", str(port)]
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server = S3Server(port, process)
    deadline = time.monotonic() + START_SECONDS
    while True:
        try:
            with urllib.request.urlopen(f"{server.endpoint}/moto-api/", timeout=2):
                return server
        except (urllib.error.URLError, ConnectionError):
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"the S3 server did not start on port {port}: {log}")
        time.sleep(0.1)
