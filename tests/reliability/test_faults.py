"""Faults: cancellation storms, vanishing clients, deadlines shorter than the queue wait, and
failing forward passes. After each, the server answers correctly and its queue drains.
"""

from __future__ import annotations

import asyncio
import random
import select
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.models.loader import ModelSpec
from pooling_server.service.ops.config import ServerConfig
from pooling_server.service.server import PoolingServer
from tests.conftest import DEFAULT_MODEL
from tests.metrics_endpoint import metric_sum, scrape
from tests.reliability.support import (
    assert_alive,
    check_rpc_error,
    check_status,
    embed_request,
    report,
    same_vector,
    vector,
    wait_queue_empty,
)
from tests.server_process import ServerProcess, free_port, process_tree, start_server

# About 210 tokens for the default model (maximum 256): slow enough to keep its queue busy.
LONG = "the queue is busy with long texts " * 30
REFERENCE_TEXT = "a reference sentence that must always embed the same way"
STORM_CALLS = 2000
ABRUPT_STREAMS = 20
DEADLINE_CALLS = 300
STREAM_DEADLINES = 10
MAX_QUEUED_ITEMS = 2000  # per model
SETTLE_S = 3.0  # for the engine's drop counters to reach /metrics
OVERLOAD_CALLS = 300  # of 16 texts: more than twice the queue bound


@dataclass
class Before:
    """The server tree before a fault: its threads, open files and dropped items."""

    threads: int
    fds: int
    dropped: dict[str, float]


@dataclass
class After:
    """Once the fault is over and the queue drained: what it cost, against Before."""

    before: Before
    drain_s: float
    dropped: dict[str, float]  # items dropped since, by reason
    threads: int
    fds: int

    def figures(self) -> dict[str, object]:
        return {
            "drain_s": self.drain_s,
            "dropped_cancelled": self.dropped["cancelled"],
            "dropped_expired": self.dropped["expired"],
            "threads": f"{self.before.threads}->{self.threads}",
            "fds": f"{self.before.fds}->{self.fds}",
        }

    def assert_nothing_leaked(self) -> None:
        assert self.threads <= self.before.threads + 4
        assert self.fds <= self.before.fds + 16


@dataclass
class FaultServer:
    process: ServerProcess
    metrics_port: int
    reference: np.ndarray
    channel: grpc.Channel
    stub: pooling_pb2_grpc.PoolingServiceStub

    def dropped(self, after: dict[str, float] | None = None) -> dict[str, float]:
        """Items dropped so far, by reason. With `after`, once they have moved past it and
        settled (or SETTLE_S passed): the engine process counts a cancelled item when a
        worker next takes a batch, and publishes its counters every 0.25 s, so a scrape
        right after the queue looks empty may not have them yet."""
        deadline = time.monotonic() + SETTLE_S
        counts = self._dropped_now()
        while after is not None and time.monotonic() < deadline:
            time.sleep(0.3)
            again = self._dropped_now()
            if again == counts and counts != after:
                break
            counts = again
        return counts

    def _dropped_now(self) -> dict[str, float]:
        samples = scrape(self.metrics_port)
        return {
            reason: metric_sum(samples, "pooling_dropped_items_total", reason=reason)
            for reason in ("cancelled", "expired")
        }

    def resources(self) -> tuple[int, int]:
        """Threads and open file descriptors over the server tree: the supervisor, and the
        engine and front end (with its Node.js door) under it, where the calls are handled."""
        tree = process_tree(self.process.process.pid)
        assert len(tree) == self.process.tree_size(), "a supervisor, an engine and a front end"
        return sum(p.num_threads() for p in tree), sum(p.num_fds() for p in tree)

    def before(self) -> Before:
        return Before(*self.resources(), self.dropped())

    def after(self, before: Before) -> After:
        """Recovered (a drained queue, a fresh request answered as before), then the drops
        since `before` once settled, and the tree's threads and files."""
        drain_s = self.recovered()
        dropped = self.dropped(after=before.dropped)
        since = {reason: dropped[reason] - before.dropped[reason] for reason in dropped}
        return After(before, drain_s, since, *self.resources())

    def recovered(self) -> float:
        """Wait for an empty queue, then check a fresh request; returns the drain time."""
        drained = wait_queue_empty(self.metrics_port, timeout=30)
        response = self.stub.Pool(embed_request([REFERENCE_TEXT]), timeout=60)
        assert same_vector(vector(response), self.reference)
        assert_alive(self.process)
        return drained


@pytest.fixture(scope="module")
def faults(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[FaultServer]:
    metrics_port = free_port()
    args = ["--model", DEFAULT_MODEL, "--model", f"tiny={model_folders['tiny-bert']}"]
    args += ["--dtype", "float32", "--metrics-port", str(metrics_port)]
    # Every call here shares one connection, which may take the whole queue: these tests are
    # about deadlines and overload, not the share per client (tests/reliability/test_fairness.py).
    args += ["--max-queued-items", str(MAX_QUEUED_ITEMS)]
    args += ["--max-queued-items-per-client", str(MAX_QUEUED_ITEMS)]
    process = start_server(args, tmp_path_factory.mktemp("faults"), "faults")
    channel = grpc.insecure_channel(process.address)
    stub = pooling_pb2_grpc.PoolingServiceStub(channel)
    reference = vector(stub.Pool(embed_request([REFERENCE_TEXT]), timeout=60))
    try:
        yield FaultServer(process, metrics_port, reference, channel, stub)
    finally:
        channel.close()
        process.stop(signal.SIGTERM)


def long_request(n_texts: int, request_id: str = "") -> pb.PoolRequest:
    return embed_request([f"{i} {LONG}" for i in range(n_texts)], request_id=request_id)


def medium_request(n_texts: int, request_id: str = "") -> pb.PoolRequest:
    """About 50 tokens a text: a batch of the default model takes a fraction of a second."""
    return embed_request([f"{i} {LONG[:200]}" for i in range(n_texts)], request_id=request_id)


def codes(futures: list[grpc.Future]) -> Counter[str]:
    found: Counter[str] = Counter()
    for future in futures:
        try:
            future.result(timeout=120)
            found["OK"] += 1
        except grpc.FutureCancelledError:
            found["CANCELLED"] += 1
        except grpc.RpcError as error:
            found[error.code().name] += 1  # type: ignore[attr-defined]
    return found


def test_cancellation_storm(faults: FaultServer, record_property) -> None:
    """Thousands of unary calls cancelled at once or after a few ms, and streams cut mid-way."""
    before = faults.before()
    rng = random.Random(3)
    started = time.monotonic()
    futures, waiting = [], []
    for i in range(STORM_CALLS):
        future = faults.stub.Pool.future(long_request(4), timeout=60)
        futures.append(future)
        if i % 2 == 0:
            future.cancel()
        else:
            waiting.append(future)
        if len(waiting) >= 50:
            time.sleep(rng.uniform(0.001, 0.01))
            for pending in waiting:
                pending.cancel()
            waiting.clear()
    for pending in waiting:
        pending.cancel()
    unary_codes = codes(futures)

    stream_answers = 0
    for s in range(ABRUPT_STREAMS):
        messages = iter(
            [pb.PoolStreamRequest(request=medium_request(4, f"s{s}-{k}")) for k in range(100)]
        )
        call = faults.stub.PoolStream(messages, timeout=60)
        if s % 4 == 1:  # cut after the first answer
            stream_answers += next(call).WhichOneof("result") == "response"
        elif s % 4 >= 2:  # cut while the first requests are queued or running
            time.sleep(rng.uniform(0.02, 0.2))
        call.cancel()
        assert call.code() == grpc.StatusCode.CANCELLED
    storm_s = time.monotonic() - started

    after = faults.after(before)
    report(
        record_property,
        "faults_cancellation_storm",
        calls=STORM_CALLS,
        codes=dict(unary_codes),
        streams=ABRUPT_STREAMS,
        stream_answers=stream_answers,
        seconds=storm_s,
        **after.figures(),
    )
    # A call can also be refused (QUEUE_FULL) before its cancellation lands.
    assert set(unary_codes) <= {"OK", "CANCELLED", "RESOURCE_EXHAUSTED"}, unary_codes
    assert unary_codes["CANCELLED"] >= STORM_CALLS // 2
    assert after.dropped["cancelled"] > 0, "no queued work was dropped"
    after.assert_nothing_leaked()


VANISHING_CLIENT = textwrap.dedent(
    """
    import sys, time, grpc
    from pooling_client.v1 import pooling_pb2 as pb, pooling_pb2_grpc

    long = "the queue is busy with long texts " * 30
    def messages():
        for k in range(50):
            texts = [f"{k} {i} {long}" for i in range(8)]
            yield pb.PoolStreamRequest(
                request=pb.PoolRequest(request_id=f"v{k}", embed=pb.TextInput(texts=texts))
            )
        time.sleep(600)  # keep the stream open until killed

    channel = grpc.insecure_channel(sys.argv[1])
    stub = pooling_pb2_grpc.PoolingServiceStub(channel)
    for answer in stub.PoolStream(messages()):
        print("ANSWER", answer.request_id, flush=True)
    """
)


def test_client_killed_mid_stream(faults: FaultServer, record_property) -> None:
    """A client process opens a stream, sends 50 requests of 8 long texts and is SIGKILLed."""
    before = faults.before()
    client = subprocess.Popen(
        [sys.executable, "-c", VANISHING_CLIENT, faults.process.address],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        assert client.stdout is not None
        ready, _, _ = select.select([client.stdout], [], [], 90)
        assert ready, "the client got no answer within 90 s"
        first = client.stdout.readline()  # the server has answered once
        assert first.startswith("ANSWER"), first
        depth = metric_sum(scrape(faults.metrics_port), "pooling_queue_depth")
        client.send_signal(signal.SIGKILL)
        client.wait(30)
    finally:
        if client.poll() is None:
            client.kill()
            client.wait(30)
    after = faults.after(before)
    report(record_property, "faults_vanished_client", queued_at_kill=int(depth), **after.figures())
    assert depth > 0, "the queue was already empty when the client died: nothing was tested"
    assert after.dropped["cancelled"] > 0, "the dead client's work ran on"
    after.assert_nothing_leaked()


def test_deadlines_shorter_than_the_queue_wait(faults: FaultServer, record_property) -> None:
    before = faults.before()
    rng = random.Random(5)
    busy = [faults.stub.Pool.future(long_request(32), timeout=120) for _ in range(30)]
    try:
        deadline = time.monotonic() + 30
        while metric_sum(scrape(faults.metrics_port), "pooling_queue_depth") < 200:
            assert time.monotonic() < deadline, "the background work never queued"
            time.sleep(0.05)
        started = time.monotonic()
        short = [
            faults.stub.Pool.future(
                embed_request([f"late {i}"], request_id=f"late{i}"),
                timeout=rng.uniform(0.001, 0.02),
            )
            for i in range(DEADLINE_CALLS)
        ]
        late_codes = codes(short)
        seconds = time.monotonic() - started
        stream_codes: Counter[str] = Counter()
        for s in range(STREAM_DEADLINES):
            messages = iter(
                [pb.PoolStreamRequest(request=medium_request(2, f"d{s}-{k}")) for k in range(50)]
            )
            try:
                for answer in faults.stub.PoolStream(messages, timeout=rng.uniform(0.01, 0.3)):
                    if answer.WhichOneof("result") == "error":
                        late = check_status(answer.error, [grpc.StatusCode.DEADLINE_EXCEEDED])
                        stream_codes[f"in-band {late.reason}"] += 1
                    else:
                        stream_codes["in-band OK"] += 1
                stream_codes["stream OK"] += 1
            except grpc.RpcError as error:
                stream_codes[f"stream {error.code().name}"] += 1  # type: ignore[attr-defined]
        unary_errors = []
        for i in range(20):  # and blocking calls, to read the error details
            try:
                faults.stub.Pool(embed_request([f"late blocking {i}"]), timeout=0.02)
            except grpc.RpcError as error:
                unary_errors.append(error.code())  # type: ignore[attr-defined]
    finally:
        for future in busy:
            future.cancel()
    after = faults.after(before)
    report(
        record_property,
        "faults_short_deadlines",
        calls=DEADLINE_CALLS + 20,
        codes=dict(late_codes),
        stream_codes=dict(stream_codes),
        seconds=seconds,
        **after.figures(),
    )
    assert late_codes == {"DEADLINE_EXCEEDED": DEADLINE_CALLS}, late_codes
    assert unary_errors == [grpc.StatusCode.DEADLINE_EXCEEDED] * 20
    assert stream_codes["stream DEADLINE_EXCEEDED"] == STREAM_DEADLINES, stream_codes
    assert sum(after.dropped.values()) > 0
    after.assert_nothing_leaked()


def test_overload_is_refused_with_retry_info(faults: FaultServer, record_property) -> None:
    """More work than --max-queued-items: whole requests refused, documented, then recovery."""
    dropped_before = faults.dropped()
    started = time.monotonic()
    futures = [
        faults.stub.Pool.future(medium_request(16), timeout=60) for _ in range(OVERLOAD_CALLS)
    ]
    # Refusals come back at once: wait until their count holds for a second, then cancel.
    refused, steady_since, peak_depth = 0, time.monotonic(), 0.0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        peak_depth = max(peak_depth, metric_sum(scrape(faults.metrics_port), "pooling_queue_depth"))
        now_refused = sum(f.done() and f.exception() is not None for f in futures)
        if now_refused != refused:
            refused, steady_since = now_refused, time.monotonic()
        elif refused and time.monotonic() - steady_since > 1.0:
            break
        time.sleep(0.1)
    for future in futures:
        future.cancel()
    overload_codes = codes(futures)
    refusals = [
        check_rpc_error(f.exception(), [grpc.StatusCode.RESOURCE_EXHAUSTED])
        for f in futures
        if not f.cancelled() and f.exception() is not None
    ]
    seconds = time.monotonic() - started
    drained_s = faults.recovered()
    dropped = faults.dropped(after=dropped_before)
    report(
        record_property,
        "faults_overload",
        calls=OVERLOAD_CALLS,
        items=OVERLOAD_CALLS * 16,
        max_queued_items=MAX_QUEUED_ITEMS,
        peak_depth=int(peak_depth),
        codes=dict(overload_codes),
        seconds=seconds,
        drain_s=drained_s,
        dropped_cancelled=dropped["cancelled"] - dropped_before["cancelled"],
    )
    assert set(overload_codes) <= {"OK", "CANCELLED", "RESOURCE_EXHAUSTED"}, overload_codes
    assert overload_codes["RESOURCE_EXHAUSTED"] > 0
    assert peak_depth <= MAX_QUEUED_ITEMS
    for refusal in refusals:
        assert refusal.reason == "QUEUE_FULL"
        assert refusal.retry is not None and refusal.retry.retry_delay.ToNanoseconds() > 0


# --------------------------------------------------------------------------- forward failures

POISON = "poison pill"


def test_forward_failure_fails_only_its_requests(
    model_folders: dict[str, Path], record_property
) -> None:
    """In-process server whose runner raises on batches holding the poison text.

    tests/engine/test_batch_queue.py covers the engine; this checks what clients see:
    INTERNAL with ErrorInfo FORWARD_FAILED (RESOURCE_EXHAUSTED OUT_OF_MEMORY for an OOM),
    on unary calls and in-band on a stream, and that later requests succeed.
    """
    config = ServerConfig(
        models=[ModelSpec(str(model_folders["tiny-bert"]), name="tiny")],
        port=0,
        device="cpu",
        dtype="float32",
    )
    failures = {"count": 0}

    async def body() -> None:
        server = PoolingServer(config)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                await check_forward_failures(server, pooling_pb2_grpc.PoolingServiceStub(channel))
        finally:
            await server.stop()

    async def check_forward_failures(
        server: PoolingServer, stub: pooling_pb2_grpc.PoolingServiceStub
    ) -> None:
        assert server.runner.engine is not None
        model = server.runner.engine.model_named("tiny")
        runner, forward = model.runner, model.runner.forward
        poison_ids = tuple(model.tokenizer.tokenize([POISON])[0].input_ids)
        reference = vector(await stub.Pool(embed_request(["healthy text"]), timeout=30))
        message = {"text": "boom: injected kernel failure"}

        def failing_forward(batch, keep_tokens, alone=True):  # type: ignore[no-untyped-def]
            if any(tuple(e.input_ids) == poison_ids for e in batch):
                failures["count"] += 1
                raise RuntimeError(message["text"])
            return forward(batch, keep_tokens, alone)

        runner.forward = failing_forward  # type: ignore[method-assign]

        with pytest.raises(grpc.RpcError) as caught:
            await stub.Pool(embed_request([POISON]), timeout=30)
        error = check_rpc_error(caught.value, [grpc.StatusCode.INTERNAL])
        assert error.reason == "FORWARD_FAILED"
        assert "boom" not in error.message
        after = await stub.Pool(embed_request(["healthy text"]), timeout=30)
        assert same_vector(vector(after), reference)

        # On a stream, one request at a time so each is its own batch.
        call = stub.PoolStream(timeout=30)
        results = {}
        for rid, text in (("ok1", "healthy text"), ("bad", POISON), ("ok2", "healthy text")):
            await call.write(pb.PoolStreamRequest(request=embed_request([text], request_id=rid)))
            answer = await call.read()
            results[answer.request_id] = answer
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        bad = check_status(results["bad"].error, [grpc.StatusCode.INTERNAL])
        assert bad.reason == "FORWARD_FAILED"
        for rid in ("ok1", "ok2"):
            assert same_vector(vector(results[rid].response), reference)

        message["text"] = "CUDA out of memory. Tried to allocate 2.00 GiB"
        with pytest.raises(grpc.RpcError) as caught:
            await stub.Pool(embed_request([POISON]), timeout=30)
        oom = check_rpc_error(caught.value, [grpc.StatusCode.RESOURCE_EXHAUSTED])
        assert oom.reason == "OUT_OF_MEMORY"
        assert oom.retry is not None
        final = await stub.Pool(embed_request(["healthy text", "another"]), timeout=30)
        assert same_vector(vector(final), reference)
        assert server.runner.engine.queues["tiny"].stats.failed_batches == failures["count"]

    asyncio.run(body())
    report(record_property, "faults_forward_failure", failed_batches=failures["count"])
    assert failures["count"] == 3
