"""The bounds issue 43 added around connections and unread answers, part by part: the
answer budget (service/grpc/stream_limit.py), grpcio's options and its warning beyond
loopback (service/server.py), the shares per client address (service/ops/config.py) and the
HTTP door's share enforced on a real listener (service/http/guard.py). The attacks
themselves are in tests/reliability/test_attacks_connections.py."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
from aiohttp import web

from pooling_server.service.grpc.stream_limit import AnswerBudget, unsent_per_connection
from pooling_server.service.http.app import _error_response
from pooling_server.service.http.guard import ConnectionGuard
from pooling_server.service.ops.config import (
    MAX_PENDING_CALLS,
    HttpLimits,
    ServerConfig,
    TransportConfig,
    address_share,
)
from pooling_server.service.server import grpcio_options, warn_if_exposed

MB = 1 << 20


def test_answer_budget_per_connection_and_in_all() -> None:
    budget = AnswerBudget(total=64 * MB, per_connection=32 * MB, large=MB)
    assert budget.refusal("a", 20 * MB) is None
    # The connection's second large answer would pass its share.
    assert "on this connection" in (budget.refusal("a", 14 * MB) or "")
    assert budget.refusal("b", 20 * MB) is None
    assert budget.refusal("c", 20 * MB) is None
    # 60 MB held: a large answer from a new connection is over the total...
    assert "from this server" in (budget.refusal("d", 14 * MB) or "")
    # ...a small one still has the reserve, and a connection with nothing unsent always
    # takes an answer once the server has nothing unsent either.
    assert budget.refusal("d", 512 * 1024) is None
    for peer, size in (("a", 20 * MB), ("b", 20 * MB), ("c", 20 * MB), ("d", 512 * 1024)):
        budget.give(peer, size)
    assert budget.used == 0 and not budget._by_peer
    assert budget.refusal("e", 100 * MB) is None  # larger than everything, but alone


def test_answer_budget_counts_copies() -> None:
    budget = AnswerBudget(total=64 * MB, per_connection=64 * MB, large=MB, copies=2)
    assert budget.refusal("a", 20 * MB) is None
    assert budget.used == 40 * MB
    assert budget.refusal("b", 14 * MB) is not None  # 40 + 28 > 64
    budget.give("a", 20 * MB)
    assert budget.used == 0


def test_unsent_share_of_a_connection() -> None:
    transport = TransportConfig(max_unsent_answer_bytes=64 * MB)
    assert unsent_per_connection(transport, 16 * MB) == 32 * MB  # two messages' worth
    assert unsent_per_connection(transport, 4 * MB) == 16 * MB  # a quarter of the total
    small = TransportConfig(max_unsent_answer_bytes=16 * MB)
    assert unsent_per_connection(small, 16 * MB) == 16 * MB  # never above the total


def test_address_share() -> None:
    assert address_share(0, 1024) == 256
    assert address_share(0, 3) == 1
    assert address_share(10, 1024) == 10
    assert address_share(5000, 1024) == 1024
    assert TransportConfig().address_cap() == 256


def test_grpcio_streams_per_connection_under_core_call_queue() -> None:
    options = dict(grpcio_options(ServerConfig()))
    assert options["grpc.max_concurrent_streams"] == MAX_PENDING_CALLS // 16
    few = ServerConfig(transport=TransportConfig(max_concurrent_streams=100))
    assert dict(grpcio_options(few))["grpc.max_concurrent_streams"] == 100
    assert dict(grpcio_options(ServerConfig()))["grpc.max_connection_idle_ms"] == 300_000


@pytest.mark.parametrize(
    ("host", "exposed"),
    [
        ("127.0.0.1", False),
        ("::1", False),
        ("localhost", False),
        ("127.0.0.2", False),
        ("0.0.0.0", True),
        ("::", True),
        ("10.1.2.3", True),
        ("example.com", True),
    ],
)
def test_grpcio_warns_beyond_loopback(
    host: str, exposed: bool, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="pooling_server.service.server"):
        assert warn_if_exposed(host) is exposed
    warned = "\n".join(record.getMessage() for record in caplog.records)
    if exposed:
        for named in (
            "CONTINUATION",
            "INTERNAL",
            "GOAWAY",
            "per client address",
            "--grpc-door node",
            "Envoy",
        ):
            assert named in warned, named
    else:
        assert not warned


async def _http_share() -> tuple[list[bytes], bytes, bytes]:
    """A guarded aiohttp listener allowing 2 connections an address: 3 from 127.0.0.2
    (the third refused 503 at once), then one from 127.0.0.1, served."""
    guard = ConnectionGuard(
        HttpLimits(max_connections=16, max_connections_per_address=2), _error_response
    )

    async def route(request: web.Request) -> web.Response:
        return web.Response(text="served")

    app = web.Application(middlewares=[guard.track])
    app.router.add_get("/", route)
    runner = web.AppRunner(app)
    await runner.setup()
    loop = asyncio.get_running_loop()
    server = await loop.create_server(guard.factory(runner.server), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]

    async def connect(source: str) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        sock = socket.socket()
        sock.bind((source, 0))
        sock.setblocking(False)
        await loop.sock_connect(sock, ("127.0.0.1", port))
        return await asyncio.open_connection(sock=sock)

    try:
        held = [await connect("127.0.0.2") for _ in range(2)]
        reader, writer = await connect("127.0.0.2")
        refused = await asyncio.wait_for(reader.read(), 2)
        writer.close()
        reader, writer = await connect("127.0.0.1")
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        served = await asyncio.wait_for(reader.read(), 2)
        writer.close()
        for _, held_writer in held:
            held_writer.close()
        await asyncio.sleep(0.1)
        # The address's share is free again once its connections have closed.
        reader, writer = await connect("127.0.0.2")
        writer.write(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        again = await asyncio.wait_for(reader.read(), 2)
        writer.close()
    finally:
        server.close()
        await runner.cleanup()
    return [refused], served, again


def test_http_connections_have_a_share_per_address() -> None:
    [refused], served, again = asyncio.run(_http_share())
    assert refused.startswith(b"HTTP/1.1 503") and b"TOO_MANY_CONNECTIONS" in refused
    assert served.startswith(b"HTTP/1.1 200") and served.endswith(b"served")
    assert again.startswith(b"HTTP/1.1 200")
