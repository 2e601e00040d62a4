"""Big jobs go out as chunks over PoolStream and come back whole, in input order.

The real-server tests force streaming with a small ``batch_size`` and compare every output with
the unary one-text-at-a-time result. The fake-server tests check what the real server cannot
show: the client never has more chunks unanswered than the server's ``max_stream_inflight``
allows, reassembles out-of-order answers, and stops the stream on an in-band error.
"""

from __future__ import annotations

import asyncio
import queue
import re
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from pooling_client import AsyncPoolingClient, PoolingClient, PoolingError, _chunking
from pooling_client.v1 import pooling_pb2, pooling_pb2_grpc
from tests.client.in_process import serve_in_process
from tests.server_process import ServerProcess

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"
BATCH = 7
TOPICS = ["cats", "the stock market", "rain in Spain", "quantum computing", "bread"]
TEXTS = [
    f"Sentence {i} is about {TOPICS[i % len(TOPICS)]}" + " and more" * (i % 6) for i in range(103)
]
QUERIES = [f"What about {TOPICS[i % len(TOPICS)]}?" for i in range(len(TEXTS))]


def _max_abs(a: Any, b: Any) -> float:
    return float(np.max(np.abs(np.asarray(a, dtype=np.float64) - np.asarray(b, dtype=np.float64))))


# ---------------------------------------------------------------------------------------------
# Real server
# ---------------------------------------------------------------------------------------------


class StubSpy:
    """Wraps a stub and counts the calls made through each method."""

    def __init__(self, stub: Any) -> None:
        self._stub = stub
        self.calls: Counter[str] = Counter()

    def __getattr__(self, name: str) -> Callable[..., Any]:
        method = getattr(self._stub, name)

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return method(*args, **kwargs)

        def with_call(*args: Any, **kwargs: Any) -> Any:  # unary calls that read trailers
            self.calls[name] += 1
            return method.with_call(*args, **kwargs)

        counted.with_call = with_call  # type: ignore[attr-defined]
        return counted


@pytest.fixture(scope="module")
def unary(server: ServerProcess) -> Iterator[PoolingClient]:
    with PoolingClient(server.address, timeout=60) as pooling_client:
        yield pooling_client


@pytest.fixture(scope="module")
def chunked(server: ServerProcess) -> Iterator[PoolingClient]:
    with PoolingClient(server.address, timeout=60, batch_size=BATCH) as pooling_client:
        spy = StubSpy(pooling_client._stub)
        pooling_client._stub = spy
        yield pooling_client


def _stream_calls(client: PoolingClient) -> int:
    return client._stub.calls["PoolStream"]


def test_embed_streams_in_input_order(unary: PoolingClient, chunked: PoolingClient) -> None:
    before = _stream_calls(chunked)
    outputs = chunked.embed(TEXTS, request_id="job")
    assert _stream_calls(chunked) == before + 1
    assert [o.request_id for o in outputs] == [f"job-{i}" for i in range(len(TEXTS))]
    for text, output in zip(TEXTS, outputs, strict=True):
        (expected,) = unary.embed([text])
        assert _max_abs(output.outputs.embedding, expected.outputs.embedding) <= 1e-5


def test_classify_streams_in_input_order(unary: PoolingClient, chunked: PoolingClient) -> None:
    outputs = chunked.classify(TEXTS, model="tiny-classifier")
    assert len(outputs) == len(TEXTS)
    for text, output in zip(TEXTS, outputs, strict=True):
        (expected,) = unary.classify([text], model="tiny-classifier")
        assert _max_abs(output.outputs.probs, expected.outputs.probs) <= 1e-5
        assert output.outputs.label == expected.outputs.label


def test_score_one_to_many_streams(unary: PoolingClient, chunked: PoolingClient) -> None:
    query = "What do cats eat?"
    outputs = chunked.score(query, TEXTS, model="tiny-cross-encoder", request_id="s")
    assert [o.request_id for o in outputs] == [f"s-{i}" for i in range(len(TEXTS))]
    for doc, output in zip(TEXTS, outputs, strict=True):
        (expected,) = unary.score(query, [doc], model="tiny-cross-encoder")
        assert abs(output.outputs.score - expected.outputs.score) <= 1e-5


def test_score_pairwise_streams(unary: PoolingClient, chunked: PoolingClient) -> None:
    outputs = chunked.score(QUERIES, TEXTS, model="tiny-cross-encoder")
    assert len(outputs) == len(TEXTS)
    for query, doc, output in zip(QUERIES, TEXTS, outputs, strict=True):
        (expected,) = unary.score(query, doc, model="tiny-cross-encoder")
        assert abs(output.outputs.score - expected.outputs.score) <= 1e-5


def test_encode_token_embed_streams(unary: PoolingClient, chunked: PoolingClient) -> None:
    outputs = chunked.encode(TEXTS, pooling_task="token_embed", model="tiny-bert")
    assert len(outputs) == len(TEXTS)
    for text, output in zip(TEXTS, outputs, strict=True):
        (expected,) = unary.encode([text], pooling_task="token_embed", model="tiny-bert")
        assert output.outputs.token_ids == expected.outputs.token_ids
        assert output.outputs.data.shape == expected.outputs.data.shape
        assert _max_abs(output.outputs.data, expected.outputs.data) <= 1e-5


def test_async_embed_streams(server: ServerProcess, unary: PoolingClient) -> None:
    async def main() -> list[Any]:
        async with AsyncPoolingClient(server.address, timeout=60, batch_size=BATCH) as client:
            return await client.embed(TEXTS, request_id="a")

    outputs = asyncio.run(main())
    assert [o.request_id for o in outputs] == [f"a-{i}" for i in range(len(TEXTS))]
    expected = unary.embed(TEXTS[:30])  # unary: 30 fit in one request
    for output, reference in zip(outputs, expected, strict=False):
        assert _max_abs(output.outputs.embedding, reference.outputs.embedding) <= 1e-5
    for i in (30, 64, 102):
        (reference,) = unary.embed([TEXTS[i]])
        assert _max_abs(outputs[i].outputs.embedding, reference.outputs.embedding) <= 1e-5


def test_in_band_error_fails_the_whole_call(server: ServerProcess, chunked: PoolingClient) -> None:
    with pytest.raises(PoolingError) as caught:
        chunked.embed(TEXTS, model="no-such-model")
    assert caught.value.reason == "MODEL_NOT_FOUND"
    assert caught.value.code is grpc.StatusCode.NOT_FOUND

    async def main() -> None:
        async with AsyncPoolingClient(server.address, timeout=60, batch_size=BATCH) as client:
            await client.embed(TEXTS, model="no-such-model")

    with pytest.raises(PoolingError) as caught:
        asyncio.run(main())
    assert caught.value.reason == "MODEL_NOT_FOUND"
    # The client still works after a failed stream.
    assert len(chunked.embed(TEXTS[:20])) == 20


def test_use_tqdm_shows_a_progress_bar(
    chunked: PoolingClient, capsys: pytest.CaptureFixture[str]
) -> None:
    outputs = chunked.embed(TEXTS, use_tqdm=True)
    assert len(outputs) == len(TEXTS)
    assert f"{len(TEXTS)}/{len(TEXTS)}" in capsys.readouterr().err


def test_use_tqdm_without_tqdm_installed(
    chunked: PoolingClient, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # makes the import fail
    assert len(chunked.embed(TEXTS, use_tqdm=True)) == len(TEXTS)
    assert len(chunked.embed(TEXTS[:3], use_tqdm=True)) == 3
    assert f"{len(TEXTS)}/{len(TEXTS)}" not in capsys.readouterr().err


def test_small_inputs_use_unary_pool(server: ServerProcess) -> None:
    with PoolingClient(server.address, timeout=60, batch_size=BATCH) as client:
        spy = StubSpy(client._stub)
        client._stub = spy
        client.embed(TEXTS[:BATCH])
        client.score("q", TEXTS[:BATCH], model="tiny-cross-encoder")
        assert spy.calls == {"Pool": 2}  # no limits fetched, no stream
        client.embed(TEXTS[: BATCH + 1])
        client.embed(TEXTS[:20])
        assert spy.calls == {"Pool": 2, "ListModels": 1, "PoolStream": 2}  # limits cached

    with PoolingClient(server.address, timeout=60) as client:
        spy = StubSpy(client._stub)
        client._stub = spy
        client.embed(TEXTS[: _chunking.STREAM_THRESHOLD])
        assert spy.calls == {"Pool": 1}
        client.embed(TEXTS[:40])  # over the threshold but within max_client_batch_size (64)
        assert spy.calls == {"Pool": 2, "ListModels": 1}
        assert len(client.embed(TEXTS)) == len(TEXTS)
        assert spy.calls == {"Pool": 2, "ListModels": 1, "PoolStream": 1}


# ---------------------------------------------------------------------------------------------
# Fake server: flow control, out-of-order answers, cancellation
# ---------------------------------------------------------------------------------------------


def _error_status(reason: str) -> status_pb2.Status:
    detail = any_pb2.Any()
    detail.Pack(error_details_pb2.ErrorInfo(reason=reason, domain="pooling.v1"))
    return status_pb2.Status(
        code=code_pb2.INVALID_ARGUMENT, message="chunk failed", details=[detail]
    )


@dataclass
class StreamRecord:
    """What one PoolStream saw."""

    request_ids: list[str] = field(default_factory=list)
    chunk_sizes: list[int] = field(default_factory=list)
    max_outstanding: int = 0


class WindowServicer(pooling_pb2_grpc.PoolingServiceServicer):
    """Reads requests eagerly, answers them in bursts in reverse order, tracks the backlog.

    embed of "t<i>" answers [i]; a text "boom" answers that chunk with an in-band error.
    """

    def __init__(self) -> None:
        self.max_client_batch_size = 10
        self.max_stream_inflight = 30
        self.streams: list[StreamRecord] = []

    def ListModels(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pooling_pb2.ListModelsResponse(
            models=[pooling_pb2.ModelCard(name="mini")],
            max_client_batch_size=self.max_client_batch_size,
            max_stream_inflight=self.max_stream_inflight,
        )

    def PoolStream(self, request_iterator: Iterator[Any], context: grpc.ServicerContext) -> Any:
        record = StreamRecord()
        self.streams.append(record)
        lock = threading.Lock()
        outstanding = 0
        inbox: queue.SimpleQueue[pooling_pb2.PoolRequest | None] = queue.SimpleQueue()

        def read() -> None:
            nonlocal outstanding
            try:
                for message in request_iterator:
                    with lock:
                        outstanding += 1
                        record.max_outstanding = max(record.max_outstanding, outstanding)
                        record.request_ids.append(message.request.request_id)
                        record.chunk_sizes.append(len(message.request.embed.texts))
                    inbox.put(message.request)
            except Exception:  # the client cancelled
                pass
            finally:
                inbox.put(None)

        threading.Thread(target=read, daemon=True).start()
        finished = False
        while not finished:
            burst = [inbox.get()]
            time.sleep(0.01)  # give a misbehaving client time to push more
            while True:
                try:
                    burst.append(inbox.get_nowait())
                except queue.Empty:
                    break
            for request in reversed(burst):
                if request is None:
                    finished = True
                    continue
                with lock:
                    outstanding -= 1
                yield self._answer(request)

    @staticmethod
    def _answer(request: pooling_pb2.PoolRequest) -> pooling_pb2.PoolStreamResponse:
        texts = list(request.embed.texts)
        if "boom" in texts:
            return pooling_pb2.PoolStreamResponse(
                request_id=request.request_id, error=_error_status("BOOM")
            )
        embeddings = [pooling_pb2.Embedding(values=[float(text[1:])]) for text in texts]
        return pooling_pb2.PoolStreamResponse(
            request_id=request.request_id,
            response=pooling_pb2.PoolResponse(
                request_id=request.request_id,
                model="mini",
                embed=pooling_pb2.EmbedOutput(embeddings=embeddings),
            ),
        )


@pytest.fixture(scope="module")
def window_server() -> Iterator[tuple[str, WindowServicer]]:
    servicer = WindowServicer()
    with serve_in_process(servicer, workers=8) as address:
        yield address, servicer


def _embed(target: str, use_async: bool, texts: list[str], **kwargs: Any) -> list[Any]:
    batch_size = kwargs.pop("batch_size", None)
    if not use_async:
        with PoolingClient(target, timeout=10, batch_size=batch_size) as client:
            return client.embed(texts, **kwargs)

    async def main() -> list[Any]:
        async with AsyncPoolingClient(target, timeout=10, batch_size=batch_size) as client:
            return await client.embed(texts, **kwargs)

    return asyncio.run(main())


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize(
    ("batch_size", "server_batch", "server_inflight", "chunk", "window"),
    [
        (None, 10, 30, 10, 3),
        (4, 10, 30, 4, 7),
        (50, 10, 30, 10, 3),
        (None, 10, 5, 10, 1),
        (3, 10, 0, 3, _chunking.DEFAULT_CHUNKS_IN_FLIGHT),
    ],
)
def test_chunks_in_flight_stay_within_the_window(
    window_server: tuple[str, WindowServicer],
    use_async: bool,
    batch_size: int | None,
    server_batch: int,
    server_inflight: int,
    chunk: int,
    window: int,
) -> None:
    target, servicer = window_server
    servicer.max_client_batch_size = server_batch
    servicer.max_stream_inflight = server_inflight
    texts = [f"t{i}" for i in range(157)]
    outputs = _embed(target, use_async, texts, batch_size=batch_size, request_id="w")

    assert [o.outputs.embedding for o in outputs] == [[float(i)] for i in range(len(texts))]
    assert [o.request_id for o in outputs] == [f"w-{i}" for i in range(len(texts))]
    record = servicer.streams[-1]
    chunks = -(-len(texts) // chunk)
    assert sorted(record.request_ids, key=lambda rid: int(rid[2:])) == [
        f"w-{k}" for k in range(chunks)
    ]
    assert record.chunk_sizes == [chunk] * (chunks - 1) + [len(texts) - chunk * (chunks - 1)]
    assert record.max_outstanding <= window
    assert record.max_outstanding >= min(window, 2)  # several chunks really were in flight


@pytest.mark.parametrize("use_async", [False, True], ids=["sync", "async"])
def test_in_band_error_cancels_the_stream(
    window_server: tuple[str, WindowServicer], use_async: bool
) -> None:
    target, servicer = window_server
    servicer.max_client_batch_size, servicer.max_stream_inflight = 10, 30
    texts = [f"t{i}" for i in range(1000)]
    texts[15] = "boom"
    with pytest.raises(PoolingError) as caught:
        _embed(target, use_async, texts)
    assert caught.value.reason == "BOOM"
    assert caught.value.code is grpc.StatusCode.INVALID_ARGUMENT
    # Requests are built lazily and the stream stops at the error: few of 100 chunks went out.
    assert len(servicer.streams[-1].request_ids) <= 6


def test_stream_transport_error_maps_to_pooling_error(
    window_server: tuple[str, WindowServicer],
) -> None:
    target, servicer = window_server
    servicer.max_client_batch_size, servicer.max_stream_inflight = 10, 30
    with PoolingClient(target, timeout=10) as client:
        client.models()  # caches the limits
        with pytest.raises(PoolingError) as caught:
            client.embed([f"t{i}" for i in range(100)], timeout=0.001)
    assert caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED


# ---------------------------------------------------------------------------------------------
# The pure chunking logic
# ---------------------------------------------------------------------------------------------


def test_chunk_size_and_window() -> None:
    limits = _chunking.StreamLimits(max_client_batch_size=64, max_stream_inflight=256)
    assert _chunking.chunk_size(None, limits) == 64
    assert _chunking.chunk_size(7, limits) == 7
    assert _chunking.chunk_size(1000, limits) == 64
    assert _chunking.chunk_size(None, _chunking.StreamLimits()) == _chunking.DEFAULT_CHUNK_SIZE
    assert _chunking.chunks_in_flight(64, limits) == 4
    assert _chunking.chunks_in_flight(7, limits) == 36
    assert _chunking.chunks_in_flight(300, limits) == 1
    assert _chunking.needs_limits(32, None) is False
    assert _chunking.needs_limits(33, None) is True
    assert _chunking.needs_limits(7, 7) is False
    assert _chunking.needs_limits(8, 7) is True
    with pytest.raises(ValueError):
        _chunking.check_batch_size(0)
    with pytest.raises(TypeError):
        _chunking.check_batch_size(2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PoolingClient("127.0.0.1:1", batch_size=-1)


def test_score_chunks_follow_the_input_shape() -> None:
    one_to_many = (["q"], ["d0", "d1", "d2", "d3", "d4"])
    assert _chunking.input_count("score", one_to_many) == 5
    assert list(_chunking.iter_chunks("score", one_to_many, 2)) == [
        (0, (["q"], ["d0", "d1"])),
        (2, (["q"], ["d2", "d3"])),
        (4, (["q"], ["d4"])),
    ]
    pairwise = (["q0", "q1", "q2"], ["d0", "d1", "d2"])
    assert list(_chunking.iter_chunks("score", pairwise, 2)) == [
        (0, (["q0", "q1"], ["d0", "d1"])),
        (2, (["q2"], ["d2"])),
    ]
    assert _chunking.input_count("score", (["a", "b"], ["c", "d", "e"])) is None
    template = pooling_pb2.PoolRequest(request_id="r")
    limits = _chunking.StreamLimits(2, 4)
    assert _chunking.plan("score", (["a", "b"], ["c", "d", "e"]), template, 2, limits) is None
    assert _chunking.plan("embed", ["a", "b"], template, 2, limits) is None
    job = _chunking.plan("score", pairwise, template, 2, limits)
    assert job is not None and (job.size, job.window) == (2, 2)


def test_chunked_job_rejects_bad_answers() -> None:
    template = pooling_pb2.PoolRequest(request_id="r")
    job = _chunking.ChunkedJob("embed", ["a", "b", "c"], template, size=2, window=1)
    (first,) = job.fill()
    assert first.request.request_id == "r-0"
    assert job.fill() == []  # the window is full
    assert job.in_flight == 1
    with pytest.raises(ValueError, match="not in flight"):
        job.accept(pooling_pb2.PoolStreamResponse(request_id="r-9"))
    with pytest.raises(ValueError, match="no result"):
        job.accept(pooling_pb2.PoolStreamResponse(request_id="r-0"))
    with pytest.raises(ValueError, match="unanswered"):
        job.outputs()


def test_request_ids_inside_a_stream_are_unique() -> None:
    template = pooling_pb2.PoolRequest(request_id="base")
    job = _chunking.ChunkedJob("embed", [str(i) for i in range(25)], template, size=4, window=100)
    ids = [request.request.request_id for request in job.fill()]
    assert job.exhausted
    assert len(set(ids)) == len(ids) == 7
    assert all(re.fullmatch(r"base-\d+", rid) for rid in ids)
