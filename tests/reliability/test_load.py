"""Many concurrent streams and unary callers: every answer correct, none missing or repeated.

Texts come from a small vocabulary whose embeddings are computed once, one text per
request, before the load; every embedding under load must equal its reference.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np
import pytest

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.conftest import DEFAULT_MODEL
from tests.reliability.support import assert_alive, embed_request, report, same_vector, vector
from tests.server_process import ServerProcess, running_server

STREAMS = 200
ITEMS_PER_STREAM = 50
# A few streams carry more unanswered texts than --max-stream-inflight (256): flow control.
BIG_STREAMS = 20
BIG_STREAM_ITEMS = 200
UNARY_CALLERS = 16
CALLS_PER_CALLER = 60
CHANNELS = 4
VOCABULARY = 200
DEFAULT_VOCABULARY = 40  # the slower default model sees only these texts
DEFAULT_SHARE = 0.1  # of requests; the rest go to the tiny model
TIME_LIMIT_S = 240.0

WORDS = [
    "pooling",
    "queue",
    "batch",
    "vector",
    "token",
    "stream",
    "model",
    "server",
    "client",
    "deadline",
    "cancel",
    "padding",
    "encoder",
    "sentence",
    "embedding",
    "score",
    "label",
    "matrix",
    "request",
    "response",
    "health",
    "metric",
]


def vocabulary() -> list[str]:
    rng = random.Random(7)
    return [
        f"text {i}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
        for i in range(VOCABULARY)
    ]


@pytest.fixture(scope="module")
def load_server(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ["--model", DEFAULT_MODEL, "--model", f"tiny={model_folders['tiny-bert']}"]
    args += ["--dtype", "float32", "--max-client-batch-size", "64"]
    yield from running_server(args, tmp_path_factory.mktemp("load"), "load")


def references(server: ServerProcess, texts: list[str]) -> dict[tuple[str, str], np.ndarray]:
    """(model, text) -> the embedding of that text sent alone."""
    found = {}
    with grpc.insecure_channel(server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        for model, vocab in (("tiny", texts), (DEFAULT_MODEL, texts[:DEFAULT_VOCABULARY])):
            for text in vocab:
                found[model, text] = vector(stub.Pool(embed_request([text], model), timeout=60))
    return found


@dataclass
class Tally:
    """One kind of caller's requests, checked against the references of the vocabulary."""

    texts: list[str]
    refs: dict[tuple[str, str], np.ndarray]
    requests: int = 0
    items: int = 0
    failures: list[str] = field(default_factory=list)

    def check(self, where: str, request: pb.PoolRequest, response: pb.PoolResponse) -> None:
        self.requests += 1
        texts = list(request.embed.texts)
        self.items += len(texts)
        if response.request_id != request.request_id or len(response.embed.embeddings) != len(
            texts
        ):
            self.failures.append(f"{where}: wrong id or count for {request.request_id}")
            return
        for i, text in enumerate(texts):
            if not same_vector(vector(response, i), self.refs[request.model, text]):
                self.failures.append(f"{where}: {request.request_id} text {i} differs")


def random_request(
    rng: random.Random, request_id: str, texts: list[str], max_texts: int
) -> pb.PoolRequest:
    if rng.random() < DEFAULT_SHARE:
        model, vocab = DEFAULT_MODEL, texts[:DEFAULT_VOCABULARY]
    else:
        model, vocab = "tiny", texts
    chosen = [rng.choice(vocab) for _ in range(rng.randint(1, max_texts))]
    return embed_request(chosen, model, request_id)


async def run_stream(stub: pooling_pb2_grpc.PoolingServiceStub, index: int, tally: Tally) -> None:
    rng = random.Random(1000 + index)
    count = BIG_STREAM_ITEMS if index < BIG_STREAMS else ITEMS_PER_STREAM
    requests = {
        f"s{index}-{k}": random_request(rng, f"s{index}-{k}", tally.texts, 3) for k in range(count)
    }

    async def send() -> AsyncIterator[pb.PoolStreamRequest]:
        for request in requests.values():
            yield pb.PoolStreamRequest(request=request)

    answered: Counter[str] = Counter()
    try:
        async for message in stub.PoolStream(send(), timeout=TIME_LIMIT_S):
            answered[message.request_id] += 1
            if message.WhichOneof("result") != "response":
                tally.failures.append(f"stream {index}: {message.request_id} failed: {message}")
            elif message.request_id in requests:
                tally.check(f"stream {index}", requests[message.request_id], message.response)
    except grpc.RpcError as error:
        tally.failures.append(f"stream {index} ended with {error.code()}: {error.details()}")
    missing = set(requests) - set(answered)
    repeated = [rid for rid, n in answered.items() if n > 1]
    unknown = set(answered) - set(requests)
    if missing or repeated or unknown:
        tally.failures.append(
            f"stream {index}: missing {sorted(missing)[:5]} ({len(missing)}), "
            f"repeated {repeated[:5]}, unknown {sorted(unknown)[:5]}"
        )


async def run_unary_caller(
    stub: pooling_pb2_grpc.PoolingServiceStub, index: int, tally: Tally
) -> None:
    rng = random.Random(5000 + index)
    for k in range(CALLS_PER_CALLER):
        request = random_request(rng, f"u{index}-{k}", tally.texts, 4)
        try:
            response = await stub.Pool(request, timeout=60)
        except grpc.RpcError as error:
            tally.failures.append(f"unary {request.request_id}: {error.code()}")
            continue
        tally.check(f"unary {index}", request, response)


async def run_load(
    address: str, texts: list[str], refs: dict[tuple[str, str], np.ndarray]
) -> tuple[Tally, Tally]:
    channels = [grpc.aio.insecure_channel(address) for _ in range(CHANNELS)]
    stubs = [pooling_pb2_grpc.PoolingServiceStub(channel) for channel in channels]
    streams, unary = Tally(texts, refs), Tally(texts, refs)
    try:
        jobs = [run_stream(stubs[i % CHANNELS], i, streams) for i in range(STREAMS)]
        jobs += [run_unary_caller(stubs[i % CHANNELS], i, unary) for i in range(UNARY_CALLERS)]
        await asyncio.wait_for(asyncio.gather(*jobs), TIME_LIMIT_S)
    finally:
        for channel in channels:
            await channel.close()
    return streams, unary


def test_concurrent_streams_and_unary_callers(load_server: ServerProcess, record_property) -> None:
    texts = vocabulary()
    started = time.monotonic()
    refs = references(load_server, texts)
    reference_s = time.monotonic() - started

    started = time.monotonic()
    streams, unary = asyncio.run(run_load(load_server.address, texts, refs))
    seconds = time.monotonic() - started
    failures = streams.failures + unary.failures
    requests = streams.requests + unary.requests
    report(
        record_property,
        "load",
        requests=requests,
        streams=STREAMS,
        stream_requests=streams.requests,
        unary_requests=unary.requests,
        items=streams.items + unary.items,
        failures=len(failures),
        seconds=seconds,
        requests_per_s=requests / seconds,
        reference_s=reference_s,
    )
    assert not failures, "\n".join(failures[:20])
    assert streams.requests == (
        BIG_STREAMS * BIG_STREAM_ITEMS + (STREAMS - BIG_STREAMS) * ITEMS_PER_STREAM
    )
    assert unary.requests == UNARY_CALLERS * CALLS_PER_CALLER
    assert_alive(load_server)
