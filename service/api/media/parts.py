"""A chat request's media parts, checked before anything is fetched: only for a model that
takes them, no more images than a prompt may hold, URLs with a scheme and host the fetcher
would take, and no caller-chosen cache key (`uuid`). Also the typed `parts` of a message (an
image as its bytes) as the content parts vLLM renders."""

from __future__ import annotations

import base64
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from google.protobuf import json_format
from llmcompletions.v2.completions_pb2 import ChatContentPart, ChatMessage
from vllm.config import ModelConfig

from service.api.errors import Loc
from service.api.media.addresses import HostRules
from service.api.media.download import checked_url
from service.api.media.refusal import MediaRefusedError
from service.api.validation import Violations

# vLLM's content part types that carry media (its MM_PARSER_MAP less the text kinds): an
# image is one of the first two; every kind reaches the model only if it takes media.
IMAGE_PART_TYPES = frozenset({"image_url", "input_image"})
MEDIA_PART_TYPES = IMAGE_PART_TYPES | frozenset(
    {
        "image_embeds",
        "image_pil",
        "audio_url",
        "input_audio",
        "audio_embeds",
        "video_url",
        "video_embeds",
        "prompt_embeds",
    }
)
# A part without a type is read by vLLM from the first of these keys it holds.
MEDIA_KEYS = tuple(sorted(MEDIA_PART_TYPES))


@dataclass(frozen=True)
class MediaPolicy:
    """What the served model takes, as its engine resolved it."""

    takes_media: bool
    images_per_prompt: int
    rules: HostRules

    @classmethod
    def of(cls, model_config: ModelConfig) -> MediaPolicy:
        if not model_config.is_multimodal_model:
            return cls(False, 0, HostRules())
        limit = model_config.get_multimodal_config().get_limit_per_prompt("image")
        return cls(True, limit, HostRules.from_domains(model_config.allowed_media_domains))


def typed_part(part: ChatContentPart) -> dict[str, Any]:
    """A typed part as the content part vLLM renders (an image's bytes as a data: URL)."""
    kind = part.WhichOneof("part")
    if kind == "image":
        mime_type = part.image.mime_type or "image/*"
        encoded = base64.b64encode(part.image.data).decode("ascii")
        return {"type": "image_url", "image_url": {"url": f"data:{mime_type};base64,{encoded}"}}
    if kind == "image_url":
        return {"type": "image_url", "image_url": {"url": part.image_url}}
    return {"type": "text", "text": part.text}


def message_content(message: ChatMessage) -> Any:
    """A message's content as vLLM reads it: `content` as given, else the typed `parts`."""
    if message.parts:
        return [typed_part(part) for part in message.parts]
    return json_format.MessageToDict(message.content) if message.HasField("content") else None


def part_type(part: dict[str, Any]) -> str | None:
    given = part.get("type")
    if isinstance(given, str):
        return given
    return next((key for key in MEDIA_KEYS if key in part), None)


def media_parts(messages: Sequence[ChatMessage]) -> Iterator[tuple[Loc, str, dict[str, Any]]]:
    """Each media part of the conversation: where it is, its type, the part."""
    for index, message in enumerate(messages):
        field = "parts" if message.parts else "content"
        content = message_content(message)
        if not isinstance(content, list):
            continue
        for position, part in enumerate(content):
            kind = part_type(part) if isinstance(part, dict) else None
            if kind in MEDIA_PART_TYPES or (isinstance(part, dict) and "uuid" in part):
                yield ("messages", index, field, position), kind or "", part


def image_url(part: dict[str, Any]) -> str | None:
    url = part.get("image_url")
    if isinstance(url, dict):
        url = url.get("url")
    return url if isinstance(url, str) else None


def check_media(
    messages: Sequence[ChatMessage], model: str, policy: MediaPolicy, found: Violations
) -> None:
    """Record every media part the server would refuse, before anything is fetched."""
    images = 0
    for index, message in enumerate(messages):
        if message.parts and message.HasField("content"):
            found.add(("messages", index, "parts"), "give content or parts, not both")
    for loc, kind, part in media_parts(messages):
        if "uuid" in part:
            found.add(
                (*loc, "uuid"),
                "a content part's uuid is not taken: the server keys each image by its content",
                "extra_forbidden",
            )
        if not policy.takes_media:
            found.add(loc, f"model {model!r:.120} takes text only: send no {kind or 'media'} parts")
            continue
        if kind in IMAGE_PART_TYPES:
            images += 1
            if images == policy.images_per_prompt + 1:
                found.add(
                    loc,
                    f"at most {policy.images_per_prompt} images per request (the server's "
                    "--limit-mm-per-prompt)",
                    "too_long",
                )
            check_image_url(image_url(part), policy.rules, loc, found)


def check_image_url(url: str | None, rules: HostRules, loc: Loc, found: Violations) -> None:
    if url is None or url[:5].lower() == "data:":
        return  # vLLM's part checks name a missing URL; a data: URL is bounded as it is read
    try:
        checked_url(url, rules)
    except MediaRefusedError as refusal:
        found.add((*loc, "image_url"), str(refusal.args[0]))


def image_counts(engine_input: Mapping[str, Any]) -> tuple[int, int]:
    """A rendered prompt's images, and the prompt tokens they take (their placeholders with
    the markers around them, as the prompt's token count has them)."""
    placeholders = engine_input.get("mm_placeholders") or {}
    images = placeholders.get("image", ())
    return len(images), sum(placeholder.length for placeholder in images)
