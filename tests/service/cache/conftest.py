"""The result cache's tests share one redis-server per worker (the Redis-dies test starts
its own)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.service.cache.redis_server import RedisServer, start_redis


@pytest.fixture(scope="session")
def shared_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = start_redis(tmp_path_factory.mktemp("redis"))
    try:
        yield server
    finally:
        server.kill()
