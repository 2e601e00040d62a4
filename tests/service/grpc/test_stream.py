"""PoolStream over real servers: ids, in-band errors, cancellation, flow control, backpressure.

Most tests use the session `server` with the raw generated `stub` (a sync stream-stream
call fed by a request iterator). Flow control and the queue bound need their own
settings: a second real server started with `--max-stream-inflight 4 --max-queued-items 4`,
and one in-process server whose forward pass the test holds, so it can count exactly
how many stream requests the servicer started while nothing could be answered.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.models.loader import ModelSpec
from pooling_server.service.ops.config import ServerConfig
from pooling_server.service.server import PoolingServer
from tests.responses import assert_same_response
from tests.rpc_errors import DecodedError, decode_rpc_error, decode_status
from tests.server_process import ServerProcess, running_server

pytestmark = pytest.mark.timeout(180)

Stub = pooling_pb2_grpc.PoolingServiceStub
WAIT_S = 30.0
WORDS = "the quick brown fox jumps over a lazy dog near the river bank today"
LIMIT = 4  # --max-stream-inflight and --max-queued-items of the limited server


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


def stream(stub: Stub, requests: Iterable[pb.PoolRequest]) -> list[pb.PoolStreamResponse]:
    messages = (pb.PoolStreamRequest(request=request) for request in requests)
    return list(stub.PoolStream(messages, timeout=60))


def text_request(case: str, rid: str, texts: Sequence[str], model: str = "", **params: Any):
    return pb.PoolRequest(
        request_id=rid,
        model=model,
        params=pb.PoolingParams(**params),
        **{case: pb.TextInput(texts=texts)},
    )


def embed(rid: str, *texts: str, model: str = "tiny-bert") -> pb.PoolRequest:
    return text_request("embed", rid, texts, model)


def unary_error(stub: Stub, request: pb.PoolRequest) -> DecodedError:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Pool(request, timeout=30)
    return decode_rpc_error(caught.value)


def assert_same_error(got: DecodedError, want: DecodedError) -> None:
    assert (got.code, got.reason, got.message) == (want.code, want.reason, want.message)
    assert got.fields == want.fields
    assert got.info is not None and want.info is not None
    assert got.info.domain == want.info.domain == "pooling.v1"
    assert dict(got.info.metadata) == dict(want.info.metadata)
    assert (got.retry is None) == (want.retry is None)


def by_id(responses: Sequence[pb.PoolStreamResponse]) -> dict[str, pb.PoolStreamResponse]:
    ids = [r.request_id for r in responses]
    assert len(set(ids)) == len(ids), f"an id was answered twice: {sorted(ids)}"
    return {r.request_id: r for r in responses}


def mixed_requests(count: int) -> list[pb.PoolRequest]:
    words = WORDS.split()

    def texts(i: int) -> list[str]:
        return [" ".join(words[: 1 + (i * 7 + k * 3) % len(words)]) for k in range(1 + i % 3)]

    requests = []
    for i in range(count):
        rid, kind = f"mixed-{i}", i % 6
        if kind == 0:
            requests.append(text_request("embed", rid, texts(i), "tiny-bert"))
        elif kind == 1:
            requests.append(text_request("embed", rid, texts(i), "tiny-bert", use_activation=False))
        elif kind == 2:
            requests.append(text_request("token_embed", rid, texts(i), "tiny-bert"))
        elif kind == 3:
            requests.append(text_request("classify", rid, texts(i), "tiny-classifier"))
        elif kind == 4:
            requests.append(text_request("token_classify", rid, texts(i), "tiny-ner"))
        else:
            docs = texts(i)
            score = pb.ScoreInput(text_1=["where is the river"], text_2=docs)
            requests.append(pb.PoolRequest(request_id=rid, model="tiny-cross-encoder", score=score))
    return requests


# ---------------------------------------------------------------------------------------
# The session server
# ---------------------------------------------------------------------------------------


def test_every_id_is_answered_once_as_unary_would(stub: Stub) -> None:
    requests = mixed_requests(36)
    responses = by_id(stream(stub, requests))

    assert set(responses) == {r.request_id for r in requests}
    for request in requests:
        answer = responses[request.request_id]
        assert answer.WhichOneof("result") == "response", answer.error.message
        assert_same_response(answer.response, stub.Pool(request, timeout=30))


def test_a_large_answer_on_a_stream_equals_the_unary_one(stub: Stub) -> None:
    """token_embed of long texts (over 100k values: built off the event loop, unary as wire
    bytes, on a stream as the message inside its PoolStreamResponse)."""
    request = text_request("token_embed", "large", ["a long text of many words " * 40] * 4)
    [answer] = stream(stub, [request])
    assert answer.WhichOneof("result") == "response", answer.error.message
    unary = stub.Pool(request, timeout=30)
    assert sum(len(m.values) for m in unary.token_embed.items) > 100_000
    assert_same_response(answer.response, unary)


def test_invalid_requests_get_in_band_errors_and_the_stream_goes_on(stub: Stub) -> None:
    bad = {
        "bad-empty": pb.PoolRequest(
            request_id="bad-empty", model="tiny-bert", embed=pb.TextInput()
        ),
        "bad-model": embed("bad-model", "hello", model="no-such-model"),
        "bad-task": text_request("classify", "bad-task", ["hello"], "tiny-bert"),
        "bad-param": text_request("embed", "bad-param", ["hello"], "tiny-bert", dimensions=8),
        "bad-long": embed("bad-long", "hello " * 300),
    }
    good = [embed(f"good-{i}", f"text number {i}") for i in range(4)]
    requests = [good[0], bad["bad-empty"], good[1], bad["bad-model"], bad["bad-task"]]
    requests += [good[2], bad["bad-param"], bad["bad-long"], good[3]]

    responses = by_id(stream(stub, requests))

    assert set(responses) == {r.request_id for r in requests}
    for request in good:
        assert responses[request.request_id].WhichOneof("result") == "response"
    for rid, request in bad.items():
        answer = responses[rid]
        assert answer.WhichOneof("result") == "error", rid
        assert_same_error(decode_status(answer.error), unary_error(stub, request))
    assert decode_status(responses["bad-empty"].error).fields == ["embed.texts"]
    assert decode_status(responses["bad-model"].error).reason == "MODEL_NOT_FOUND"


def test_missing_and_duplicate_request_ids_are_in_band_errors(stub: Stub) -> None:
    requests = [
        embed("first", "alpha"),
        embed("", "no id at all"),
        embed("first", "the same id again"),
        embed("second", "beta"),
    ]
    responses = stream(stub, requests)

    assert len(responses) == len(requests)
    answers = [r for r in responses if r.WhichOneof("result") == "response"]
    # Errors about a stream message carry no request_id, so the duplicate's error is never
    # taken for the answer to "first"; the field path names the message.
    errors = [r for r in responses if r.HasField("error")]
    assert sorted(r.request_id for r in answers) == ["first", "second"]
    assert [r.request_id for r in errors] == ["", ""]
    decoded = {decode_status(r.error).reason: decode_status(r.error) for r in errors}
    for index, reason in ((1, "REQUEST_ID_MISSING"), (2, "REQUEST_ID_DUPLICATE")):
        error = decoded[reason]
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT
        assert error.fields == [f"messages[{index}].request.request_id"]
    duplicate = next(r.error for r in errors if decode_status(r.error).reason.endswith("DUPLICATE"))
    assert decode_status(duplicate).info.metadata["request_id"] == "first"
    first = next(r for r in answers if r.request_id == "first")
    assert_same_response(first.response, stub.Pool(requests[0], timeout=30))


def test_empty_stream_completes_ok(stub: Stub) -> None:
    call = stub.PoolStream(iter(()), timeout=30)
    assert list(call) == []
    assert call.code() == grpc.StatusCode.OK


def test_client_cancel_mid_stream_leaves_the_server_healthy(
    stub: Stub, server: ServerProcess
) -> None:
    log_start = len(server.log())
    release = threading.Event()

    def requests() -> Iterator[pb.PoolStreamRequest]:
        yield pb.PoolStreamRequest(request=embed("quick", "answered first"))
        for i in range(6):  # enough work to still be queued or running at the cancel
            texts = [f"busy text {i} {k} " + "word " * 100 for k in range(48)]
            yield pb.PoolStreamRequest(request=embed(f"busy-{i}", *texts))
        release.wait(WAIT_S)  # keep the request side open: the client cancels, not closes

    call = stub.PoolStream(requests(), timeout=60)
    try:
        next(call)
        call.cancel()
        with pytest.raises(grpc.RpcError) as caught:
            list(call)
        assert caught.value.code() == grpc.StatusCode.CANCELLED
    finally:
        release.set()

    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    assert len(stub.Pool(embed("after", "still fine"), timeout=30).embed.embeddings) == 1
    after = stream(stub, [embed("again-1", "one"), embed("again-2", "two")])
    assert sorted(r.request_id for r in after) == ["again-1", "again-2"]
    assert all(r.WhichOneof("result") == "response" for r in after)
    assert "Traceback" not in server.log()[log_start:], server.log()[log_start:]


# ---------------------------------------------------------------------------------------
# A second real server: --max-stream-inflight 4 --max-queued-items 4
# ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def limited(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = ["--model", f"tiny-bert={model_folders['tiny-bert']}", "--dtype", "float32"]
    args += ["--max-stream-inflight", str(LIMIT), "--max-queued-items", str(LIMIT)]
    yield from running_server(args, tmp_path_factory.mktemp("limited"), name="limited")


@pytest.fixture(scope="module")
def limited_stub(limited: ServerProcess) -> Iterator[Stub]:
    with grpc.insecure_channel(limited.address) as channel:
        yield Stub(channel)


def test_limited_server_reports_its_stream_window(limited_stub: Stub) -> None:
    models = limited_stub.ListModels(pb.ListModelsRequest(), timeout=30)
    assert models.max_stream_inflight == LIMIT


def test_full_weight_requests_run_one_at_a_time(limited_stub: Stub) -> None:
    """A request of LIMIT texts fills the window: the next is read only after its answer."""
    requests = []
    for i in range(24):  # long and short requests alternate: a free-running server reorders
        size = 100 if i % 2 == 0 else 1
        texts = [f"request {i} text {k} " + "word " * size for k in range(LIMIT)]
        requests.append(embed(f"full-{i}", *texts))

    responses = stream(limited_stub, requests)

    assert [r.request_id for r in responses] == [r.request_id for r in requests]
    assert all(r.WhichOneof("result") == "response" for r in responses)


def test_answers_never_run_ahead_of_the_window(limited_stub: Stub) -> None:
    """Request j is read once at most LIMIT - 1 earlier ones are unanswered, so at least
    j - (LIMIT - 1) answers precede its own."""
    requests = [
        embed(f"one-{i}", f"text {i} " + "word " * (1 + (i * 37) % 110)) for i in range(120)
    ]

    responses = stream(limited_stub, requests)

    positions = {r.request_id: n for n, r in enumerate(responses)}
    assert set(positions) == {r.request_id for r in requests}
    early = [(j, positions[r.request_id]) for j, r in enumerate(requests)]
    early = [(j, at) for j, at in early if at < j - (LIMIT - 1)]
    assert not early, f"(request index, answer position) ahead of the window: {early}"


def test_queue_full_over_grpc_has_retry_info(limited_stub: Stub) -> None:
    request = embed("too-many", *(f"text {i}" for i in range(10)))

    error = unary_error(limited_stub, request)

    assert (error.code, error.reason) == (grpc.StatusCode.RESOURCE_EXHAUSTED, "QUEUE_FULL")
    assert error.retry is not None
    assert error.retry.retry_delay.ToNanoseconds() > 0
    # The same request on a stream: an in-band error, heavier than the whole window yet
    # not stuck, and the stream goes on.
    responses = by_id(stream(limited_stub, [request, embed("fits", "a", "b", "c", "d")]))
    assert_same_error(decode_status(responses["too-many"].error), error)
    assert responses["fits"].WhichOneof("result") == "response"


# ---------------------------------------------------------------------------------------
# An in-process server whose forward pass the test holds: how far does the reader run?
# ---------------------------------------------------------------------------------------


class HeldRunner:
    """Wraps the model runner: no forward pass finishes until `release()`."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.info = inner.info
        self._released = threading.Event()

    def forward(self, batch: Any, keep_tokens: Any, alone: bool = True) -> Any:
        if not self._released.wait(WAIT_S):
            raise RuntimeError("test runner: held too long")
        return self.inner.forward(batch, keep_tokens, alone)

    def warm_up(self, alone: bool = True) -> None:
        self.inner.warm_up(alone)

    def release(self) -> None:
        self._released.set()


async def _wait_until(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.005)


def _reads_while_held(folder: Path, inflight: int, count: int) -> dict[str, Any]:
    """Stream `count` one-text requests (then one of 10 texts) while every forward pass is
    held; report how many the servicer started and the client sent before anything could
    be answered, then release and collect every answer."""

    async def main() -> dict[str, Any]:
        config = ServerConfig(
            models=[ModelSpec(source=str(folder), name="tiny-bert")],
            port=0,
            device="cpu",
            dtype="float32",
            max_stream_inflight=inflight,
            shutdown_grace_s=5,
        )
        server = PoolingServer(config)
        await server.start()
        engine = server.runner.engine
        assert engine is not None
        queue = engine.queues["tiny-bert"]
        held = HeldRunner(queue.runner)
        queue.runner = held  # type: ignore[assignment]  # the worker is idle: safe to swap
        started: list[str] = []
        pool = engine.pool

        async def counting_pool(request: Any, **kwargs: Any) -> Any:
            started.append(request.request_id)
            return await pool(request, **kwargs)

        engine.pool = counting_pool  # type: ignore[method-assign]
        sent = 0

        async def requests() -> Any:
            nonlocal sent
            for i in range(count):
                sent += 1
                yield pb.PoolStreamRequest(request=embed(f"r{i}", f"stream text {i}"))
            sent += 1
            yield pb.PoolStreamRequest(request=embed("heavy", *(f"heavy {k}" for k in range(10))))

        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                call = Stub(channel).PoolStream(requests(), timeout=60)
                answers: list[pb.PoolStreamResponse] = []

                async def read() -> None:
                    async for answer in call:
                        answers.append(answer)

                reader = asyncio.ensure_future(read())
                target = min(inflight, count + 1)
                await _wait_until(lambda: len(started) >= target, f"{target} requests to start")
                await _wait_until(lambda: sent == count + 1, "the client to send everything")
                # Time for a server without flow control to read on (it never may here).
                await asyncio.sleep(0.5)
                result = {"started": len(started), "sent": sent, "answered": len(answers)}
                held.release()
                await asyncio.wait_for(reader, WAIT_S)
                result["answers"] = answers
                return result
        finally:
            held.release()
            await server.stop()

    return asyncio.run(main())


def test_the_reader_stops_at_the_inflight_limit(model_folders: dict[str, Path]) -> None:
    count = 200
    limited = _reads_while_held(model_folders["tiny-bert"], LIMIT, count)
    # Nothing can be answered, so exactly LIMIT one-text requests were started (the next
    # one is read and waits for room) although the client sent all of them.
    assert (limited["started"], limited["answered"]) == (LIMIT, 0), limited
    ids = sorted(a.request_id for a in limited["answers"])
    assert ids == sorted([f"r{i}" for i in range(count)] + ["heavy"])
    assert all(a.WhichOneof("result") == "response" for a in limited["answers"])

    # Control: with a window larger than the stream, the same reader starts everything.
    free = _reads_while_held(model_folders["tiny-bert"], 1000, count)
    assert (free["started"], free["answered"]) == (count + 1, 0), free
