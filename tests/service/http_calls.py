"""A real server's HTTP port as the HTTP tests call it: JSON in, (status, headers, JSON) out."""

from __future__ import annotations

import json
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.server_process import ServerProcess, free_port, start_server

SERVER_KEY = object()  # `call`'s default: the server's own key


@dataclass
class HttpServer:
    process: ServerProcess
    http_port: int
    metrics_port: int
    key: str = ""  # the server's --api-key

    def url(self, path: str = "") -> str:
        return f"http://127.0.0.1:{self.http_port}{path}"

    def call(
        self, path: str, body: Any = None, key: Any = SERVER_KEY, raw: bytes | None = None
    ) -> tuple[int, dict[str, str], Any]:
        """(status, headers, parsed JSON) of a request; errors are answers too. `key`: the
        bearer key to send (None: no Authorization header)."""
        key = self.key if key is SERVER_KEY else key
        data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
        request = urllib.request.Request(
            self.url(path), data=data, method="POST" if data else "GET"
        )
        request.add_header("Content-Type", "application/json")
        if key is not None:
            request.add_header("Authorization", f"Bearer {key}")
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, dict(response.headers), json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), json.loads(error.read())


@contextmanager
def serving_http(args: list[str], log_dir: Path, name: str) -> Iterator[HttpServer]:
    """A real server started with `args` and its HTTP door on a free port (no metrics port,
    no key), stopped on leaving."""
    http_port = free_port()
    process = start_server([*args, "--http-port", str(http_port)], log_dir, name)
    try:
        yield HttpServer(process, http_port, 0)
    finally:
        process.stop(signal.SIGTERM)
