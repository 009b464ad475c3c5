"""A caller's file paths, kept where the operator allows: inside the batch root (BATCH_ROOT),
resolved (links followed), or in one of the S3 buckets (and prefixes) BATCH_BUCKETS names; any
other is refused before anything is read or written."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from service.api.batch.files import BUCKET_SCHEME
from service.api.batch.store import JOBS_DIRECTORY
from service.api.validation import Violations


def confined(
    root: Path, buckets: Sequence[str], given: str, field: str, found: Violations
) -> str | None:
    """Where `given` names, as the job keeps it (an absolute path, or an s3:// URL); None, with
    the reason in `found`, if it is not allowed."""
    if not given:
        found.add((field,), f"{field} is required", "missing")
        return None
    if "\x00" in given:
        found.add((field,), f"{field} holds a NUL character")
        return None
    if given.startswith(BUCKET_SCHEME):
        return in_allowed_bucket(buckets, given, field, found)
    scheme, separator, _ = given.partition("://")
    if separator and scheme != "file":
        found.add(
            (field,),
            f"{field} must be a file inside the server's batch root (BATCH_ROOT) or an allowed "
            f"bucket (BATCH_BUCKETS); {scheme}:// storage is not configured on this server",
        )
        return None
    resolved = inside_root(root, given, field, found)
    return str(resolved) if resolved is not None else None


def inside_root(root: Path, given: str, field: str, found: Violations) -> Path | None:
    base = root.resolve()
    candidate = Path(given.removeprefix("file://"))
    resolved = (base / candidate).resolve() if not candidate.is_absolute() else candidate.resolve()
    if resolved != base and base not in resolved.parents:
        found.add(
            (field,),
            f"{field} must lie inside the server's batch root {base} (BATCH_ROOT); give a path "
            "there, absolute or relative to it",
        )
        return None
    store = base / JOBS_DIRECTORY
    if resolved == store or store in resolved.parents:
        found.add((field,), f"{field} may not be in the jobs' own records ({JOBS_DIRECTORY})")
        return None
    if resolved.is_dir():
        found.add((field,), f"{field} is a directory; name a file")
        return None
    return resolved


def in_allowed_bucket(
    buckets: Sequence[str], given: str, field: str, found: Violations
) -> str | None:
    """`given` if it names an object under one of `buckets` (each s3://BUCKET or
    s3://BUCKET/PREFIX, no trailing slash): no empty, "." or ".." segment, no control
    character."""
    if not buckets:
        found.add(
            (field,),
            f"{field} must be a file inside the server's batch root (BATCH_ROOT); s3:// storage "
            "is not configured on this server (BATCH_BUCKETS)",
        )
        return None
    segments = given.removeprefix(BUCKET_SCHEME).split("/")
    malformed = any(segment in ("", ".", "..") for segment in segments)
    if len(segments) < 2 or malformed or any(ord(character) < 32 for character in given):
        found.add(
            (field,),
            f"{field} must be s3://BUCKET/KEY, with no empty, '.' or '..' segment in the key",
        )
        return None
    if not any(given.startswith(f"{bucket}/") for bucket in buckets):
        found.add(
            (field,),
            f"{field} must lie in a bucket this server allows (BATCH_BUCKETS): "
            + ", ".join(f"{bucket}/..." for bucket in buckets),
        )
        return None
    return given
