"""Logging goes through a queue; nothing queued is lost when the process exits."""

from __future__ import annotations

import json
import subprocess
import sys

PROGRAM = """
import logging, logging.handlers
from pooling_server.service.ops import logs
logs.configure("info", "text")
logs.configure("info", "json")  # configuring again replaces the first setup
[handler] = logging.getLogger().handlers
assert isinstance(handler, logging.handlers.QueueHandler), handler
for i in range(500):
    logging.getLogger("pooling.requests").info("request", extra={"fields": {"n": i}})
"""


def test_every_queued_line_reaches_stderr_at_exit() -> None:
    result = subprocess.run(
        [sys.executable, "-c", PROGRAM], capture_output=True, text=True, timeout=60, check=True
    )
    lines = [json.loads(line) for line in result.stderr.splitlines()]
    assert [line["n"] for line in lines] == list(range(500))
    assert all(line["logger"] == "pooling.requests" for line in lines)
