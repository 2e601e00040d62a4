"""A real server's HTTP port as the HTTP tests call it: JSON in, (status, headers, JSON) out."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from pooling_client.v1 import pooling_pb2_grpc
from tests.server_process import ServerProcess, free_port, start_server

ROOT = Path(__file__).resolve().parents[2]
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
        status, headers, content = self.fetch(path, body, key, raw)
        return status, headers, json.loads(content)

    def fetch(
        self, path: str, body: Any = None, key: Any = SERVER_KEY, raw: bytes | None = None
    ) -> tuple[int, dict[str, str], bytes]:
        """call's answer as it came: (status, headers, body bytes)."""
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
                return response.status, dict(response.headers), response.read()
        except urllib.error.HTTPError as error:
            return error.code, dict(error.headers), error.read()


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


def grpc_stub(http: HttpServer) -> Iterator[pooling_pb2_grpc.PoolingServiceStub]:
    """A stub on the same server's gRPC port, open while iterated: a module fixture's
    `yield from grpc_stub(http)`."""
    with grpc.insecure_channel(http.process.address) as channel:
        yield pooling_pb2_grpc.PoolingServiceStub(channel)


def serve_models(
    factory: pytest.TempPathFactory, name: str, models: dict[str, object], *flags: str
) -> Iterator[HttpServer]:
    """A module's own server, as its `http` fixture yields it (`yield from serve_models(...)`):
    each of `models` (served name to folder or hub id), float32, then `flags`; its log in a
    folder of `name`."""
    args = [arg for model, folder in models.items() for arg in ("--model", f"{model}={folder}")]
    args += ["--dtype", "float32", *flags]
    with serving_http(args, factory.mktemp(f"{name}-logs"), name) as server:
        yield server


@pytest.fixture(scope="module")
def http_stub(http: HttpServer) -> Iterator[pooling_pb2_grpc.PoolingServiceStub]:
    """A stub on the gRPC port of the module's own `http` server: a module that serves its
    own models takes it as its `stub` (`stub = http_stub`), over the shared server's."""
    yield from grpc_stub(http)


def batch_line(custom_id: str, url: str, body: dict[str, Any]) -> dict[str, Any]:
    """One line of a batch job's input: a POST of `body` to `url`."""
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def run_batch(args: list[str], lines: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """`pooling-server batch` with `args` (models and their flags) on `lines` through stdin
    and stdout; the job must succeed. Each answer's response, by custom_id."""
    command = [sys.executable, "-m", "pooling_server.service.launch", "batch", *args]
    command += ["--no-progress", "--input", "-", "--output", "-"]
    done = subprocess.run(
        command,
        cwd=ROOT,
        input="".join(json.dumps(line) + "\n" for line in lines),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return {a["custom_id"]: a["response"] for a in map(json.loads, done.stdout.splitlines())}
