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
    grpc_core = logging.getLogger("grpc._cython.cygrpc")
    if not any(isinstance(f, ClientFaultFilter) for f in grpc_core.filters):
        grpc_core.addFilter(ClientFaultFilter())


# How grpcio's ERROR for a client's fault starts: what ClientFaultFilter's line says came.
GRPCIO_CLIENT_FAULTS = {
    "Invalid encoding": "metadata value(s) that are not UTF-8 received (served as bytes; "
    "refused where they matter)",
    "Unexpected [DecodeError]": "request message(s) that do not parse received (answered UNKNOWN)",
}


class ClientFaultFilter(logging.Filter):
    """grpcio logs an ERROR with a traceback for faults that are the client's: a metadata
    value that is not UTF-8 (it hands the value on as bytes, which auth refuses) and a
    request that does not parse for a service whose parsing is grpcio's (health,
    reflection; answered UNKNOWN). A client could fill the log with them: each kind becomes
    one WARNING line a minute, with how many came."""

    EVERY_S = 60.0

    def __init__(self) -> None:
        super().__init__()
        self._last = dict.fromkeys(GRPCIO_CLIENT_FAULTS, float("-inf"))
        self._held = dict.fromkeys(GRPCIO_CLIENT_FAULTS, 0)

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        kind = next((start for start in GRPCIO_CLIENT_FAULTS if text.startswith(start)), None)
        if kind is None:
            return True
        self._held[kind] += 1
        if record.created - self._last[kind] < self.EVERY_S:
            return False
        record.msg = f"%d {GRPCIO_CLIENT_FAULTS[kind]} in the last minute"
        record.args = (self._held[kind],)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        self._last[kind], self._held[kind] = record.created, 0
        return True
