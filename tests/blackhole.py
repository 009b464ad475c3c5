"""A TCP relay on loopback that can go silent: after `cut()` it neither forwards nor reads a
byte in either direction, yet keeps both sockets open. To the server behind it, the caller has
vanished without closing (a crashed host, a dropped route): no FIN, no RST, no answers."""

from __future__ import annotations

import contextlib
import selectors
import socket
import threading
from collections.abc import Iterator

CHUNK = 65536


class Blackhole:
    def __init__(self, upstream: tuple[str, int]) -> None:
        self._upstream = upstream
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._cut = threading.Event()
        self._stopped = threading.Event()
        self._sockets: list[socket.socket] = [self._listener]
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def cut(self) -> None:
        self._cut.set()

    def close(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=5)
        for sock in self._sockets:
            sock.close()

    def _run(self) -> None:
        selector = selectors.DefaultSelector()
        selector.register(self._listener, selectors.EVENT_READ)
        peers: dict[socket.socket, socket.socket] = {}
        while not self._stopped.is_set():
            if self._cut.is_set():
                self._stopped.wait(0.1)  # silent: read nothing, send nothing, close nothing
                continue
            for key, _ in selector.select(timeout=0.1):
                sock = key.fileobj
                assert isinstance(sock, socket.socket)
                if sock is self._listener:
                    caller, _ = self._listener.accept()
                    server = socket.create_connection(self._upstream)
                    self._sockets += [caller, server]
                    peers[caller], peers[server] = server, caller
                    selector.register(caller, selectors.EVENT_READ)
                    selector.register(server, selectors.EVENT_READ)
                    continue
                data = sock.recv(CHUNK)
                if not data:  # one side closed: so does the other
                    selector.unregister(sock)
                    with contextlib.suppress(OSError):
                        peers[sock].shutdown(socket.SHUT_WR)
                    continue
                peers[sock].sendall(data)


@contextlib.contextmanager
def blackhole(upstream: tuple[str, int]) -> Iterator[Blackhole]:
    relay = Blackhole(upstream)
    try:
        yield relay
    finally:
        relay.close()
