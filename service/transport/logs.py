"""Logging set-up: one line per event, plain text or JSON."""

from __future__ import annotations

import json
import logging
from datetime import datetime, timezone
from typing import Any

PLAIN_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def event_fields(record: logging.LogRecord) -> dict[str, Any]:
    return getattr(record, "fields", {})


class PlainFormatter(logging.Formatter):
    """`message key=value ...`: structured fields appended to the classic line."""

    def __init__(self) -> None:
        super().__init__(PLAIN_FORMAT)

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = event_fields(record)
        if fields:
            line += " " + " ".join(
                f"{key}={value!r}" if isinstance(value, str) else f"{key}={value}"
                for key, value in fields.items()
            )
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per line, structured fields at the top level."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            **event_fields(record),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class FrontendField(logging.Filter):
    """Every line of a frontend process of several says which one it is."""

    def __init__(self, index: int) -> None:
        super().__init__()
        self.index = index

    def filter(self, record: logging.LogRecord) -> bool:
        record.fields = {**event_fields(record), "frontend": self.index}
        return True


def configure_logging(level: str, fmt: str, frontend: int | None = None) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else PlainFormatter())
    if frontend is not None:
        handler.addFilter(FrontendField(frontend))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
