"""One bounded download of a caller's media URL: http or https only, to a host the rules
allow, one attempt within a total timeout, no redirect followed, and no more than the byte cap
read (checked while the body streams in, not after)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from http import HTTPStatus

import aiohttp
from urllib3.util import parse_url

from service.api.media.addresses import HostRules, PublicOnlyResolver
from service.api.media.refusal import MediaRefusedError, megabytes, too_large

SCHEMES = ("http", "https")
CHUNK_BYTES = 64 * 1024
HEADERS = {"Accept": "image/*", "User-Agent": "llm-completions-media-fetcher"}


@dataclass(frozen=True)
class DownloadBounds:
    max_bytes: int
    timeout_seconds: float


def checked_url(url: str, rules: HostRules) -> str:
    """The URL, if its scheme and host may be fetched at all (before any connection)."""
    try:
        parts = parse_url(url)
    except ValueError as error:
        raise MediaRefusedError(f"the image URL is not a valid URL: {error}") from error
    scheme = (parts.scheme or "").lower()
    if scheme not in SCHEMES:
        raise MediaRefusedError(
            f"image URLs must be data:, http: or https:, not {scheme or 'schemeless'!r}"
        )
    if not parts.host:
        raise MediaRefusedError("the image URL names no host")
    rules.check_host(parts.host)
    return url


async def download(url: str, rules: HostRules, bounds: DownloadBounds) -> bytes:
    """The body at `url`, or MediaRefusedError saying why not; never more than the cap."""
    checked_url(url, rules)
    timeout = aiohttp.ClientTimeout(total=bounds.timeout_seconds)
    # A fresh lookup for each connection (no cache), and no proxy from the environment: a
    # proxy would connect to addresses nobody checked.
    connector = aiohttp.TCPConnector(
        resolver=PublicOnlyResolver(rules), use_dns_cache=False, force_close=True
    )
    try:
        async with (
            aiohttp.ClientSession(
                connector=connector, timeout=timeout, trust_env=False, headers=HEADERS
            ) as session,
            session.get(url, allow_redirects=False) as response,
        ):
            check_status(response)
            return await read_capped(response, bounds.max_bytes)
    except MediaRefusedError:
        raise
    except asyncio.TimeoutError as error:
        raise MediaRefusedError(
            f"the image's host did not send it within {bounds.timeout_seconds:g} s "
            "(the server's --media-fetch-timeout): send it inline as a data: URL"
        ) from error
    except aiohttp.ClientConnectorError as error:
        raise MediaRefusedError(
            f"could not connect to the image's host {error.host}:{error.port}: "
            f"{error.os_error.strerror or error.os_error}"
        ) from error
    except aiohttp.ClientError as error:
        raise MediaRefusedError(f"fetching the image failed: {error}") from error


def check_status(response: aiohttp.ClientResponse) -> None:
    status = response.status
    if 300 <= status < 400:
        raise MediaRefusedError(
            f"the image URL answered with a redirect (HTTP {status}); redirects are not "
            "followed: give the image's final URL"
        )
    if status >= 400:
        raise MediaRefusedError(f"the image URL answered HTTP {status} {phrase(status)}".rstrip())


def phrase(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""


async def read_capped(response: aiohttp.ClientResponse, max_bytes: int) -> bytes:
    declared = response.content_length
    if declared is not None and declared > max_bytes:
        raise too_large(f"{megabytes(declared)} declared", max_bytes)
    body = bytearray()
    async for chunk in response.content.iter_chunked(CHUNK_BYTES):
        body += chunk
        if len(body) > max_bytes:
            raise too_large(f"over {megabytes(max_bytes)} sent", max_bytes)
    return bytes(body)
