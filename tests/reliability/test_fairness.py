"""Fairness between clients: one greedy client cannot take the queue from a polite one.

A real split server with a small queue (--max-queued-items 128, and the default share per
client: a quarter of it, 32 items). The greedy client floods it from one connection, with
many concurrent calls and streams each asking for far more than its share, and retries a
refusal at once rather than after the RetryInfo delay. A polite client on a connection of
its own and the attack kit's bystander must see every call succeed, within a second,
while the greedy one is told QUEUE_FULL about its own share. Over HTTP the client is the
peer address: the greedy client sends from 127.0.0.2, the polite one from 127.0.0.3. Each
test prints one RELIABILITY line, with the server tree's extra RSS.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
import pytest

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.reliability.attack_kit import QUICK_BYSTANDER, Watch, watching
from tests.reliability.support import (
    assert_alive,
    check_rpc_error,
    check_status,
    check_success,
    embed_request,
    report,
)
from tests.rpc_errors import DecodedError
from tests.server_process import ServerProcess, free_port, start_server

# quiet: times a bystander, so `make test` runs it with nothing beside it
pytestmark = [pytest.mark.timeout(120), pytest.mark.quiet]

MAX_QUEUED_ITEMS = 128
MAX_CLIENT_BATCH = 16  # so the default share is a quarter of the queue, not one request
SHARE = MAX_QUEUED_ITEMS // 4
ATTACK_S = 4.0
GREEDY_CALLS = 16  # concurrent unary calls on the greedy connection
GREEDY_STREAMS = 2  # and streams beside them
GREEDY_STREAM_WINDOW = 16  # requests unanswered per stream: 256 items, --max-stream-inflight
GREEDY_RETRY_S = 0.02  # it ignores RetryInfo (1 s) and comes back at once
POLITE_TEXTS = 4
POLITE = QUICK_BYSTANDER  # the polite client's slowest call: a bystander's 1 s target
TEXT = " ".join(["river mountain city light paper music"] * 8)  # about 50 tokens


@pytest.fixture(scope="module")
def server(model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    http_port = free_port()
    args = ["--model", f"tiny-bert={model_folders['tiny-bert']}", "--dtype", "float32"]
    args += ["--max-queued-items", str(MAX_QUEUED_ITEMS)]
    args += ["--max-client-batch-size", str(MAX_CLIENT_BATCH), "--http-port", str(http_port)]
    process = start_server(args, tmp_path_factory.mktemp("fairness"), "fairness")
    try:
        yield process, http_port
    finally:
        process.stop(signal.SIGTERM, timeout=10)


@dataclass
class Tally:
    """What one client saw: outcomes by code, its slowest success, what was wrong."""

    outcomes: Counter[str] = field(default_factory=Counter)
    slowest_s: float = 0.0
    problems: list[str] = field(default_factory=list)
    refusal_checked: bool = False

    def ok(self, started: float) -> None:
        self.outcomes["OK"] += 1
        self.slowest_s = max(self.slowest_s, time.monotonic() - started)


def _greedy_request(n: int) -> pb.PoolRequest:
    return embed_request([TEXT] * MAX_CLIENT_BATCH, request_id=f"greedy-{n}")


def _check_share_refusal(decoded: DecodedError, tally: Tally) -> None:
    """The greedy client is refused for its own share (not a full queue), told when to retry;
    every refusal's reason is checked, its details once."""
    if decoded.reason != "QUEUE_FULL":
        tally.problems.append(f"greedy refused with {decoded.reason}: {decoded.message}")
    if tally.refusal_checked:
        return
    tally.refusal_checked = True
    assert decoded.info is not None  # check_rpc_error / check_status saw to it
    if decoded.info.metadata.get("max_queued_items_per_client") != str(SHARE):
        tally.problems.append(f"not refused for its share: {decoded.message}")
    if decoded.retry is None or decoded.retry.retry_delay.ToTimedelta().total_seconds() <= 0:
        tally.problems.append("QUEUE_FULL without a RetryInfo delay")


async def _greedy_grpc(address: str, end: float) -> Tally:
    tally = Tally()
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        numbers = iter(range(10**9))

        async def caller() -> None:
            while time.monotonic() < end:
                started = time.monotonic()
                try:
                    await stub.Pool(_greedy_request(next(numbers)), timeout=10)
                    tally.ok(started)
                except grpc.aio.AioRpcError as error:
                    decoded = check_rpc_error(error, [grpc.StatusCode.RESOURCE_EXHAUSTED])
                    tally.outcomes[decoded.reason or error.code().name] += 1
                    _check_share_refusal(decoded, tally)
                    await asyncio.sleep(GREEDY_RETRY_S)

        async def streamer() -> None:
            # Unanswered requests are capped here too, or gRPC's buffers would hold many
            # seconds of them when the attack ends; the cap is still 8 times the share.
            window = asyncio.Semaphore(GREEDY_STREAM_WINDOW)

            async def requests() -> AsyncIterator[pb.PoolStreamRequest]:
                while time.monotonic() < end:
                    await window.acquire()
                    yield pb.PoolStreamRequest(request=_greedy_request(next(numbers)))

            async for response in stub.PoolStream(requests(), timeout=ATTACK_S + 10):
                window.release()
                if response.HasField("error"):
                    decoded = check_status(response.error, [grpc.StatusCode.RESOURCE_EXHAUSTED])
                    tally.outcomes[f"stream {decoded.reason}"] += 1
                    _check_share_refusal(decoded, tally)
                else:
                    tally.outcomes["stream OK"] += 1

        await asyncio.gather(
            *(caller() for _ in range(GREEDY_CALLS)), *(streamer() for _ in range(GREEDY_STREAMS))
        )
    return tally


async def _polite_grpc(address: str, end: float) -> Tally:
    tally = Tally()
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        n = 0
        while time.monotonic() < end:
            request = embed_request([f"polite text {n}"] * POLITE_TEXTS, request_id=f"polite-{n}")
            started = time.monotonic()
            try:
                check_success(request, await stub.Pool(request, timeout=5))
                tally.ok(started)
            except grpc.aio.AioRpcError as error:
                tally.outcomes[error.code().name] += 1
                tally.problems.append(f"polite call failed: {error.details()}")
            n += 1
    return tally


def _run(*clients: Coroutine[Any, Any, Tally]) -> list[Tally]:
    """Run the clients' coroutines together on a loop of their own thread."""
    results: list[Tally] = []

    async def main() -> None:
        results.extend(await asyncio.gather(*clients))

    thread = threading.Thread(target=asyncio.run, args=(main(),), name="clients")
    thread.start()
    thread.join(ATTACK_S + 60)
    assert not thread.is_alive(), "the clients did not finish"
    return results


def _assert_fair(greedy: Tally, polite: Tally) -> None:
    assert not greedy.problems, greedy.problems
    refused = sum(n for code, n in greedy.outcomes.items() if "QUEUE_FULL" in code)
    assert refused > 0, f"the greedy client was never held to its share: {greedy.outcomes}"
    served = greedy.outcomes["OK"] + greedy.outcomes["stream OK"]
    assert served > 0, "the greedy client still gets its share served"
    _assert_polite_served(polite)


def _assert_polite_served(polite: Tally) -> None:
    assert not polite.problems, polite.problems
    # How many calls fit in the window depends on the machine's load; that all succeed does not.
    assert polite.outcomes["OK"] >= 3 and set(polite.outcomes) == {"OK"}, polite.outcomes
    POLITE.check(polite.slowest_s, "a polite call")


def _report(record_property, name: str, greedy: Tally, polite: Tally, watch: Watch) -> None:
    report(
        record_property,
        name,
        greedy=dict(greedy.outcomes),
        polite_calls=polite.outcomes["OK"],
        polite_max_s=polite.slowest_s,
        polite_target_s=POLITE.target_s,
        **watch.figures(),
    )


def test_a_greedy_grpc_connection_leaves_the_polite_one_served(
    server: tuple[ServerProcess, int], record_property
) -> None:
    process, _ = server
    with watching(process) as watch:
        started = time.monotonic()
        end = started + ATTACK_S
        greedy, polite = _run(
            _greedy_grpc(process.address, end), _polite_grpc(process.address, end)
        )
        watch.answer_s = time.monotonic() - started
    _report(record_property, "fairness_grpc", greedy, polite, watch)
    _assert_fair(greedy, polite)
    watch.assert_unharmed()
    assert_alive(process)


async def _http_client(
    url: str, source: str, end: float, texts: list[str], concurrency: int, polite: bool
) -> Tally:
    """`concurrency` loops posting embeddings from the address `source`."""
    tally = Tally()
    connector = aiohttp.TCPConnector(local_addr=(source, 0), limit=concurrency)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def loop() -> None:
            while time.monotonic() < end:
                started = time.monotonic()
                async with session.post(url, json={"input": texts}) as response:
                    body = await response.json()
                if response.status == 200:
                    assert len(body["data"]) == len(texts)
                    tally.ok(started)
                    continue
                code = body.get("error", {}).get("code") or str(response.status)
                tally.outcomes[f"{response.status} {code}"] += 1
                if polite or response.status != 429 or "Retry-After" not in response.headers:
                    tally.problems.append(f"{source}: {response.status} {body}")
                await asyncio.sleep(GREEDY_RETRY_S)

        await asyncio.gather(*(loop() for _ in range(concurrency)))
    return tally


def test_a_greedy_http_address_leaves_the_polite_one_served(
    server: tuple[ServerProcess, int], record_property
) -> None:
    process, http_port = server
    url = f"http://127.0.0.1:{http_port}/v1/embeddings"
    with watching(process) as watch:
        started = time.monotonic()
        end = started + ATTACK_S
        greedy, polite = _run(
            _http_client(url, "127.0.0.2", end, [TEXT] * MAX_CLIENT_BATCH, GREEDY_CALLS, False),
            _http_client(url, "127.0.0.3", end, ["polite text"] * POLITE_TEXTS, 1, True),
        )
        watch.answer_s = time.monotonic() - started
    _report(record_property, "fairness_http", greedy, polite, watch)
    assert not greedy.problems, greedy.problems
    refused = sum(n for code, n in greedy.outcomes.items() if code.startswith("429"))
    assert refused > 0, f"the greedy address was never held to its share: {greedy.outcomes}"
    _assert_polite_served(polite)
    watch.assert_unharmed()
    assert_alive(process)
