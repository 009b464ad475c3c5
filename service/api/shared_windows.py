"""Tenants' windows kept in memory for all the frontend processes of one replica, so that
`memory://` stays exact with several (`--api-server-count`): the parent holds one `limits`
memory storage and serves it on a unix socket (multiprocessing's manager, with the authkey
every spawned frontend inherits); each frontend's limiter reaches it as the `limits` storage
of the scheme `frontends://PATH`."""

from __future__ import annotations

import asyncio
import functools
import threading
from multiprocessing.managers import BaseManager, BaseProxy
from typing import Any

from limits.aio.storage import Storage
from limits.storage import MemoryStorage

SCHEME = "frontends"


@functools.cache
def the_windows() -> MemoryStorage:
    """The windows this process holds for its frontends: one storage for every connection."""
    return MemoryStorage()


class WindowsManager(BaseManager):
    """Serves the parent's windows; connects a frontend to them."""


WindowsManager.register("windows", callable=the_windows)


class ServedWindows:
    """This process's windows, served on the unix socket `path` until closed: each frontend's
    connection handled in a daemon thread."""

    def __init__(self, path: str) -> None:
        self.server = WindowsManager(address=path).get_server()
        self.server.stop_event = threading.Event()  # each connection's thread serves until set
        threading.Thread(target=self.accept, name="tenant-windows", daemon=True).start()

    def accept(self) -> None:
        while True:
            try:
                connection = self.server.listener.accept()
            except OSError:  # closed
                return
            threading.Thread(
                target=self.server.handle_request, args=(connection,), daemon=True
            ).start()

    def close(self) -> None:
        """Stops accepting, and removes the socket."""
        self.server.stop_event.set()
        self.server.listener.close()


def store_url(path: str) -> str:
    """The limits store that frontends give their limiter to use the windows at `path`."""
    return f"{SCHEME}://{path}"


class FrontendsStorage(Storage):
    """The parent's windows, as an async `limits` storage: each call runs in a worker thread
    (a manager's proxy blocks, and keeps one connection per thread)."""

    STORAGE_SCHEME = [f"async+{SCHEME}"]  # noqa: RUF012 (limits' registry reads it so)

    def __init__(self, uri: str, wrap_exceptions: bool = False, **options: Any) -> None:
        super().__init__(uri, wrap_exceptions, **options)
        self.path = uri.split("://", 1)[1]
        self.proxy: BaseProxy | None = None
        self.connecting = threading.Lock()

    @property
    def base_exceptions(self) -> type[Exception] | tuple[type[Exception], ...]:
        return (OSError, EOFError)

    def windows(self) -> Any:
        with self.connecting:
            if self.proxy is None:
                manager = WindowsManager(address=self.path)
                manager.connect()
                self.proxy = manager.windows()  # type: ignore[attr-defined]
        return self.proxy

    async def call(self, method: str, *args: Any) -> Any:
        return await asyncio.to_thread(self.call_now, method, *args)

    def call_now(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self.windows(), method)(*args)
        except self.base_exceptions:
            self.proxy = None  # connect again on the next call
            raise

    async def incr(self, key: str, expiry: int, amount: int = 1) -> int:
        result: int = await self.call("incr", key, expiry, amount)
        return result

    async def get(self, key: str) -> int:
        result: int = await self.call("get", key)
        return result

    async def get_expiry(self, key: str) -> float:
        result: float = await self.call("get_expiry", key)
        return result

    async def check(self) -> bool:
        result: bool = await self.call("check")
        return result

    async def reset(self) -> int | None:
        result: int | None = await self.call("reset")
        return result

    async def clear(self, key: str) -> None:
        await self.call("clear", key)
