"""Run the real `pooling-server` in a subprocess on a free loopback port."""

from __future__ import annotations

import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import psutil
from grpc_health.v1 import health_pb2, health_pb2_grpc

# free_port's port is free when it returns, not when the server binds it: in between, any
# outgoing connection on the machine may be given it as its own ephemeral port (a suite run
# lost a test so). A server that finds its gRPC port taken is started again on another.
PORT_ATTEMPTS = 3
PORT_TAKEN = "is the port taken?"  # service/server.py's message


_GIVEN: set[int] = set()


def free_port() -> int:
    """A free loopback port, never one this process gave before: the kernel may hand a
    just-closed port out again, and a server given the same port for its gRPC and HTTP
    doors fails to start."""
    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        if port not in _GIVEN:
            _GIVEN.add(port)
            return port


def process_tree(pid: int) -> list[psutil.Process]:
    """The process and every descendant it has now: a split server's supervisor, engines
    and front ends, whose totals are the server's."""
    root = psutil.Process(pid)
    return [root, *root.children(recursive=True)]


@dataclass
class ServerProcess:
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    credentials: grpc.ChannelCredentials | None = None  # for a TLS server's health checks

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def request_log(self, request_id: str, timeout: float = 10.0) -> list[dict[str, Any]]:
        """The request log's lines of `request_id` (a server run with --log-format json and
        --log-requests), once written: the server logs through a queue, off its loop."""
        deadline = time.monotonic() + timeout
        while True:
            lines = [json.loads(line) for line in self.log().splitlines() if line.strip()]
            found = [
                line
                for line in lines
                if line.get("logger") == "pooling.requests" and line.get("request_id") == request_id
            ]
            if found or time.monotonic() > deadline:
                return found
            time.sleep(0.05)

    def grpc_door(self) -> str:
        """What serves gRPC (grpcio or node), as the server logged it: `--grpc-door auto`
        picks node where Node.js is on PATH."""
        found = re.search(r"gRPC served by (\w+)", self.log())
        assert found, f"the server never said which door serves gRPC:\n{self.log()}"
        return found.group(1)

    def tree_size(self) -> int:
        """The processes a server of one front end and one engine runs: a supervisor, the
        engine and the front end, and the front end's Node.js where Node serves gRPC."""
        return 3 + (self.grpc_door() == "node")

    def health(self, service: str = "", timeout: float = 5.0) -> int:
        channel = (
            grpc.insecure_channel(self.address)
            if self.credentials is None
            else grpc.secure_channel(self.address, self.credentials)
        )
        with channel:
            stub = health_pb2_grpc.HealthStub(channel)
            return stub.Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            ).status

    def wait_serving(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited with {self.process.returncode}:\n{self.log()}")
            try:
                if self.health() == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not SERVING after {timeout}s:\n{self.log()}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 60.0) -> int:
        if self.process.poll() is None:
            self.process.send_signal(sig)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def start_server(
    args: list[str],
    log_dir: Path,
    name: str = "server",
    serving_timeout: float = 180.0,
    **spawn: Any,
) -> ServerProcess:
    """Start the server (spawn_server, with `spawn`'s keywords) and wait until it serves.
    `serving_timeout`: how long its models may take to load (exports included)."""
    for attempt in range(PORT_ATTEMPTS):
        server = spawn_server(args, log_dir, name, **spawn)
        try:
            server.wait_serving(serving_timeout)
        except BaseException:
            server.stop(signal.SIGKILL)
            if attempt + 1 < PORT_ATTEMPTS and PORT_TAKEN in server.log():
                continue
            raise
        return server
    raise AssertionError("unreachable")


def running_server(
    args: list[str], log_dir: Path, name: str = "server", **start: Any
) -> Iterator[ServerProcess]:
    """A fixture's body, `yield from running_server(...)`: start_server (with `start`'s
    keywords), then SIGTERM once its scope ends, a failed start of a later fixture
    included."""
    process = start_server(args, log_dir, name, **start)
    try:
        yield process
    finally:
        process.stop(signal.SIGTERM)


def running_model(
    build: Callable[[Path], Path], name: str, log_dir: Path, *flags: str
) -> Iterator[ServerProcess]:
    """running_server of one fixture model, saved by `build(log_dir / name)` and served as
    `name` in float32 with `flags`."""
    args = ["--model", f"{name}={build(log_dir / name)}", "--dtype", "float32", *flags]
    yield from running_server(args, log_dir, name)


def spawn_server(
    args: list[str],
    log_dir: Path,
    name: str = "server",
    credentials: grpc.ChannelCredentials | None = None,
    new_session: bool = False,
    nofile: tuple[int, int] | None = None,
    extra_env: Mapping[str, str] | None = None,
) -> ServerProcess:
    """Start the server (the console script's module, with this interpreter), without the
    wait: servers a module needs together load side by side (their start-up is mostly
    imports on one core each).

    `credentials` are for a server started with TLS flags: its health is checked over TLS.
    `new_session` puts the server tree in a process group of its own, so that a test can
    signal the group (os.killpg) as systemd or `timeout` would, without hitting pytest.
    `nofile`: the tree's open-file limit (soft, hard), as `ulimit -n` would set it.
    `extra_env`: variables set for the server tree (over this process's environment).
    """
    port = free_port()
    log_path = log_dir / f"{name}-{port}.log"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(extra_env or {})}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "pooling_server.service.launch", "--port", str(port), *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=new_session,
            preexec_fn=None if nofile is None else lambda: _limit_files(nofile),
        )
    return ServerProcess(process, port, log_path, credentials)


@contextmanager
def all_serving(servers: Iterable[ServerProcess], stop_timeout: float = 10.0) -> Iterator[None]:
    """Wait until every spawned server serves; on leaving (a failed start too), stop them."""
    servers = list(servers)
    try:
        for server in servers:
            server.wait_serving()
        yield
    finally:
        for server in servers:
            server.stop(signal.SIGTERM, timeout=stop_timeout)


def _limit_files(nofile: tuple[int, int]) -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, nofile)
