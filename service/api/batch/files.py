"""A job's input and output files: on the batch root's disk, or in an S3 bucket the operator
allows (BATCH_BUCKETS), through s3fs with the environment's AWS settings (credentials, and
AWS_ENDPOINT_URL for an S3-compatible store). s3fs runs its own event loop: call these from a
thread, never from the server's loop."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from service.api.batch.store import atomic_write

BUCKET_SCHEME = "s3://"


def in_bucket(location: str) -> bool:
    return location.startswith(BUCKET_SCHEME)


def bucket_files() -> Any:  # s3fs is untyped
    """The S3 filesystem (s3fs caches it), imported when a job first uses a bucket."""
    import s3fs

    return s3fs.S3FileSystem()


def size_of(location: str) -> int:
    """The file's size in bytes; OSError (FileNotFoundError, PermissionError) if unreadable."""
    if in_bucket(location):
        return int(bucket_files().size(location))
    return Path(location).stat().st_size


def read_text(location: str) -> str:
    """The file as UTF-8 text; OSError or UnicodeDecodeError."""
    if in_bucket(location):
        with bucket_files().open(location, "rb") as remote:
            return bytes(remote.read()).decode()
    return Path(location).read_text()


def write_text(location: str, text: str) -> None:
    """`text` at `location`, whole or not at all: replaced on disk, one PUT in a bucket."""
    if in_bucket(location):
        with bucket_files().open(location, "wb") as remote:
            remote.write(text.encode())
        return
    path = Path(location)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, text)
