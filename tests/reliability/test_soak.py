"""About two minutes of mixed load; the server's memory must not keep growing.

Unary embed, score and token_embed calls, streams (some cut mid-way), invalid requests
and cancelled calls run side by side. The server tree's RSS (supervisor, engine and front
end together) is sampled twice a second; from the end of the warm-up to the end, its
fitted trend must grow less than 10%.

The engine's RSS climbs while it meets new batches (allocator high-water marks, oneDNN's
caches per shape), then holds: over 300 s alone, 636 MB at 10 s and 715-750 MB from 60 s
on. That climb is counted in requests, not seconds, so the warm-up and the measured window
are both: on a busy machine the soak runs longer rather than measure the climb.
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
from tests.reliability.support import (
    CLIENT_ERROR_CODES,
    assert_alive,
    check_success,
    documented_error,
    embed_request,
    report,
    same_vector,
    vector,
)
from tests.rpc_errors import decode_rpc_error, decode_status
from tests.server_process import ServerProcess, process_tree, running_server

WARM_UP_S = 40.0  # and at least WARM_UP_REQUESTS answered
WARM_UP_REQUESTS = 4_000
SOAK_S = 120.0  # in all, warm-up included, and at least MEASURED_REQUESTS after it
MEASURED_REQUESTS = 4_000
MAX_SOAK_S = 300.0  # however slow the machine
SAMPLE_EVERY_S = 0.5
MAX_GROWTH = 0.10
UNARY_WORKERS = 6
STREAM_WORKERS = 3
REFERENCE_TEXT = "the soak reference sentence"
# Codes a worker expects; anything else is a failure.
EXPECTED = {"OK", "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "CANCELLED"}


@pytest.fixture(scope="module")
def soak_server(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ["--model", DEFAULT_MODEL, "--model", f"tiny={model_folders['tiny-bert']}"]
    args += ["--dtype", "float32"]
    yield from running_server(args, tmp_path_factory.mktemp("soak"), "soak")


# Single-token words and a few lengths: batches take a bounded set of shapes, all seen
# during the warm-up. Per-shape caches (oneDNN primitives, allocator high-water marks) then
# stop growing, and what growth is left comes from the requests themselves.
WORDS = ["memory", "growth", "vector", "queue", "stream", "cancel", "token", "server", "batch"]
TEXT_WORDS = (6, 14, 30, 62)


def some_text(rng: random.Random) -> str:
    return " ".join(rng.choices(WORDS, k=rng.choice(TEXT_WORDS)))


def random_call(rng: random.Random) -> tuple[str, pb.PoolRequest]:
    """A kind of call and its request."""
    kind = rng.choice(
        ["embed", "embed", "embed_default", "score", "token_embed", "invalid", "cancel"]
    )
    texts = [some_text(rng) for _ in range(rng.randint(1, 8))]
    if kind == "embed":
        return kind, embed_request(texts, "tiny")
    if kind in ("embed_default", "cancel"):
        return kind, embed_request(texts, DEFAULT_MODEL)
    if kind == "score":
        model = rng.choice(["tiny", DEFAULT_MODEL])
        score = pb.ScoreInput(text_1=texts[:1], text_2=texts)
        return kind, pb.PoolRequest(model=model, score=score)
    if kind == "token_embed":
        return kind, pb.PoolRequest(model="tiny", token_embed=pb.TextInput(texts=texts))
    bad = rng.choice(
        [
            embed_request(texts, "no-such-model"),
            embed_request(texts, "tiny", dimensions=7),
            embed_request([], "tiny"),
            pb.PoolRequest(model="tiny", classify=pb.TextInput(texts=texts)),
            embed_request(["word " * 1000], DEFAULT_MODEL),
        ]
    )
    return kind, bad


@dataclass
class Soak:
    started: float = field(default_factory=time.monotonic)
    codes: Counter[str] = field(default_factory=Counter)
    requests: int = 0
    stream_items: int = 0
    failures: list[str] = field(default_factory=list)
    warmed_s: float | None = None  # when the warm-up ended, since `started`
    warmed_requests: int = 0

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def warmed(self) -> bool:
        """Whether the warm-up is over (it ends at the first call that finds it so)."""
        if self.warmed_s is None:
            if self.elapsed() < WARM_UP_S or self.requests < WARM_UP_REQUESTS:
                return False
            self.warmed_s, self.warmed_requests = self.elapsed(), self.requests
        return True

    def running(self) -> bool:
        elapsed = self.elapsed()
        if elapsed >= MAX_SOAK_S:
            return False
        measured = self.requests - self.warmed_requests
        return not self.warmed() or elapsed < SOAK_S or measured < MEASURED_REQUESTS

    def note(self, code: str, what: str) -> None:
        self.requests += 1
        self.codes[code] += 1
        if code not in EXPECTED:
            self.failures.append(f"{what}: {code}")


async def unary_worker(
    stub: pooling_pb2_grpc.PoolingServiceStub, index: int, soak: Soak, reference: np.ndarray
) -> None:
    rng = random.Random(index)
    while soak.running():
        kind, request = random_call(rng)
        call = stub.Pool(request, timeout=60)
        if kind == "cancel":
            await asyncio.sleep(rng.uniform(0, 0.05))
            call.cancel()
        try:
            response = await call
        except asyncio.CancelledError:
            soak.note("CANCELLED", kind)
            continue
        except grpc.RpcError as error:
            soak.note(error.code().name, kind)  # type: ignore[attr-defined]
            if kind == "invalid":
                problem = documented_error(decode_rpc_error(error), CLIENT_ERROR_CODES)
                if problem:
                    soak.failures.append(f"invalid request: {problem}")
            elif kind != "cancel":
                soak.failures.append(f"{kind} failed: {error}")
            continue
        soak.note("OK", kind)
        if kind == "invalid":
            soak.failures.append(f"invalid request succeeded: {request}")
        else:
            check_success(request, response)
    response = await stub.Pool(embed_request([REFERENCE_TEXT], "tiny"), timeout=60)
    if not same_vector(vector(response), reference):
        soak.failures.append("the reference embedding changed")


async def stream_worker(stub: pooling_pb2_grpc.PoolingServiceStub, index: int, soak: Soak) -> None:
    rng = random.Random(100 + index)
    rounds = 0
    while soak.running():
        rounds += 1
        requests = {}
        for k in range(rng.randint(10, 60)):
            kind, request = random_call(rng)
            if kind == "cancel":
                kind, request = "embed", embed_request([some_text(rng)], "tiny")
            request.request_id = f"w{index}-{rounds}-{k}"
            requests[request.request_id] = (kind, request)
        cut = rng.random() < 0.2

        async def send(items: dict = requests) -> AsyncIterator[pb.PoolStreamRequest]:
            for _, request in items.values():
                yield pb.PoolStreamRequest(request=request)

        call = stub.PoolStream(send(), timeout=120)
        answered = 0
        try:
            async for message in call:
                answered += 1
                kind, request = requests[message.request_id]
                if message.WhichOneof("result") == "error":
                    soak.note(code_name(message.error.code), f"stream {kind}")
                    problem = documented_error(decode_status(message.error), CLIENT_ERROR_CODES)
                    if kind != "invalid" or problem:
                        soak.failures.append(f"stream {kind} failed: {problem or message.error}")
                else:
                    soak.note("OK", f"stream {kind}")
                    check_success(request, message.response)
                if cut and answered >= len(requests) // 2:
                    call.cancel()
                    break
        except grpc.RpcError as error:
            soak.note(error.code().name, "stream")  # type: ignore[attr-defined]
        soak.stream_items += answered
        if not cut and answered != len(requests):
            soak.failures.append(f"stream {index}/{rounds}: {answered} of {len(requests)}")


def code_name(value: int) -> str:
    return next(c.name for c in grpc.StatusCode if c.value[0] == value)


@dataclass
class Memory:
    """RSS samples (seconds since the start, bytes), and threads and fds after warm-up/at end."""

    samples: list[tuple[float, int]] = field(default_factory=list)
    processes: int = 0
    threads: list[int] = field(default_factory=list)
    fds: list[int] = field(default_factory=list)

    def measured(self, since: float) -> tuple[np.ndarray, np.ndarray]:
        """The samples from `since` (the end of the warm-up) on."""
        t = np.array([t for t, _ in self.samples if t >= since])
        rss = np.array([r for t, r in self.samples if t >= since], dtype=np.float64)
        return t, rss

    def fitted(self, since: float) -> tuple[float, float]:
        """The least-squares line through the samples after warm-up, at its two ends.

        RSS under load swings by +-15% with the batches in flight (activations are
        allocated and freed per forward pass), and even between calls it moves by ~10%
        with what the allocator keeps; two single readings would drown a 10% bound. The
        trend over ~200 readings is steady to about 2%, and a leak shows as its slope.
        """
        t, rss = self.measured(since)
        slope, intercept = np.polyfit(t, rss, 1)
        return intercept + slope * t[0], intercept + slope * t[-1]


async def sample_memory(pid: int, soak: Soak, memory: Memory) -> None:
    """The server tree's totals: a supervisor, its engine and its front end (a split
    server holds the models and the clients' messages in its children, not in the pid)."""
    tree = process_tree(pid)
    memory.processes = len(tree)
    while soak.running():
        memory.samples.append((soak.elapsed(), sum(p.memory_info().rss for p in tree)))
        if soak.warmed() and not memory.threads:
            memory.threads.append(sum(p.num_threads() for p in tree))
            memory.fds.append(sum(p.num_fds() for p in tree))
        await asyncio.sleep(SAMPLE_EVERY_S)
    memory.threads.append(sum(p.num_threads() for p in tree))
    memory.fds.append(sum(p.num_fds() for p in tree))


async def run_soak(server: ServerProcess) -> tuple[Soak, Memory]:
    pid = server.process.pid
    async with grpc.aio.insecure_channel(server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        reference = vector(await stub.Pool(embed_request([REFERENCE_TEXT], "tiny"), timeout=60))
        soak, memory = Soak(), Memory()
        jobs = [unary_worker(stub, i, soak, reference) for i in range(UNARY_WORKERS)]
        jobs += [stream_worker(stub, i, soak) for i in range(STREAM_WORKERS)]
        jobs.append(sample_memory(pid, soak, memory))
        await asyncio.wait_for(asyncio.gather(*jobs), MAX_SOAK_S + 120)
        return soak, memory


def test_soak_memory_is_stable(soak_server: ServerProcess, record_property) -> None:
    started = time.monotonic()
    soak, memory = asyncio.run(run_soak(soak_server))
    seconds = time.monotonic() - started
    assert soak.warmed_s is not None, f"the warm-up never ended: {soak.requests} requests"
    start, end = memory.fitted(soak.warmed_s)
    growth = (end - start) / start
    _, rss = memory.measured(soak.warmed_s)
    window = max(1, len(rss) // 8)
    mib = 1 << 20
    report(
        record_property,
        "soak",
        seconds=seconds,
        requests=soak.requests,
        stream_items=soak.stream_items,
        codes=dict(soak.codes),
        failures=len(soak.failures),
        warm_up_s=soak.warmed_s,
        warm_up_requests=soak.warmed_requests,
        processes=memory.processes,
        rss_start_mib=start / mib,
        rss_end_mib=end / mib,
        growth_pct=100 * growth,
        rss_samples=len(rss),
        rss_first_median_mib=float(np.median(rss[:window])) / mib,
        rss_last_median_mib=float(np.median(rss[-window:])) / mib,
        rss_min_mib=float(rss.min()) / mib,
        rss_max_mib=float(rss.max()) / mib,
        threads="->".join(map(str, memory.threads)),
        fds="->".join(map(str, memory.fds)),
    )
    assert not soak.failures, "\n".join(soak.failures[:20])
    assert soak.codes["OK"] > 0 and soak.codes["CANCELLED"] > 0
    assert len(rss) > 50, "too few RSS samples for a trend"
    assert memory.processes == soak_server.tree_size(), "the server's every process is measured"
    assert growth < MAX_GROWTH, f"RSS grew {100 * growth:.1f}% (fitted) after the warm-up"
    assert memory.threads[-1] <= memory.threads[0] + 4
    assert memory.fds[-1] <= memory.fds[0] + 16
    assert_alive(soak_server)
