"""Observability: Prometheus metrics, timing trailers, OpenTelemetry spans, request logs."""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.models.loader import ModelSpec
from pooling_server.service.ops.config import ServerConfig
from pooling_server.service.server import PoolingServer
from tests.conftest import DEFAULT_MODEL
from tests.metrics_endpoint import scrape
from tests.server_process import ServerProcess, free_port, running_server, start_server
from tests.service.mixed_requests import text_request
from tests.service.test_request_path import REQUEST_LOGGER, Log, Stub, quiet_workload, wait_for

T = TypeVar("T")

SERVER_SPAN = "pooling.v1.PoolingService/Pool"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
SECRET = "xylophonequagmire"
TRAILER_KEYS = (
    "x-total-time-ms",
    "x-tokenization-time-ms",
    "x-queue-time-ms",
    "x-inference-time-ms",
    "x-prompt-tokens",
)


def embed_request(*texts: str, request_id: str = "", model: str = "") -> pb.PoolRequest:
    return pb.PoolRequest(request_id=request_id, model=model, embed=pb.TextInput(texts=texts))


def traceparent(trace_id: str = TRACE_ID, span_id: str = PARENT_SPAN_ID) -> tuple[str, str]:
    return ("traceparent", f"00-{trace_id}-{span_id}-01")


def tiny_bert_args(model_folders: dict[str, Path]) -> list[str]:
    return ["--model", f"tiny-bert={model_folders['tiny-bert']}", "--dtype", "float32"]


# --------------------------------------------------------------------------- metrics


@dataclass
class Workload:
    prompt_tokens: int
    scraped: dict[str, list[Any]]  # sample name -> samples

    def samples(self, name: str, **labels: str) -> list[Any]:
        return [
            s
            for s in self.scraped.get(name, [])
            if all(s.labels.get(k) == v for k, v in labels.items())
        ]

    def value(self, name: str, **labels: str) -> float:
        found = self.samples(name, **labels)
        assert len(found) == 1, (name, labels, found)
        return found[0].value

    def series(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        return {tuple(sorted(s.labels.items())): s.value for s in self.scraped.get(name, [])}


@pytest.fixture(scope="module")
def workload(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Workload]:
    """A fresh default-model server, a known workload, then one scrape of /metrics."""
    metrics_port = free_port()
    process = start_server(
        ["--metrics-port", str(metrics_port), "--dtype", "float32"],
        tmp_path_factory.mktemp("metrics-logs"),
        "metrics",
    )
    try:
        prompt_tokens = 0
        with grpc.insecure_channel(process.address) as channel:
            stub = pooling_pb2_grpc.PoolingServiceStub(channel)
            for i in range(3):
                response = stub.Pool(
                    embed_request(f"first text {i}", f"a second, longer text number {i}"),
                    timeout=30,
                )
                assert len(response.embed.embeddings) == 2
                prompt_tokens += response.usage.prompt_tokens
            classify = pb.PoolRequest(classify=pb.TextInput(texts=["not an embedding model"]))
            with pytest.raises(grpc.RpcError) as caught:
                stub.Pool(classify, timeout=30)
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            with pytest.raises(grpc.RpcError) as caught:
                stub.Pool(embed_request("hello", model="no-such-model"), timeout=30)
            assert caught.value.code() == grpc.StatusCode.NOT_FOUND
            stream = [
                pb.PoolStreamRequest(request=embed_request("streamed text", request_id="s-ok")),
                pb.PoolStreamRequest(
                    request=embed_request("x", request_id="s-bad", model="no-such-model")
                ),
            ]
            answers = {r.request_id: r for r in stub.PoolStream(iter(stream), timeout=30)}
            assert answers["s-ok"].WhichOneof("result") == "response"
            assert answers["s-bad"].error.code == grpc.StatusCode.NOT_FOUND.value[0]
            prompt_tokens += answers["s-ok"].response.usage.prompt_tokens
        yield Workload(prompt_tokens, _settled_scrape(metrics_port, EMBEDDED_TEXTS))
    finally:
        process.stop(signal.SIGTERM)


# The texts the workload above embeds successfully: 3 requests of 2, and 1 streamed.
EMBEDDED_TEXTS = 7
# The engine process publishes its queue and batch figures every 0.25 s
# (service/split/engine_process.py): a scrape right after the last answer may predate them.
SETTLE_S = 5.0


def _settled_scrape(metrics_port: int, texts: int) -> dict[str, list[Any]]:
    """/metrics once the engine's figures include every embedded text (or SETTLE_S passed,
    and the tests say what is missing)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        samples = scrape(metrics_port)
        batched = sum(s.value for s in samples.get("pooling_batch_size_sum", []))
        if batched >= texts or time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def test_requests_total_by_rpc_task_model_and_code(workload: Workload) -> None:
    assert workload.series("pooling_requests_total") == {
        (
            ("code", "OK"),
            ("model", DEFAULT_MODEL),
            ("protocol", "grpc"),
            ("rpc", "Pool"),
            ("task", "embed"),
        ): 3.0,
        (
            ("code", "FAILED_PRECONDITION"),
            ("model", DEFAULT_MODEL),
            ("protocol", "grpc"),
            ("rpc", "Pool"),
            ("task", "classify"),
        ): 1.0,
        (
            ("code", "NOT_FOUND"),
            ("model", "unknown"),
            ("protocol", "grpc"),
            ("rpc", "Pool"),
            ("task", "embed"),
        ): 1.0,
        (
            ("code", "OK"),
            ("model", DEFAULT_MODEL),
            ("protocol", "grpc"),
            ("rpc", "PoolStream"),
            ("task", "embed"),
        ): 1.0,
        (
            ("code", "NOT_FOUND"),
            ("model", "unknown"),
            ("protocol", "grpc"),
            ("rpc", "PoolStream"),
            ("task", "embed"),
        ): 1.0,
    }


def test_items_and_prompt_tokens_count_successful_requests_only(workload: Workload) -> None:
    assert workload.prompt_tokens > 0
    assert workload.series("pooling_items_total") == {
        (("model", DEFAULT_MODEL), ("task", "embed")): float(EMBEDDED_TEXTS)
    }
    assert workload.series("pooling_prompt_tokens_total") == {
        (("model", DEFAULT_MODEL), ("task", "embed")): float(workload.prompt_tokens)
    }


def test_latency_histograms(workload: Workload) -> None:
    count = "pooling_request_seconds_count"
    assert workload.value(count, rpc="Pool", model=DEFAULT_MODEL) == 4
    assert workload.value(count, rpc="Pool", model="unknown") == 1
    assert workload.value(count, rpc="PoolStream", model=DEFAULT_MODEL) == 1
    assert workload.value(count, rpc="PoolStream", model="unknown") == 1
    assert workload.value("pooling_tokenize_seconds_count", model=DEFAULT_MODEL) == 4
    # One queue wait per embedded text.
    assert workload.value("pooling_queue_seconds_count", model=DEFAULT_MODEL) == EMBEDDED_TEXTS
    batches = workload.value("pooling_batch_size_count", model=DEFAULT_MODEL)
    assert workload.value("pooling_inference_seconds_count", model=DEFAULT_MODEL) == batches
    # Every histogram's +Inf bucket equals its count.
    inf = workload.samples(
        "pooling_request_seconds_bucket", rpc="Pool", model=DEFAULT_MODEL, le="+Inf"
    )
    assert [s.value for s in inf] == [4.0]


def test_batch_metrics(workload: Workload) -> None:
    batches = workload.value("pooling_batch_size_count", model=DEFAULT_MODEL)
    assert 0 < batches <= EMBEDDED_TEXTS  # texts of different lengths may go in separate batches
    assert workload.value("pooling_batch_size_sum", model=DEFAULT_MODEL) == EMBEDDED_TEXTS
    assert workload.value("pooling_batch_tokens_count", model=DEFAULT_MODEL) == batches
    real = workload.value("pooling_batch_real_tokens_total", model=DEFAULT_MODEL)
    padded = workload.value("pooling_batch_padded_tokens_total", model=DEFAULT_MODEL)
    assert real == workload.prompt_tokens
    assert padded >= real
    assert workload.value("pooling_batch_tokens_sum", model=DEFAULT_MODEL) == padded
    assert not workload.samples("pooling_failed_batches_total")


def test_engine_gauges(workload: Workload) -> None:
    assert workload.series("pooling_queue_depth") == {(("model", DEFAULT_MODEL),): 0.0}
    assert workload.value("pooling_models_loaded") == 1
    assert workload.series("pooling_dropped_items_total") == {
        (("model", DEFAULT_MODEL), ("reason", "cancelled")): 0.0,
        (("model", DEFAULT_MODEL), ("reason", "expired")): 0.0,
    }


# --------------------------------------------------------------------------- JSON logs


@pytest.fixture(scope="module")
def json_server(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from running_server(
        [*tiny_bert_args(model_folders), "--log-format", "json", "--log-requests"],
        tmp_path_factory.mktemp("json-logs"),
        "json",
    )


@pytest.fixture(scope="module")
def json_inputs_server(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    yield from running_server(
        [*tiny_bert_args(model_folders), "--log-format", "json", "--log-inputs", "--log-requests"],
        tmp_path_factory.mktemp("json-input-logs"),
        "json-inputs",
    )


def assert_holds(found: dict[str, Any], expected: dict[str, Any]) -> None:
    """Each of `expected`'s keys has its value in `found`; a failure shows every one."""
    assert {key: found.get(key, "(absent)") for key in expected} == expected


def pool(
    server: ServerProcess, request: pb.PoolRequest, metadata: tuple[tuple[str, str], ...] = ()
) -> tuple[pb.PoolResponse, grpc.Call]:
    with grpc.insecure_channel(server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        return stub.Pool.with_call(request, timeout=30, metadata=metadata)


def test_trailing_metadata_on_unary_pool(json_server: ServerProcess) -> None:
    response, call = pool(json_server, embed_request("timings please", "and a second text"))
    trailers = dict(call.trailing_metadata())
    assert set(TRAILER_KEYS) <= set(trailers), trailers
    values = {key: float(trailers[key]) for key in TRAILER_KEYS}
    assert all(value >= 0 for value in values.values()), values
    assert int(trailers["x-prompt-tokens"]) == response.usage.prompt_tokens > 0
    assert values["x-total-time-ms"] >= values["x-inference-time-ms"]
    assert values["x-total-time-ms"] >= values["x-tokenization-time-ms"]
    assert values["x-inference-time-ms"] > 0


def test_json_request_log_line_without_inputs(json_server: ServerProcess) -> None:
    response, _ = pool(
        json_server,
        embed_request(f"the {SECRET} is here", "another text", request_id="log-1"),
        metadata=(traceparent(),),
    )
    # Every line of the log is JSON, not only the request lines.
    log = json_server.log()
    assert all(json.loads(line) for line in log.splitlines() if line.strip())
    [line] = json_server.request_log("log-1")
    expected = {"rpc": "Pool", "model": "tiny-bert", "task": "embed", "code": "OK", "reason": ""}
    assert_holds(line, {**expected, "items": 2, "prompt_tokens": response.usage.prompt_tokens})
    for key in ("total_ms", "tokenize_ms", "queue_ms", "inference_ms"):
        assert isinstance(line[key], int | float) and line[key] >= 0, (key, line)
    assert line["total_ms"] >= line["inference_ms"]
    # Log lines carry the caller's trace id even without an exporter configured.
    assert line["trace_id"] == TRACE_ID
    assert "texts" not in line
    assert SECRET not in log


def test_json_request_log_line_for_a_failure(json_server: ServerProcess) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        pool(json_server, embed_request("x", request_id="log-fail", model="no-such-model"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    [line] = json_server.request_log("log-fail")
    assert (line["code"], line["model"], line["items"]) == ("NOT_FOUND", "unknown", 0)
    assert line["reason"]


def test_log_requests_writes_one_line_per_request(json_server: ServerProcess) -> None:
    """Every call of a mixed workload (unary, stream, a failure, ListModels, Tokenize) gets
    exactly one request line. The module's other tests share this server, so only the lines
    after a marker call's own are counted: the log is written through one queue, in order."""
    log = Log(json_server)
    with grpc.insecure_channel(json_server.address) as channel:
        stub = Stub(channel)
        stub.Pool(text_request("embed", "loud-mark", ["before the workload"]), timeout=30)
        wait_for(
            lambda: any(line.get("request_id") == "loud-mark" for line in log.lines()),
            "the marker's log line",
        )
        start = log.end()
        rids = quiet_workload(stub, "loud")
        with pytest.raises(grpc.RpcError) as caught:
            stub.Pool(text_request("embed", "loud-missing", ["x"], "no-such-model"), timeout=30)
        assert caught.value.code() == grpc.StatusCode.NOT_FOUND
        stub.Pool(text_request("embed", "loud-last", ["the last one"]), timeout=30)

    def request_lines() -> list[dict[str, Any]]:
        return [line for line in log.lines(start) if line.get("logger") == REQUEST_LOGGER]

    # Lines are written in order through one queue: once the last is there, all are.
    wait_for(
        lambda: any(line.get("request_id") == "loud-last" for line in request_lines()),
        "the last request's log line",
    )
    lines = request_lines()
    by_id: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        by_id.setdefault(line.get("request_id", ""), []).append(line)
    # ListModels and Tokenize go through the runner too; their messages carry no id.
    assert sorted(line["rpc"] for line in by_id.pop("", [])) == ["ListModels", "Tokenize"]
    assert sorted(by_id) == sorted([*rids, "loud-missing", "loud-last"])
    assert all(len(found) == 1 for found in by_id.values()), by_id
    for rid in rids:
        [line] = by_id[rid]
        assert line["message"] == "request"
        assert line["rpc"] == ("PoolStream" if "-stream-" in rid else "Pool")
        assert (line["code"], line["model"], line["task"], line["items"]) == (
            "OK",
            "tiny-bert",
            "embed",
            1,
        )
        assert line["prompt_tokens"] > 0
        assert line["trace_id"] == TRACE_ID
    [missing] = by_id["loud-missing"]
    assert (missing["code"], missing["model"]) == ("NOT_FOUND", "unknown")


def test_json_request_log_line_with_inputs(json_inputs_server: ServerProcess) -> None:
    texts = (f"the {SECRET} is here", "another text")
    pool(json_inputs_server, embed_request(*texts, request_id="log-2"))
    [line] = json_inputs_server.request_log("log-2")
    assert line["code"] == "OK"
    assert line["texts"] == list(texts)
    assert SECRET in json_inputs_server.log()


# --------------------------------------------------------------------------- tracing


class LoopThread:
    """An asyncio loop in a background thread, running the in-process server."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def run(self, coroutine: Coroutine[Any, Any, T], timeout: float = 120) -> T:
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@dataclass
class Traced:
    exporter: InMemorySpanExporter
    address: str

    def pool(
        self, request: pb.PoolRequest, metadata: tuple[tuple[str, str], ...] = ()
    ) -> pb.PoolResponse:
        self.exporter.clear()
        with grpc.insecure_channel(self.address) as channel:
            stub = pooling_pb2_grpc.PoolingServiceStub(channel)
            return stub.Pool(request, timeout=30, metadata=metadata)

    def stream(
        self, requests: list[pb.PoolRequest], metadata: tuple[tuple[str, str], ...] = ()
    ) -> list[pb.PoolStreamResponse]:
        self.exporter.clear()
        messages = [pb.PoolStreamRequest(request=request) for request in requests]
        with grpc.insecure_channel(self.address) as channel:
            stub = pooling_pb2_grpc.PoolingServiceStub(channel)
            return list(stub.PoolStream(iter(messages), timeout=30, metadata=metadata))

    def spans(self) -> dict[str, ReadableSpan]:
        finished = self.exporter.get_finished_spans()
        by_name = {span.name: span for span in finished}
        assert len(by_name) == len(finished), [span.name for span in finished]
        return by_name


@pytest.fixture(scope="module")
def traced(model_folders: dict[str, Path]) -> Iterator[Traced]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    config = ServerConfig(
        models=[ModelSpec(source=str(model_folders["tiny-bert"]), name="tiny-bert")],
        port=0,
        device="cpu",
        dtype="float32",
        shutdown_grace_s=5,
    )
    loop = LoopThread()

    async def start() -> PoolingServer:
        server = PoolingServer(config, tracer_provider=provider)
        await server.start()
        return server

    server = loop.run(start())
    try:
        yield Traced(exporter, f"127.0.0.1:{server.port}")
    finally:
        loop.run(server.stop())
        loop.close()
        provider.shutdown()


def test_server_span_continues_the_callers_trace(traced: Traced) -> None:
    response = traced.pool(
        embed_request("trace me", "and me", request_id="trace-1"), metadata=(traceparent(),)
    )
    spans = traced.spans()
    assert set(spans) == {SERVER_SPAN, "tokenize", "queue", "forward"}
    server = spans[SERVER_SPAN]
    assert server.kind == SpanKind.SERVER
    assert format(server.context.trace_id, "032x") == TRACE_ID
    assert server.parent is not None and server.parent.is_remote
    assert format(server.parent.span_id, "016x") == PARENT_SPAN_ID
    assert server.status.status_code != StatusCode.ERROR
    expected = {"rpc.system": "grpc", "rpc.method": "Pool", "pooling.request_id": "trace-1"}
    expected |= {"pooling.model": "tiny-bert", "pooling.items": 2}
    expected["pooling.prompt_tokens"] = response.usage.prompt_tokens
    assert_holds(dict(server.attributes or {}), expected)
    for name in ("tokenize", "queue", "forward"):
        child = spans[name]
        assert child.context.trace_id == server.context.trace_id, name
        assert child.parent is not None and child.parent.span_id == server.context.span_id, name
        assert child.start_time is not None and child.end_time is not None
        assert child.start_time <= child.end_time, name
        assert server.start_time is not None and server.end_time is not None
        # Children lie within the server span (1 ms slack for the clock conversion).
        assert child.start_time >= server.start_time - 1_000_000, name
        assert child.end_time <= server.end_time + 1_000_000, name


def test_server_span_is_a_root_without_traceparent(traced: Traced) -> None:
    traced.pool(embed_request("no parent"))
    spans = traced.spans()
    server = spans[SERVER_SPAN]
    assert server.parent is None
    assert format(server.context.trace_id, "032x") != TRACE_ID
    for name in ("tokenize", "queue", "forward"):
        assert spans[name].parent is not None
        assert spans[name].parent.span_id == server.context.span_id


def test_failed_request_span_has_error_status(traced: Traced) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        traced.pool(embed_request("x", model="no-such-model"), metadata=(traceparent(),))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    spans = traced.spans()
    assert set(spans) == {SERVER_SPAN}  # nothing was tokenized, queued or computed
    server = spans[SERVER_SPAN]
    assert server.status.status_code == StatusCode.ERROR
    assert dict(server.attributes or {})["rpc.grpc.status_code"] == "NOT_FOUND"
    assert format(server.context.trace_id, "032x") == TRACE_ID


def test_malformed_traceparent_starts_a_new_trace(traced: Traced) -> None:
    traced.pool(embed_request("bad header"), metadata=(("traceparent", "00-not-a-trace-01"),))
    server = traced.spans()[SERVER_SPAN]
    assert server.parent is None
    assert server.context.trace_id != 0


def test_stream_requests_each_get_a_server_span_in_the_callers_trace(traced: Traced) -> None:
    responses = traced.stream(
        [embed_request("one", request_id="a"), embed_request("two", "three", request_id="b")],
        metadata=(traceparent(),),
    )
    assert sorted(r.request_id for r in responses) == ["a", "b"]
    finished = traced.exporter.get_finished_spans()
    servers = [span for span in finished if span.name == "pooling.v1.PoolingService/PoolStream"]
    assert sorted(dict(s.attributes or {})["pooling.request_id"] for s in servers) == ["a", "b"]
    for server in servers:
        assert server.kind == SpanKind.SERVER
        assert format(server.context.trace_id, "032x") == TRACE_ID
        assert server.parent is not None
        assert format(server.parent.span_id, "016x") == PARENT_SPAN_ID
        children = [
            span.name
            for span in finished
            if span.parent is not None and span.parent.span_id == server.context.span_id
        ]
        assert sorted(children) == ["forward", "queue", "tokenize"]
    assert len(finished) == 2 * 4
