"""A caller's file paths, kept inside the operator's batch root (BATCH_ROOT): resolved (links
followed) and refused unless they lie inside it, before anything is read or written."""

from __future__ import annotations

from pathlib import Path

from service.api.batch.store import JOBS_DIRECTORY
from service.api.validation import Violations


def confined(root: Path, given: str, field: str, found: Violations) -> Path | None:
    if not given:
        found.add((field,), f"{field} is required", "missing")
        return None
    if "\x00" in given:
        found.add((field,), f"{field} holds a NUL character")
        return None
    scheme, separator, _ = given.partition("://")
    if separator and scheme != "file":
        found.add(
            (field,),
            f"{field} must be a file inside the server's batch root (BATCH_ROOT); {scheme}:// "
            "storage is not configured on this server",
        )
        return None
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
