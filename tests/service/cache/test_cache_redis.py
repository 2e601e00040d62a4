"""The result cache's shared tier through a real redis-server: two servers share entries
(one process and one split server), a corrupt or truncated entry is a miss, and a Redis
killed mid-run leaves every call answered, uncached, with its errors counted."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.metrics_endpoint import metric_sum, scrape
from tests.server_process import ServerProcess, free_port, start_server
from tests.service.cache.answers import assert_same, outputs
from tests.service.cache.redis_server import RedisServer, start_redis

PREFIX = b"pooling:cache:v1:"


class Node:
    """One server of the fleet: its gRPC stub and its metrics port."""

    def __init__(self, process: ServerProcess, metrics_port: int) -> None:
        self.process, self.metrics_port = process, metrics_port
        self.channel = grpc.insecure_channel(process.address)
        self.stub = pooling_pb2_grpc.PoolingServiceStub(self.channel)

    def embed(self, *texts: str, bypass: bool = False) -> pb.PoolResponse:
        request = pb.PoolRequest(model="tiny", embed=pb.TextInput(texts=texts))
        request.params.bypass_cache = bypass
        return self.stub.Pool(request, timeout=60)

    def counter(self, name: str, **labels: str) -> float:
        return metric_sum(scrape(self.metrics_port), name, **labels)

    def close(self) -> None:
        self.channel.close()
        self.process.stop(signal.SIGTERM)


def start_node(folder: Path, logs: Path, redis_url: str, *flags: str) -> Node:
    metrics_port = free_port()
    args = ["--model", f"tiny={folder}", "--dtype", "float32", "--cache-redis", redis_url]
    args += ["--metrics-port", str(metrics_port), *flags]
    return Node(start_server(args, logs, f"node-{metrics_port}"), metrics_port)


@pytest.fixture(scope="module")
def fleet(
    shared_redis: RedisServer,
    model_folders: dict[str, Path],
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Node, Node]]:
    """Two servers on one Redis: one process with a memory tier too, and a split server
    with Redis alone."""
    logs = tmp_path_factory.mktemp("cache-fleet")
    folder = model_folders["tiny-st-mean"]
    first = start_node(folder, logs, shared_redis.url, "--frontends", "0", "--cache-mb", "8")
    try:
        second = start_node(folder, logs, shared_redis.url, "--frontends", "1")
    except BaseException:
        first.close()
        raise
    yield first, second
    first.close()
    second.close()


def wait_for(check: Any, timeout: float = 10.0) -> None:
    """Poll `check()` until true (writes to Redis go out on a thread of their own)."""
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _entries(redis: RedisServer) -> set[bytes]:
    return set(redis.client().scan_iter(match=PREFIX + b"*", count=1000))


def test_two_servers_share_entries(fleet: tuple[Node, Node], shared_redis: RedisServer) -> None:
    first, second = fleet
    texts = ("shared across the fleet", "and a second text")
    before = _entries(shared_redis)
    computed = first.embed(*texts)
    assert computed.usage.cached_tokens == 0
    wait_for(lambda: len(_entries(shared_redis) - before) == 2)
    ttl = shared_redis.client().ttl(next(iter(_entries(shared_redis) - before)))
    assert 0 < ttl <= 86400
    found = second.embed(*texts)
    assert found.usage.cached_tokens == found.usage.prompt_tokens
    assert_same(outputs(found), outputs(computed))
    wait_for(lambda: second.counter("pooling_cache_hits_total", tier="redis") >= 2)


@pytest.mark.parametrize("damage", ["flipped", "truncated", "swapped"])
def test_a_corrupt_entry_is_a_miss(
    fleet: tuple[Node, Node], shared_redis: RedisServer, damage: str
) -> None:
    first, second = fleet
    texts = (f"an entry to be {damage}", f"another entry to be {damage}")
    want = second.embed(*texts, bypass=True)
    before = _entries(shared_redis)
    first.embed(*texts)
    wait_for(lambda: len(_entries(shared_redis) - before) == 2)
    client = shared_redis.client()
    keys = sorted(_entries(shared_redis) - before)
    values = [client.get(key) for key in keys]
    if damage == "flipped":
        for key, value in zip(keys, values, strict=True):
            client.set(key, value[:40] + bytes([value[40] ^ 1]) + value[41:])
    elif damage == "truncated":
        for key, value in zip(keys, values, strict=True):
            client.set(key, value[: len(value) - 9])
    else:  # each entry under the other's key: whole, but not this key's
        client.set(keys[0], values[1])
        client.set(keys[1], values[0])
    corrupt = second.counter("pooling_cache_corrupt_entries_total")
    got = second.embed(*texts)  # the split server: no memory tier, so Redis is read
    assert got.usage.cached_tokens == 0
    assert_same(outputs(got), outputs(want))
    wait_for(lambda: second.counter("pooling_cache_corrupt_entries_total") >= corrupt + 2)


def test_calls_go_on_when_redis_dies(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("redis-dies")
    redis = start_redis(root / "redis")
    node = start_node(model_folders["tiny-st-mean"], root, redis.url, "--frontends", "1")
    try:
        texts = ("before the fall", "a second text")
        before = node.embed(*texts)
        wait_for(lambda: len(_entries(redis)) == 2)
        assert node.embed(*texts).usage.cached_tokens > 0  # from Redis: no memory tier
        redis.kill()
        answers = [node.embed(*texts, f"after the fall {k}") for k in range(20)]
        assert all(a.usage.cached_tokens == 0 for a in answers)
        for answer in answers:
            assert_same(
                outputs(answer)["embed"]["embeddings"][:2], outputs(before)["embed"]["embeddings"]
            )
        wait_for(lambda: node.counter("pooling_cache_redis_errors_total") >= 1)
        assert "cache's Redis tier" in node.process.log()  # warned of, once
        assert node.process.log().count("cache's Redis tier") == 1
    finally:
        node.close()
        redis.kill()
