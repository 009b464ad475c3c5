"""The tenants file, followed while the server runs: read at start (a file that cannot be used
stops the start), then checked every second and reloaded when its content changes. A file
that fails validation, or cannot be read, keeps the previous table; it is logged once per
change and counted.

The path is read afresh each time, so a Kubernetes Secret mounted as a directory, whose files
change by a symlink swap, is followed too."""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from pathlib import Path

from service.api.tenants import TenantsFileError, TenantTable, parse_tenants

CHECK_EVERY_SECONDS = 1.0
logger = logging.getLogger(__name__)

# What a check found: "reloaded", "invalid" or "unreadable" (for the reloads counter).
ReloadCounter = Callable[[str], None]


def read_table(path: Path) -> tuple[TenantTable, str]:
    """The file's table and a digest of its content; TenantsFileError if it cannot be used."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise TenantsFileError(f"{path}: cannot be read: {error.strerror or error}") from None
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise TenantsFileError(f"{path}: not UTF-8 text") from None
    return parse_tenants(text, str(path)), hashlib.sha256(data).hexdigest()


class TenantsFile:
    """The current tenants table, and how to keep it current."""

    def __init__(self, path: Path, counted: ReloadCounter = lambda result: None) -> None:
        self.path = path
        self.counted = counted
        self.table, self.digest = read_table(path)  # a bad file stops the start
        self.failed_digest: str | None = None  # the last content refused, logged once
        logger.info("tenants from %s: %s", path, describe(self.table))

    def check(self) -> None:
        """Reloads the table if the file's content changed and is valid."""
        try:
            data = self.path.read_bytes()
        except OSError as error:
            self.refused("unreadable", f"unreadable:{error.errno}", f"cannot be read: {error}")
            return
        digest = hashlib.sha256(data).hexdigest()
        if digest == self.digest:
            return
        try:
            self.table, self.digest = read_table(self.path)
        except TenantsFileError as error:
            self.refused("invalid", digest, str(error))
            return
        self.failed_digest = None
        self.counted("reloaded")
        logger.info("tenants reloaded from %s: %s", self.path, describe(self.table))

    def refused(self, result: str, digest: str, problem: str) -> None:
        if digest == self.failed_digest:
            return  # already said for this content
        self.failed_digest = digest
        self.counted(result)
        logger.error(
            "tenants file not reloaded, the previous table stays: %s; fix the file (it is "
            "checked every %.0f s)",
            problem,
            CHECK_EVERY_SECONDS,
        )

    async def follow(self) -> None:
        """Checks the file every second until cancelled."""
        while True:
            await asyncio.sleep(CHECK_EVERY_SECONDS)
            self.check()


def describe(table: TenantTable) -> str:
    return f"{len(table.tenants)} tenants, {len(table.callers)} keys"
