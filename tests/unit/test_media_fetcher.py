"""service/api/media: the fetcher for images in chat messages never lets a caller point the
server at the operator's own network. Checked here: which addresses count as public (IPv4-mapped,
NAT64 and 6to4 forms included), the host rules and the resolver that enforce them, bounded
downloads from a real loopback HTTP server (nothing reaches it unless the operator allowed the
host; no redirect, oversized body, slow or dead host gets through; the environment's proxy is
ignored), data: URL and declared-pixel bounds, the connector vLLM's renderer loads, the checks
on a request's media parts, and the option converters and engine arguments behind them.

No traffic leaves loopback: name lookups other than `localhost` and address literals are
answered "unknown name" here (as DNS answers for `.invalid`) instead of being sent out."""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import io
import ipaddress
import os
import socket
import struct
import threading
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from aiohttp.abc import ResolveResult
from google.protobuf import json_format
from llmcompletions.v2.completions_pb2 import ChatMessage
from PIL import Image
from vllm.exceptions import VLLMClientError
from vllm.multimodal.inputs import PlaceholderRange
from vllm.multimodal.media import MEDIA_CONNECTOR_REGISTRY, MediaConnector
from vllm.multimodal.media.image import ImageMediaIO

from service.api.errors import FieldViolation
from service.api.media import connector as connector_module
from service.api.media.addresses import HostRules, PublicOnlyResolver, is_public
from service.api.media.connector import (
    CONNECTOR_ENV,
    GUARDED_CONNECTOR,
    FetchBounds,
    GuardedMediaConnector,
    use_guarded_fetcher,
)
from service.api.media.download import DownloadBounds, download
from service.api.media.images import check_declared_pixels, data_url_bytes
from service.api.media.parts import MediaPolicy, check_media, image_counts, message_content
from service.api.media.refusal import MediaRefusedError
from service.api.validation import Violations
from service.model.engine import media_args
from service.options import host_names, items_per_prompt
from service.settings import EngineSettings, MediaSettings

IMAGE_SIZE = (20, 20)
CAP = 1000  # bytes, for the oversized-body downloads
SLOW_SECONDS = 5.0
BOUNDS = DownloadBounds(max_bytes=1_000_000, timeout_seconds=3.0)
LOOPBACK_ONLY = HostRules.from_domains(["127.0.0.1"])
VLM = MediaPolicy(takes_media=True, images_per_prompt=2, rules=HostRules())
REAL_GETADDRINFO = socket.getaddrinfo


def png_bytes(size: tuple[int, int] = IMAGE_SIZE) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buffer, format="PNG")
    return buffer.getvalue()


PNG = png_bytes()
DATA_URL = "data:image/png;base64," + base64.b64encode(PNG).decode("ascii")


def declaring(width: int, height: int) -> bytes:
    """A real 1x1 PNG whose IHDR claims width x height (with a valid CRC): a tiny file that
    would decode into width x height pixels."""
    data = bytearray(png_bytes((1, 1)))
    assert data[12:16] == b"IHDR"
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


def refusal(work: Callable[[], Any]) -> MediaRefusedError:
    """The MediaRefusedError `work` raises (any other outcome fails the test)."""
    with pytest.raises(MediaRefusedError) as caught:
        work()
    assert isinstance(caught.value, VLLMClientError)
    return caught.value


def message(error: BaseException) -> str:
    return str(error.args[0])


# --- a loopback HTTP server that counts what it was asked for --------------------------------


@dataclass
class Loopback:
    port: int
    requests: Counter[str]
    release: threading.Event

    def url(self, path: str, host: str = "127.0.0.1") -> str:
        return f"http://{host}:{self.port}{path}"


@pytest.fixture(autouse=True)
def no_outside_lookups(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only `localhost` and address literals are looked up; every other name is unknown."""

    def getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        name = host.decode() if isinstance(host, bytes) else host
        if name not in (None, "localhost"):
            try:
                ipaddress.ip_address(str(name).strip("[]").split("%")[0])
            except ValueError:
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known") from None
        return REAL_GETADDRINFO(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)


@pytest.fixture
def loopback() -> Iterator[Loopback]:
    requests: Counter[str] = Counter()
    release = threading.Event()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.0"  # the connection closes after each response

        def do_GET(self) -> None:
            requests[self.path] += 1
            # The client may stop reading, as it should for an oversized body.
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.answer()

        def answer(self) -> None:
            if self.path == "/x.png":
                self.send(200, PNG, content_length=True)
            elif self.path == "/redirect":
                self.send_response(302)
                self.send_header("Location", "/target.png")
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/target.png":
                self.send(200, PNG, content_length=True)
            elif self.path == "/unsized":
                # More than the cap with no Content-Length, then nothing until released: a
                # client that reads to the end before counting would wait for its timeout.
                self.send(200, b"\0" * (CAP + 4000), content_length=False)
                release.wait(SLOW_SECONDS)
            elif self.path == "/declared":
                self.send_response(200)
                self.send_header("Content-Length", str(CAP * 100))
                self.end_headers()
                self.wfile.write(b"\0" * 100)
                self.wfile.flush()
                release.wait(SLOW_SECONDS)
            elif self.path == "/slow":
                release.wait(SLOW_SECONDS)
                self.send(200, PNG, content_length=True)
            else:
                self.send(404, b"not here", content_length=True)

        def send(self, status: int, body: bytes, *, content_length: bool) -> None:
            self.send_response(status)
            self.send_header("Content-Type", "image/png")
            if content_length:
                self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            self.wfile.flush()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.02,), daemon=True)
    thread.start()
    try:
        yield Loopback(server.server_address[1], requests, release)
    finally:
        release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


def fetch(url: str, rules: HostRules, bounds: DownloadBounds = BOUNDS) -> bytes:
    return asyncio.run(download(url, rules, bounds))


def closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- which addresses are public --------------------------------------------------------------


@pytest.mark.parametrize(
    "address",
    [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",  # cloud metadata
        "100.64.0.1",  # carrier-grade NAT
        "0.0.0.0",
        "224.0.0.1",  # multicast
        "255.255.255.255",
        "::1",
        "fe80::1",
        "fc00::1",
        "fd12::1",
        "::ffff:127.0.0.1",  # IPv4-mapped
        "::ffff:10.0.0.1",
        "64:ff9b::a00:1",  # NAT64 of 10.0.0.1
        "64:ff9b::7f00:1",  # NAT64 of 127.0.0.1
        "2002:7f00:1::",  # 6to4 of 127.0.0.1
        "::7f00:1",  # IPv4-compatible (deprecated) form of 127.0.0.1
        "fec0::1",  # site-local (deprecated)
        "ff02::1",
    ],
)
def test_internal_and_special_addresses_are_not_public(address: str) -> None:
    assert is_public(ipaddress.ip_address(address)) is False


@pytest.mark.parametrize(
    "address",
    [
        "8.8.8.8",
        "1.1.1.1",
        "2606:4700:4700::1111",
        "::ffff:8.8.8.8",
        "64:ff9b::808:808",  # NAT64 of 8.8.8.8
        "2002:808:808::",  # 6to4 of 8.8.8.8
    ],
)
def test_globally_routable_addresses_are_public(address: str) -> None:
    assert is_public(ipaddress.ip_address(address)) is True


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "10.0.0.7",
        "169.254.169.254",
        "[::1]",
        "::1",
        "127.1",
        "2130706433",
        "0177.0.0.1",
    ],
)
def test_private_address_literals_are_refused_without_an_allowlist(host: str) -> None:
    error = refusal(lambda: HostRules().check_host(host))
    assert "not a public address" in message(error)


@pytest.mark.parametrize("host", ["8.8.8.8", "[2606:4700:4700::1111]", "images.example.com"])
def test_public_literals_and_names_pass_the_host_check(host: str) -> None:
    HostRules().check_host(host)  # names are checked when they are resolved


@pytest.mark.parametrize("host", ["8.8.8.8", "localhost", "other.example.com", "10.0.0.7"])
def test_a_host_off_the_allowlist_is_refused_whatever_it_is(host: str) -> None:
    rules = HostRules.from_domains(["images.example.com"])
    error = refusal(lambda: rules.check_host(host))
    assert "images.example.com" in message(error) and "--allowed-media-domains" in message(error)


@pytest.mark.parametrize(
    "host", ["images.internal", "IMAGES.Internal", "images.internal.", "10.0.0.7"]
)
def test_a_host_on_the_allowlist_passes_even_if_private(host: str) -> None:
    HostRules.from_domains(["Images.Internal.", "10.0.0.7"]).check_host(host)


# --- the resolver the download connects through ----------------------------------------------


def resolve(host: str, rules: HostRules) -> list[ResolveResult]:
    """The resolver's answer, made and asked on a loop as the download's connector does."""

    async def lookup() -> list[ResolveResult]:
        resolver = PublicOnlyResolver(rules)
        try:
            return await resolver.resolve(host, 80)
        finally:
            await resolver.close()

    return asyncio.run(lookup())


def test_resolver_refuses_localhost_naming_its_address() -> None:
    error = refusal(lambda: resolve("localhost", HostRules()))
    assert "127.0.0.1" in message(error)


def test_resolver_returns_an_allowed_names_addresses_even_if_private() -> None:
    results = resolve("localhost", HostRules.from_domains(["localhost"]))
    assert results and {result["host"] for result in results} <= {"127.0.0.1", "::1"}


def test_resolver_turns_an_unknown_name_into_a_refusal_not_an_os_error() -> None:
    error = refusal(lambda: resolve("no-such-host.invalid", HostRules()))
    assert "could not be resolved" in message(error)


# --- downloads from a real loopback server ---------------------------------------------------


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "127.1", "[::ffff:127.0.0.1]"])
def test_loopback_is_refused_without_an_allowlist_and_sees_no_request(
    loopback: Loopback, host: str
) -> None:
    refusal(lambda: fetch(loopback.url("/x.png", host), HostRules()))
    assert sum(loopback.requests.values()) == 0


def test_an_allowed_loopback_address_is_downloaded(loopback: Loopback) -> None:
    assert fetch(loopback.url("/x.png"), LOOPBACK_ONLY) == PNG
    assert loopback.requests["/x.png"] == 1


def test_localhost_is_refused_when_only_its_address_is_allowed(loopback: Loopback) -> None:
    error = refusal(lambda: fetch(loopback.url("/x.png", "localhost"), LOOPBACK_ONLY))
    assert "'localhost' is not one of them" in message(error)
    assert sum(loopback.requests.values()) == 0


def test_a_redirect_is_refused_and_its_target_never_requested(loopback: Loopback) -> None:
    error = refusal(lambda: fetch(loopback.url("/redirect"), LOOPBACK_ONLY))
    assert "redirect (HTTP 302)" in message(error)
    assert loopback.requests["/redirect"] == 1
    assert loopback.requests["/target.png"] == 0


def test_a_body_over_the_cap_without_content_length_is_refused_as_it_streams(
    loopback: Loopback,
) -> None:
    started = time.monotonic()
    error = refusal(
        lambda: fetch(loopback.url("/unsized"), LOOPBACK_ONLY, DownloadBounds(CAP, 3.0))
    )
    assert "too large" in message(error)
    assert time.monotonic() - started < 2.0  # not after waiting for the end of the body


def test_a_declared_content_length_over_the_cap_is_refused(loopback: Loopback) -> None:
    started = time.monotonic()
    error = refusal(
        lambda: fetch(loopback.url("/declared"), LOOPBACK_ONLY, DownloadBounds(CAP, 3.0))
    )
    assert "declared" in message(error) and "too large" in message(error)
    assert time.monotonic() - started < 2.0


def test_a_host_that_does_not_answer_is_refused_within_the_timeout(loopback: Loopback) -> None:
    started = time.monotonic()
    error = refusal(lambda: fetch(loopback.url("/slow"), LOOPBACK_ONLY, DownloadBounds(CAP, 1.0)))
    assert time.monotonic() - started < 3.0
    assert "did not send it within 1 s" in message(error)


def test_a_closed_port_is_refused_quickly_saying_it_could_not_connect() -> None:
    started = time.monotonic()
    error = refusal(lambda: fetch(f"http://127.0.0.1:{closed_port()}/x.png", LOOPBACK_ONLY))
    assert time.monotonic() - started < 2.0
    assert "could not connect" in message(error)


@pytest.mark.parametrize(
    "url", ["file:///etc/passwd", "ftp://x/y", "gopher://127.0.0.1:70/_GET", "x.png", "//x/y.png"]
)
def test_schemes_other_than_http_are_refused_before_anything(url: str) -> None:
    error = refusal(lambda: fetch(url, HostRules()))
    assert "data:, http: or https:" in message(error)


def test_an_http_error_status_is_refused_naming_it(loopback: Loopback) -> None:
    error = refusal(lambda: fetch(loopback.url("/missing.png"), LOOPBACK_ONLY))
    assert "404" in message(error)


def test_the_environments_proxy_is_not_used(
    loopback: Loopback, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name in ("HTTP_PROXY", "http_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.setenv(name, "http://127.0.0.1:1")
    for name in ("NO_PROXY", "no_proxy"):
        monkeypatch.delenv(name, raising=False)
    assert fetch(loopback.url("/x.png"), LOOPBACK_ONLY) == PNG
    assert loopback.requests["/x.png"] == 1


# --- data: URLs and declared pixels ----------------------------------------------------------


def test_a_base64_data_url_is_decoded() -> None:
    assert data_url_bytes(DATA_URL, len(PNG)) == PNG


def test_a_data_url_over_the_cap_is_refused_before_decoding() -> None:
    huge = "data:image/png;base64," + "!" * 4_000_000  # not even base64: never decoded
    assert "too large" in message(refusal(lambda: data_url_bytes(huge, 1_000_000)))
    assert "too large" in message(refusal(lambda: data_url_bytes(DATA_URL, len(PNG) - 10)))


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("data:text/plain,hello", "only base64"),
        ("data:image/png;base64,not*base64!", "not valid base64"),
        ("data:image/png;base64", "no ','"),
    ],
)
def test_a_malformed_data_url_is_refused(url: str, says: str) -> None:
    assert says in message(refusal(lambda: data_url_bytes(url, 1_000_000)))


@pytest.mark.parametrize(("width", "height"), [(20000, 20000), (5000, 5000)])
def test_an_image_declaring_too_many_pixels_is_refused_from_its_header(
    width: int, height: int
) -> None:
    bomb = declaring(width, height)
    assert len(bomb) < 200
    error = refusal(lambda: check_declared_pixels(bomb, 4096 * 4096))
    assert "--max-image-pixels" in message(error)


def test_the_pixel_cap_is_width_times_height() -> None:
    refusal(lambda: check_declared_pixels(PNG, 100))
    check_declared_pixels(PNG, 400)


def test_bytes_that_are_no_image_are_refused() -> None:
    assert "could not be read" in message(refusal(lambda: check_declared_pixels(b"GIF", 400)))


# --- the connector vLLM's renderer uses ------------------------------------------------------


def test_the_connector_loads_a_data_url_and_an_allowed_http_url(loopback: Loopback) -> None:
    connector = GuardedMediaConnector(allowed_media_domains=["127.0.0.1"])
    for url in (DATA_URL, loopback.url("/x.png")):
        loaded = asyncio.run(connector.load_from_url_async(url, ImageMediaIO()))
        assert loaded.media.size == IMAGE_SIZE


def test_the_connector_refuses_file_urls_that_vllms_own_would_read(tmp_path: Path) -> None:
    image = tmp_path / "x.png"
    image.write_bytes(PNG)
    url = image.as_uri()
    vllms = MediaConnector(allowed_local_media_path=str(tmp_path))
    assert vllms.load_from_url(url, ImageMediaIO()).media.size == IMAGE_SIZE
    guarded = GuardedMediaConnector(allowed_local_media_path=str(tmp_path))
    refusal(lambda: asyncio.run(guarded.load_from_url_async(url, ImageMediaIO())))
    refusal(lambda: guarded.load_from_url(url, ImageMediaIO()))


def test_the_connector_refuses_loopback_unless_allowed(loopback: Loopback) -> None:
    connector = GuardedMediaConnector()
    refusal(lambda: connector.load_from_url(loopback.url("/x.png"), ImageMediaIO()))
    refusal(
        lambda: asyncio.run(connector.load_from_url_async(loopback.url("/x.png"), ImageMediaIO()))
    )
    assert sum(loopback.requests.values()) == 0


def test_the_sync_load_works_from_sync_code_and_inside_a_running_loop(loopback: Loopback) -> None:
    connector = GuardedMediaConnector(allowed_media_domains=["127.0.0.1"])
    url = loopback.url("/x.png")
    for source in (DATA_URL, url):
        assert connector.load_from_url(source, ImageMediaIO()).media.size == IMAGE_SIZE

    async def inside_a_loop() -> list[tuple[int, int]]:
        return [
            connector.load_from_url(source, ImageMediaIO()).media.size for source in (DATA_URL, url)
        ]

    assert asyncio.run(inside_a_loop()) == [IMAGE_SIZE, IMAGE_SIZE]
    assert loopback.requests["/x.png"] == 2


def test_use_guarded_fetcher_selects_the_connector_and_its_bounds(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(CONNECTOR_ENV, "http")
    monkeypatch.setattr(connector_module, "current_bounds", connector_module.current_bounds)
    use_guarded_fetcher(MediaSettings(max_bytes=50_000, max_pixels=100, fetch_timeout_seconds=2.5))
    assert os.environ[CONNECTOR_ENV] == GUARDED_CONNECTOR
    connector = GuardedMediaConnector()
    assert connector.bounds == FetchBounds(max_bytes=50_000, max_pixels=100, timeout_seconds=2.5)
    error = refusal(lambda: connector.load_from_url(DATA_URL, ImageMediaIO()))  # 400 pixels
    assert "--max-image-pixels" in message(error)


def test_vllms_registry_loads_the_guarded_connector() -> None:
    loaded = MEDIA_CONNECTOR_REGISTRY.load(
        GUARDED_CONNECTOR,
        media_io_kwargs=None,
        allowed_local_media_path="",
        allowed_media_domains=None,
    )
    assert isinstance(loaded, GuardedMediaConnector)
    assert loaded.rules == HostRules()


# --- a request's media parts -----------------------------------------------------------------


def messages(*dicts: dict[str, Any]) -> list[ChatMessage]:
    return [json_format.ParseDict(each, ChatMessage()) for each in dicts]


def image_part(url: str, **extra: Any) -> dict[str, Any]:
    return {"type": "image_url", "image_url": {"url": url}, **extra}


def violations(conversation: list[ChatMessage], policy: MediaPolicy) -> list[FieldViolation]:
    found = Violations()
    check_media(conversation, "tiny-vlm", policy, found)
    return found.items


def test_an_image_for_a_text_only_model_is_a_violation_naming_the_model() -> None:
    text_only = MediaPolicy(takes_media=False, images_per_prompt=0, rules=HostRules())
    conversation = messages(
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "What?"}, image_part(DATA_URL)]},
    )
    [violation] = violations(conversation, text_only)
    assert violation.loc == ("messages", 1, "content", 1)
    assert "'tiny-vlm'" in violation.msg and "text only" in violation.msg


def test_images_past_the_limit_are_one_violation_at_the_first_extra() -> None:
    conversation = messages({"role": "user", "content": [image_part(DATA_URL)] * 3})
    [violation] = violations(conversation, VLM)
    assert violation.loc == ("messages", 0, "content", 2)
    assert "at most 2 images" in violation.msg
    four = messages({"role": "user", "content": [image_part(DATA_URL)] * 4})
    assert [v.loc for v in violations(four, VLM)] == [("messages", 0, "content", 2)]
    two = messages({"role": "user", "content": [image_part(DATA_URL)] * 2})
    assert violations(two, VLM) == []


def test_a_caller_chosen_uuid_is_a_violation() -> None:
    conversation = messages({"role": "user", "content": [image_part(DATA_URL, uuid="mine")]})
    [violation] = violations(conversation, VLM)
    assert violation.loc == ("messages", 0, "content", 0, "uuid")


@pytest.mark.parametrize(
    ("url", "rules"),
    [
        ("http://127.0.0.1/x.png", HostRules()),
        ("http://[::1]/x.png", HostRules()),
        ("http://169.254.169.254/latest/meta-data", HostRules()),
        ("https://other.example.com/x.png", HostRules.from_domains(["images.example.com"])),
        ("file:///etc/passwd", HostRules()),
    ],
)
def test_an_image_url_the_fetcher_would_refuse_is_a_violation(url: str, rules: HostRules) -> None:
    policy = MediaPolicy(takes_media=True, images_per_prompt=2, rules=rules)
    [violation] = violations(messages({"role": "user", "content": [image_part(url)]}), policy)
    assert violation.loc == ("messages", 0, "content", 0, "image_url")


def test_data_urls_and_allowed_hosts_are_no_violation() -> None:
    policy = MediaPolicy(True, 2, HostRules.from_domains(["images.example.com"]))
    conversation = messages(
        {
            "role": "user",
            "content": [image_part(DATA_URL), image_part("https://images.example.com/a.png")],
        }
    )
    assert violations(conversation, policy) == []


def test_content_and_parts_together_are_a_violation() -> None:
    conversation = messages({"role": "user", "content": "Hi", "parts": [{"text": "Hi"}]})
    assert [v.loc for v in violations(conversation, VLM)] == [("messages", 0, "parts")]


def test_typed_image_parts_count_as_images_located_under_parts() -> None:
    encoded = base64.b64encode(PNG).decode("ascii")
    typed = {"image": {"data": encoded, "mime_type": "image/png"}}
    conversation = messages({"role": "user", "parts": [{"text": "Look"}, typed, typed, typed]})
    [violation] = violations(conversation, VLM)
    assert violation.loc == ("messages", 0, "parts", 3)
    assert "at most 2 images" in violation.msg


def test_message_content_turns_typed_parts_into_vllms_content_parts() -> None:
    encoded = base64.b64encode(PNG).decode("ascii")
    [typed] = messages(
        {
            "role": "user",
            "parts": [{"text": "Look"}, {"image": {"data": encoded, "mime_type": "image/png"}}],
        }
    )
    text, image = message_content(typed)
    assert text == {"type": "text", "text": "Look"}
    assert image["type"] == "image_url"
    prefix, _, payload = image["image_url"]["url"].partition(",")
    assert prefix == "data:image/png;base64"
    assert base64.b64decode(payload) == PNG


def test_image_counts_are_images_and_their_placeholder_tokens() -> None:
    placeholders = [PlaceholderRange(offset=0, length=7), PlaceholderRange(offset=9, length=5)]
    assert image_counts({"mm_placeholders": {"image": placeholders}}) == (2, 12)
    assert image_counts({"prompt_token_ids": [1, 2, 3]}) == (0, 0)


# --- options and engine arguments ------------------------------------------------------------


def test_host_names_are_split_on_commas() -> None:
    assert host_names("images.example.com, 10.0.0.7") == ("images.example.com", "10.0.0.7")


@pytest.mark.parametrize("text", ["http://x.com", "x.com:8080", "x.com/a"])
def test_host_names_refuse_schemes_ports_and_paths(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        host_names(text)


def test_items_per_prompt_takes_counts_by_modality() -> None:
    assert items_per_prompt('{"image": 2}') == {"image": 2}


@pytest.mark.parametrize("text", ['{"image": -1}', '{"image": "2"}', "[1]"])
def test_items_per_prompt_refuses_what_is_not_a_count(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError):
        items_per_prompt(text)


def test_media_args_carry_the_image_limit_and_the_allowlist() -> None:
    defaults = media_args(EngineSettings(None, "m"))
    assert defaults["limit_mm_per_prompt"] == {"image": 8}
    assert "allowed_media_domains" not in defaults
    allowed = media_args(EngineSettings(None, "m", allowed_media_domains=("a",)))
    assert allowed["allowed_media_domains"] == ["a"]
