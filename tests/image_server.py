"""A loopback HTTP server of test images that counts what it was asked for: plain PNGs, a
redirect, a file over the tests' byte cap sent without a length, a PNG whose header declares
20000 x 20000 pixels, and a host too slow to answer. What the media fetcher asked of it shows
whether a refused URL was fetched."""

from __future__ import annotations

import base64
import contextlib
import io
import struct
import threading
import time
import zlib
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from PIL import Image

SIZE = (48, 40)
COLOURS = {"red": (220, 30, 30), "blue": (30, 30, 220), "green": (30, 200, 60)}
LARGE_BYTES = 2_000_000
BOMB_SIDE = 20_000
SLOW_SECONDS = 8.0


def png(colour: str, size: tuple[int, int] = SIZE) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, COLOURS[colour]).save(buffer, "PNG")
    return buffer.getvalue()


def data_url(image: bytes, mime_type: str = "image/png") -> str:
    return f"data:{mime_type};base64,{base64.b64encode(image).decode()}"


def pixel_bomb(side: int = BOMB_SIDE) -> bytes:
    """A small PNG whose header declares side x side pixels (its data is a 1x1 image's)."""
    tiny = png("red", (1, 1))
    # The IHDR chunk follows the 8-byte signature: length (4), type (4), then width, height.
    header = bytearray(tiny[12:29])  # type and data
    header[4:12] = struct.pack(">II", side, side)
    crc = struct.pack(">I", zlib.crc32(bytes(header)) & 0xFFFFFFFF)
    return tiny[:12] + bytes(header) + crc + tiny[33:]


class ImageServer:
    """Serves /red.png, /blue.png, /green.png, /redirect (to /red.png), /large.png, /bomb.png
    and /slow.png on 127.0.0.1; `hits` counts the requests of each path."""

    def __init__(self) -> None:
        self.hits: Counter[str] = Counter()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self.handler_class())
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"

    def count(self, path: str) -> int:
        with self.lock:
            return self.hits[path]

    def total(self) -> int:
        with self.lock:
            return sum(self.hits.values())

    def start(self) -> ImageServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def handler_class(self) -> type[BaseHTTPRequestHandler]:
        images = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                with images.lock:
                    images.hits[self.path] += 1
                name = self.path.strip("/").removesuffix(".png")
                if self.path == "/redirect":
                    self.send_response(302)
                    self.send_header("Location", "/red.png")
                    self.end_headers()
                elif self.path == "/large.png":
                    self.send_body(b"\x89PNG" + bytes(LARGE_BYTES), declare_length=False)
                elif self.path == "/bomb.png":
                    self.send_body(pixel_bomb())
                elif self.path == "/slow.png":
                    time.sleep(SLOW_SECONDS)
                    self.send_body(png("red"))
                elif name in COLOURS:
                    self.send_body(png(name))
                else:
                    self.send_error(404)

            def send_body(self, body: bytes, declare_length: bool = True) -> None:
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                if declare_length:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                # The fetcher may stop reading at its cap.
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                pass

        return Handler
