"""A real S3-compatible server for the tests, on loopback: moto's server mode (as s3fs's own
tests use it), from its venv (.venv/tools/moto, `make moto`), started as a plain process, with
the environment a client needs to reach it (credentials it accepts, AWS_ENDPOINT_URL)."""

from __future__ import annotations

import urllib.error
import urllib.request
from pathlib import Path

from tests.processes import HelperServer, free_port, start_helper_server

SERVER = Path(__file__).resolve().parents[1] / ".venv" / "tools" / "moto" / "bin" / "moto_server"
START_SECONDS = 30.0


class S3Server(HelperServer):
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

    def serves(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.endpoint}/moto-api/", timeout=2):
                return True
        except (urllib.error.URLError, ConnectionError):
            return False


def start_s3(log: Path) -> S3Server:
    if not SERVER.exists():
        raise RuntimeError(f"{SERVER} is missing: `make test` installs it (make moto)")
    port = free_port()
    command = [str(SERVER), "-H", "127.0.0.1", "-p", str(port)]
    return start_helper_server(
        S3Server, "the S3 server", command, port, log, S3Server.serves, START_SECONDS
    )
