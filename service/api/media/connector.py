"""The media fetcher vLLM's chat renderer reads images through: a connector registered in
vLLM's media connector registry (selected by VLLM_MEDIA_CONNECTOR, which `use_guarded_fetcher`
sets), in place of vLLM's own, which fetches any address, follows redirects past its domain
allowlist, retries a dead host for minutes and reads up to 256 MB.

Every URL it is handed is a caller's: `data:` payloads within the byte cap, `http(s)` URLs to
hosts the operator allowed (else to public addresses only), one attempt within the timeout, no
redirect, and a declared pixel count within the cap before any image is decoded. `file:` and
every other scheme are refused (the operator's files are not the caller's to read). What it
loads is then vLLM's own media IO's, so a served image equals `vllm serve`'s."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from vllm.connections import HTTPConnection, global_http_connection
from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector
from vllm.multimodal.media.base import MediaIO
from vllm.multimodal.media.connector import global_thread_pool
from vllm.multimodal.media.image import ImageMediaIO

from service.api.media.addresses import HostRules
from service.api.media.download import DownloadBounds, download
from service.api.media.images import check_declared_pixels, data_url_bytes
from service.settings import MediaSettings

logger = logging.getLogger(__name__)

GUARDED_CONNECTOR = "llm-completions-guarded"
CONNECTOR_ENV = "VLLM_MEDIA_CONNECTOR"

_M = TypeVar("_M")
_T = TypeVar("_T")


@dataclass(frozen=True)
class FetchBounds:
    """What one image may cost: bytes read, pixels declared, seconds spent fetching."""

    max_bytes: int
    max_pixels: int
    timeout_seconds: float

    @classmethod
    def of(cls, settings: MediaSettings) -> FetchBounds:
        return cls(settings.max_bytes, settings.max_pixels, settings.fetch_timeout_seconds)


# This process's bounds: set by use_guarded_fetcher in each frontend process.
current_bounds = FetchBounds.of(MediaSettings())


def use_guarded_fetcher(settings: MediaSettings) -> None:
    """Make this process's chat rendering fetch media through GuardedMediaConnector, within
    `settings`' bounds (the processes vLLM starts inherit the selection)."""
    global current_bounds
    current_bounds = FetchBounds.of(settings)
    chosen = os.environ.get(CONNECTOR_ENV)
    if chosen not in (None, "", GUARDED_CONNECTOR):
        logger.warning(
            "%s=%s is not used: images are fetched by this server's guarded connector",
            CONNECTOR_ENV,
            chosen,
        )
    os.environ[CONNECTOR_ENV] = GUARDED_CONNECTOR


@MEDIA_CONNECTOR_REGISTRY.register(GUARDED_CONNECTOR)
class GuardedMediaConnector(MediaConnector):
    """vLLM's media connector, with every fetch bounded and confined (see the module)."""

    def __init__(
        self,
        media_io_kwargs: dict[str, dict[str, Any]] | None = None,
        connection: HTTPConnection = global_http_connection,
        *,
        allowed_local_media_path: str = "",  # never used: file: URLs are refused
        allowed_media_domains: list[str] | None = None,
    ) -> None:
        super().__init__(media_io_kwargs, connection, allowed_media_domains=allowed_media_domains)
        self.rules = HostRules.from_domains(allowed_media_domains)
        self.bounds = current_bounds

    async def read_bytes(self, url: str) -> bytes:
        """The bytes `url` names: inline, or downloaded within the rules and bounds."""
        if is_data_url(url):
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(
                global_thread_pool, data_url_bytes, url, self.bounds.max_bytes
            )
        return await self.download(url)

    async def download(self, url: str) -> bytes:
        bounds = DownloadBounds(self.bounds.max_bytes, self.bounds.timeout_seconds)
        return await download(url, self.rules, bounds)

    def load_checked(self, data: bytes, media_io: MediaIO[_M]) -> _M:
        if isinstance(media_io, ImageMediaIO):
            check_declared_pixels(data, self.bounds.max_pixels)
        return media_io.load_bytes(data)

    async def load_from_url_async(
        self, url: str, media_io: MediaIO[_M], *, fetch_timeout: int | None = None
    ) -> _M:
        data = await self.read_bytes(url)
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(global_thread_pool, self.load_checked, data, media_io)

    def load_from_url(
        self, url: str, media_io: MediaIO[_M], *, fetch_timeout: int | None = None
    ) -> _M:
        # vLLM's synchronous parsers: the same checks and download.
        if is_data_url(url):
            data = data_url_bytes(url, self.bounds.max_bytes)
        else:
            data = run_to_end(self.download(url))
        return self.load_checked(data, media_io)


def is_data_url(url: str) -> bool:
    return url[:5].lower() == "data:"


def run_to_end(work: Coroutine[Any, Any, _T]) -> _T:
    """A coroutine's result, from synchronous code: on a loop of its own, in a thread of its
    own where this thread runs a loop already."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(asyncio.run, work).result()
