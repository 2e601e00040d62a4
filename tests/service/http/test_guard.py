"""The HTTP guard's body turns (service/http/guard.py), on a real aiohttp server with the
guard's body middleware and the doors' body reader (service/http/door.py)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import aiohttp
from aiohttp import web

from pooling_server.service.http import door as http_doors
from pooling_server.service.http.app import _error_response
from pooling_server.service.http.bodies import EmbeddingsBody
from pooling_server.service.http.guard import ConnectionGuard, body_read
from pooling_server.service.ops.config import LARGE_MESSAGE_BYTES, HttpLimits

TEXTS = ["a text"] * (LARGE_MESSAGE_BYTES // 8)  # a body of about 1.2 MB


async def _chunked(data: bytes) -> AsyncIterator[bytes]:
    """The body in two parts a moment apart: chunked, so never whole with its headers."""
    half = len(data) // 2
    yield data[:half]
    await asyncio.sleep(0.05)
    yield data[half:]


async def _turns_pass_when_parsed() -> list[tuple[str, str]]:
    trims: list[str] = []
    guard = ConnectionGuard(
        HttpLimits(body_timeout_s=5.0), _error_response, lambda: trims.append("trim")
    )
    events: list[tuple[str, str]] = []
    parse_first = asyncio.Event()

    async def route(request: web.Request) -> web.Response:
        name = request.headers["X-Name"]
        events.append(("route", name))
        assert isinstance(body_read(request), bytearray)  # the guard's one buffer
        if name == "first":
            await parse_first.wait()
        body = await http_doors.read_body(request, EmbeddingsBody, len(TEXTS))
        events.append(("parsed", name))
        return web.json_response({"texts": len(body.items())})

    app = web.Application(middlewares=[guard.read_body], client_max_size=16 << 20)
    app.router.add_post("/", route)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    data = json.dumps({"input": TEXTS}).encode()
    try:
        async with aiohttp.ClientSession() as session:

            async def send(name: str) -> int:
                url = f"http://127.0.0.1:{port}/"
                headers = {"X-Name": name}
                async with session.post(url, data=_chunked(data), headers=headers) as answer:
                    assert answer.status == 200, await answer.text()
                    return (await answer.json())["texts"]

            first = asyncio.create_task(send("first"))
            while ("route", "first") not in events:
                await asyncio.sleep(0.01)
            second = asyncio.create_task(send("second"))
            await asyncio.sleep(0.5)
            events.append(("released", "first"))
            parse_first.set()
            assert await first == await second == len(TEXTS)
    finally:
        await runner.cleanup()
    assert len(trims) == 2  # one malloc_trim after each large body read
    return events


def test_a_large_body_keeps_its_turn_until_its_route_has_parsed_it() -> None:
    """The second large body is not read while the first waits, unparsed, in its route: at
    most one large body is held unparsed (service/http/guard.py's _read_paced)."""
    events = asyncio.run(_turns_pass_when_parsed())
    assert events == [
        ("route", "first"),
        ("released", "first"),
        ("parsed", "first"),
        ("route", "second"),
        ("parsed", "second"),
    ]
