"""An image's bytes, checked before they are decoded: inline (data: URL) payloads within the
byte cap, and the pixels an image declares in its header within the pixel cap, so that a small
file declaring 20000 x 20000 pixels is refused, not decoded into gigabytes."""

from __future__ import annotations

import binascii
import io
import warnings

import pybase64
from PIL import Image

from service.api.media.refusal import MediaRefusedError, megabytes, too_large


def data_url_bytes(url: str, max_bytes: int) -> bytes:
    """The payload of a base64 `data:` URL (RFC 2397), refused past `max_bytes` before it is
    decoded."""
    spec, comma, payload = url[len("data:") :].partition(",")
    if not comma:
        raise MediaRefusedError("the data: URL has no ',' before its payload")
    if spec.rpartition(";")[2].strip().lower() != "base64":
        raise MediaRefusedError("only base64 data: URLs are taken (data:image/png;base64,...)")
    if len(payload) * 3 // 4 > max_bytes + 2:  # base64's size before decoding, padding aside
        raise too_large(f"about {megabytes(len(payload) * 3 // 4)} inline", max_bytes)
    try:
        data = pybase64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as error:
        raise MediaRefusedError(f"the data: URL's payload is not valid base64: {error}") from error
    if len(data) > max_bytes:
        raise too_large(f"{megabytes(len(data))} inline", max_bytes)
    return data


def check_declared_pixels(data: bytes, max_pixels: int) -> None:
    """Refuse an image whose header declares more than `max_pixels` (width x height), or that
    is no image PIL can read, reading the header only."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as image:
                width, height = image.size
    except Image.DecompressionBombError:  # PIL's own bound, far above ours
        raise too_many_pixels("more than PIL's decompression bound of", max_pixels) from None
    except (OSError, ValueError, SyntaxError) as error:
        raise MediaRefusedError(
            f"the image could not be read ({type(error).__name__}): send a PNG, JPEG, WebP or "
            "GIF file"
        ) from error
    if width * height > max_pixels:
        raise too_many_pixels(f"{width} x {height}", max_pixels)


def too_many_pixels(what: str, max_pixels: int) -> MediaRefusedError:
    return MediaRefusedError(
        f"the image declares {what} pixels; at most {max_pixels:,} pixels per image (the "
        "server's --max-image-pixels): send a smaller image"
    )
