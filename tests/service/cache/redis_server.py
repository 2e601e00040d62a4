"""A real redis-server for the result cache's tests, on a free loopback port with its own
folder; the tests that need one skip, saying so, where redis-server is not installed
(`make test` installs Debian's where it can)."""

from __future__ import annotations

import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import redis

from tests.server_process import free_port

ABSENT = (
    "redis-server is not installed: the result cache's Redis tests need it "
    "(`make test` installs Debian's redis-server where it can: apt-get install redis-server)"
)


@dataclass
class RedisServer:
    process: subprocess.Popen[bytes]
    port: int

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(10)


def start_redis(folder: Path) -> RedisServer:
    """redis-server on a free port, persisting nothing, up once it answers PING."""
    binary = shutil.which("redis-server")
    if binary is None:
        pytest.skip(ABSENT)
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)]
    command += ["--save", "", "--appendonly", "no", "--protected-mode", "yes"]
    log = (folder / "redis.log").open("wb")
    server = RedisServer(subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT), port)
    deadline = time.monotonic() + 20
    while True:
        try:
            if server.client().ping():
                return server
        except redis.ConnectionError as exc:
            if server.process.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise AssertionError(f"redis-server did not start: {folder / 'redis.log'}") from exc
            time.sleep(0.05)
