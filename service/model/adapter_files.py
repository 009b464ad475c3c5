"""An adapter's files while it is served: a copy the engine reads (its snapshot, so that files
changed or removed at the source never reach a running adapter), the digest that names a
version, and the signature that tells when the source changed."""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

# Each file's relative path, size and modification time: changes when any file does.
Signature = tuple[tuple[str, int, int], ...]
CHUNK_BYTES = 1 << 20


def files_of(directory: Path) -> list[Path]:
    return sorted(path for path in directory.rglob("*") if path.is_file())


def signature(directory: Path) -> Signature:
    """What the directory holds now, cheaply (no file is read); empty if it is gone."""
    try:
        found = []
        for path in files_of(directory):
            stat = path.stat()
            found.append((str(path.relative_to(directory)), stat.st_size, stat.st_mtime_ns))
        return tuple(found)
    except OSError:
        return ()


def total_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in files_of(directory))


def digest(directory: Path) -> str:
    """A hash of every file's relative path and content."""
    hashed = hashlib.sha256()
    for path in files_of(directory):
        hashed.update(str(path.relative_to(directory)).encode() + b"\0")
        with path.open("rb") as handle:
            while chunk := handle.read(CHUNK_BYTES):
                hashed.update(chunk)
    return hashed.hexdigest()


def snapshot(source: Path, snapshots: Path, name: str) -> tuple[Path, str]:
    """A copy of `source` under `snapshots`, named by `name` and its content's digest; and the
    digest. The same content gives the same copy (reused)."""
    snapshots.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".copy-", dir=snapshots))
    try:
        copy = staging / "adapter"
        shutil.copytree(source, copy, symlinks=False)
        content = digest(copy)
        target = snapshots / f"{safe_name(name)}-{content[:16]}"
        try:
            copy.rename(target)
        except OSError:
            if not target.is_dir():  # else another process made the same copy first
                raise
        return target, content
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64]


def engine_id(name: str, content: str) -> int:
    """The engine's id of one version of an adapter: the same in every frontend that loads the
    same files under the same name, and another for other files (the engine's workers know an
    adapter by its id alone, so a reused id would serve stale weights). Above the ids of the
    adapters given at start (1, 2, ...)."""
    return 1_000_000 + int(hashlib.sha256(f"{name}\0{content}".encode()).hexdigest()[:7], 16)
