"""The one error the media fetcher raises: the caller's URL or image, refused."""

from __future__ import annotations

from vllm.exceptions import VLLMUnprocessableEntityError

# vLLM's name for the field, as its own fetcher reports it.
IMAGE_URL_PARAMETER = "image_url"


class MediaRefusedError(VLLMUnprocessableEntityError):
    """A media URL or payload refused before (or while) it was read: a client error, which the
    API answers with 422 naming the field and the message, which says what to change."""

    def __init__(self, message: str) -> None:
        super().__init__(message, parameter=IMAGE_URL_PARAMETER)


def megabytes(count: int) -> str:
    return f"{count / 1e6:.3g} MB"


def too_large(what: str, max_bytes: int) -> MediaRefusedError:
    return MediaRefusedError(
        f"the image is too large ({what}); at most {megabytes(max_bytes)} per image (the "
        "server's --max-media-bytes): send a smaller or more compressed image"
    )
