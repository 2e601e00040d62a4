"""Logging setup: plain text or one JSON object per line (`--log-format json`)."""

from __future__ import annotations

import atexit
import json
import logging
import logging.handlers
import queue
from typing import Any

FIELDS_ATTR = "fields"


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": self.formatTime(record, "%Y-%m-%dT%H:%M:%S"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            **getattr(record, FIELDS_ATTR, {}),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        fields = getattr(record, FIELDS_ATTR, None)
        if fields:
            text += " " + " ".join(
                f"{key}={json.dumps(value, default=str)}" for key, value in fields.items()
            )
        return text


class _Enqueue(logging.handlers.QueueHandler):
    """Hands records over as they are: formatting and writing happen on the listener."""

    def prepare(self, record: logging.LogRecord) -> logging.LogRecord:
        return record


_listener: logging.handlers.QueueListener | None = None


def _stop_listener() -> None:
    """Write what is still queued, then stop (at exit, or before configuring anew)."""
    global _listener
    if _listener is not None:
        _listener.stop()
        _listener = None


atexit.register(_stop_listener)


def shutdown() -> None:
    """Write every queued line now: for a process that leaves by os._exit (no atexit)."""
    _stop_listener()


def configure(level: str, fmt: str) -> None:
    """Log through a queue: a request's log line must not cost its event loop a write."""
    global _listener
    _stop_listener()
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    _listener = logging.handlers.QueueListener(records, handler)
    _listener.start()
    root = logging.getLogger()
    root.handlers[:] = [_Enqueue(records)]
    root.setLevel(level.upper())
