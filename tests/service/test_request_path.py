"""The per-request path: quiet by default, observable on request, exact under load.

By default a request creates no span and writes no log line (`--log-requests` brings one
JSON line per request back: tests/service/ops/test_observability.py); a configured tracer
(or `--otlp-endpoint`) brings the spans back. Server-side failures are logged either way.
A burst of 2,000 concurrent calls leaves the Prometheus counters exact, malformed bytes are
rejected on every method of the service, and answers computed in a burst equal the same
requests sent one by one.

Real servers on real ports serve the small fixture models; one more model ("broken")
has a vocabulary smaller than its tokenizer's, so a text with a rare word fails in the
forward pass: a genuine INTERNAL error, without patching the server.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.models.loader import ModelSpec
from pooling_server.service.ops.config import ServerConfig
from pooling_server.service.server import PoolingServer
from tests.conftest import Served, server_args
from tests.fixture_models import short_vocabulary_bert
from tests.metrics_endpoint import metric_sum, scrape
from tests.responses import assert_same_response
from tests.server_process import ServerProcess, free_port, start_server
from tests.service.mixed_requests import (
    MIXED_KINDS,
    Kind,
    mixed_models,
    mixed_requests,
    phrases,
    text_request,
)

pytestmark = pytest.mark.timeout(240)

Stub = pooling_pb2_grpc.PoolingServiceStub
SERVICE = pb.DESCRIPTOR.services_by_name["PoolingService"]
REQUEST_LOGGER = "pooling.requests"
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_SPAN_ID = "00f067aa0ba902b7"
TRACEPARENT = ("traceparent", f"00-{TRACE_ID}-{PARENT_SPAN_ID}-01")
SENTENCE = (
    "the quick brown fox jumps over a lazy dog near the river bank while small birds sing "
    "in tall green trees and an old man reads his newspaper on a wooden bench"
)

phrase = phrases(SENTENCE, most_words=31)
BREAKS_THE_MODEL = "zebra"  # 29145: past the "broken" model's vocabulary (fixture_models)


def tiny_model_args(folders: dict[str, Path]) -> list[str]:
    models = [*mixed_models(folders), Served("broken", str(folders["broken"]))]
    return [*server_args(models), "--dtype", "float32"]


@pytest.fixture(scope="module")
def folders(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    folder = short_vocabulary_bert(tmp_path_factory.mktemp("broken"))
    return {**model_folders, "broken": folder}


# ---------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------


@dataclass
class Log:
    """A server's JSON log, read as whole lines from a byte offset."""

    server: ServerProcess

    def _complete(self) -> bytes:
        data = self.server.log_path.read_bytes()
        return data[: data.rfind(b"\n") + 1]

    def end(self) -> int:
        return len(self._complete())

    def lines(self, start: int = 0, end: int | None = None) -> list[dict[str, Any]]:
        data = self._complete()[start:end]
        return [json.loads(line) for line in data.splitlines() if line.strip()]


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 15.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        result = condition()
        if result:
            return result
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def fail_in_forward(stub: Stub, rid: str) -> None:
    request = text_request("embed", rid, [f"a {BREAKS_THE_MODEL} breaks it"], model="broken")
    with pytest.raises(grpc.RpcError) as caught:
        stub.Pool(request, timeout=30)
    assert caught.value.code() == grpc.StatusCode.INTERNAL


def flush_log(log: Log, stub: Stub, rid: str) -> tuple[int, int]:
    """Fail a request in the forward pass and wait for the error it logs.

    The server logs through one FIFO queue, so once that error is written everything
    logged before the failing call is written too. Returns the log's byte offsets before
    the call and after the error line.
    """
    before = log.end()
    fail_in_forward(stub, rid)

    def error_written() -> int:
        errors = [line for line in log.lines(before) if line["level"] in ("error", "critical")]
        return log.end() if errors else 0

    return before, wait_for(error_written, f"the error logged for {rid}")


def quiet_workload(stub: Stub, prefix: str) -> list[str]:
    """Unary and stream requests (and the other RPCs); returns the Pool request ids."""
    unary = [f"{prefix}-unary-{i}" for i in range(6)]
    for i, rid in enumerate(unary):
        response = stub.Pool(
            text_request("embed", rid, [phrase(i)]), timeout=30, metadata=(TRACEPARENT,)
        )
        assert response.request_id == rid
    streamed = [f"{prefix}-stream-{i}" for i in range(4)]
    messages = [
        pb.PoolStreamRequest(request=text_request("embed", rid, [phrase(i, 1)]))
        for i, rid in enumerate(streamed)
    ]
    answers = list(stub.PoolStream(iter(messages), timeout=30, metadata=(TRACEPARENT,)))
    assert sorted(a.request_id for a in answers) == sorted(streamed)
    assert all(a.WhichOneof("result") == "response" for a in answers)
    stub.ListModels(pb.ListModelsRequest(), timeout=30)
    stub.Tokenize(pb.TokenizeRequest(texts=["tokenize me"]), timeout=30)
    return unary + streamed


# ---------------------------------------------------------------------------------------
# The default server: tiny models, JSON logs, metrics; no --log-requests, no tracing
# ---------------------------------------------------------------------------------------


@dataclass
class Quiet:
    process: ServerProcess
    metrics_port: int
    log: Log = field(init=False)

    def __post_init__(self) -> None:
        self.log = Log(self.process)


@pytest.fixture(scope="module")
def quiet(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Quiet]:
    metrics_port = free_port()
    args = [*tiny_model_args(folders), "--log-format", "json", "--metrics-port", str(metrics_port)]
    process = start_server(args, tmp_path_factory.mktemp("quiet"), "quiet")
    yield Quiet(process, metrics_port)
    process.stop(signal.SIGTERM)


@pytest.fixture(scope="module")
def quiet_stub(quiet: Quiet) -> Iterator[Stub]:
    with grpc.insecure_channel(quiet.process.address) as channel:
        yield Stub(channel)


def test_default_flags_write_no_per_request_log_lines(quiet: Quiet, quiet_stub: Stub) -> None:
    _, start = flush_log(quiet.log, quiet_stub, "flush-before")
    rids = quiet_workload(quiet_stub, "quiet")
    _, end = flush_log(quiet.log, quiet_stub, "flush-after")

    written = quiet.log.lines(start, end)
    raw = json.dumps(written)
    assert not [rid for rid in rids if rid in raw], "a successful request was logged"
    # Nothing at all below warning, but for the failing marker requests' own lines.
    routine = [
        line
        for line in written
        if line["level"] in ("debug", "info")
        and not str(line.get("request_id", "")).startswith("flush-")
    ]
    assert routine == []


def test_server_side_failures_are_still_logged(quiet: Quiet, quiet_stub: Stub) -> None:
    before, after = flush_log(quiet.log, quiet_stub, "internal-1")
    errors = [line for line in quiet.log.lines(before, after) if line["level"] == "error"]
    assert errors
    # The traceback says what broke.
    assert any("index out of range" in json.dumps(line) for line in errors), errors
    # Serving goes on, and the model still answers texts it can read.
    ok = quiet_stub.Pool(text_request("embed", "after-internal", ["warm up"], "broken"), timeout=30)
    assert len(ok.embed.embeddings) == 1


# ---------------------------------------------------------------------------------------
# Metrics under a burst of 2,000 concurrent calls
# ---------------------------------------------------------------------------------------

BURST = 2000


def burst_requests() -> tuple[list[pb.PoolRequest], dict[str, grpc.StatusCode]]:
    requests: list[pb.PoolRequest] = []
    expected: dict[str, grpc.StatusCode] = {}
    for i in range(BURST):
        rid = f"burst-{i}"
        if i % 13 == 5:
            request = pb.PoolRequest(request_id=rid, model="tiny-bert", embed=pb.TextInput())
            code = grpc.StatusCode.INVALID_ARGUMENT  # no texts
        elif i % 13 == 9:
            request = text_request("embed", rid, [phrase(i)], dimensions=8)
            code = grpc.StatusCode.INVALID_ARGUMENT  # not a matryoshka model
        else:
            request = text_request("embed", rid, [phrase(i, k) for k in range(1 + i % 3)])
            code = grpc.StatusCode.OK
        requests.append(request)
        expected[rid] = code
    return requests, expected


async def fire(
    address: str, requests: Sequence[pb.PoolRequest], channels: int = 4
) -> list[pb.PoolResponse | grpc.aio.AioRpcError]:
    """Every request at once as a unary Pool call, spread over a few channels."""
    opened = [grpc.aio.insecure_channel(address) for _ in range(channels)]
    try:
        stubs = [Stub(channel) for channel in opened]
        calls = [
            stubs[i % channels].Pool(request, timeout=120) for i, request in enumerate(requests)
        ]
        return await asyncio.gather(*calls, return_exceptions=True)
    finally:
        for channel in opened:
            await channel.close()


def token_counts(stub: Stub, texts: Sequence[str], model: str) -> list[int]:
    counts: list[int] = []
    for start in range(0, len(texts), 500):
        response = stub.Tokenize(
            pb.TokenizeRequest(model=model, texts=texts[start : start + 500]), timeout=60
        )
        counts += [len(item.token_ids) for item in response.items]
    return counts


def test_metrics_stay_exact_under_a_burst(quiet: Quiet, quiet_stub: Stub) -> None:
    requests, expected = burst_requests()
    valid = [r for r in requests if expected[r.request_id] == grpc.StatusCode.OK]
    counts = iter(token_counts(quiet_stub, [t for r in valid for t in r.embed.texts], "tiny-bert"))
    tokens_of = {r.request_id: [next(counts) for _ in r.embed.texts] for r in valid}
    before = scrape(quiet.metrics_port)

    results = asyncio.run(fire(quiet.process.address, requests))

    after = scrape(quiet.metrics_port)
    got: dict[str, grpc.StatusCode] = {}
    shed: list[str] = []  # cancelled by gRPC itself: see below
    usage = 0
    for request, result in zip(requests, results, strict=True):
        rid = request.request_id
        if isinstance(result, grpc.aio.AioRpcError):
            if result.code() == grpc.StatusCode.CANCELLED:
                shed.append(rid)
            else:
                got[rid] = result.code()
        else:
            assert isinstance(result, pb.PoolResponse), result
            assert result.request_id == rid
            assert result.usage.prompt_tokens == sum(tokens_of[rid])
            got[rid] = grpc.StatusCode.OK
            usage += result.usage.prompt_tokens
    # gRPC core cancels calls the server has not taken up past grpc.server.max_pending_requests
    # (1,000 by default); the server raises that bound, so every call of the burst is answered.
    assert not shed, f"{len(shed)} of {BURST} calls cancelled"
    wrong = {rid: (code, expected[rid]) for rid, code in got.items() if code != expected[rid]}
    assert not wrong, list(wrong.items())[:5]
    answered = [rid for rid, code in got.items() if code == grpc.StatusCode.OK]
    n_ok, n_bad = len(answered), len(got) - len(answered)
    assert n_ok > 0 and n_bad > 0
    items = sum(len(tokens_of[rid]) for rid in answered)
    tokens = sum(sum(tokens_of[rid]) for rid in answered)
    assert usage == tokens

    def delta(name: str, **labels: str) -> float:
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    pool = {"rpc": "Pool", "task": "embed", "model": "tiny-bert"}
    assert delta("pooling_requests_total", **pool, code="OK") == n_ok
    assert delta("pooling_requests_total", **pool, code="INVALID_ARGUMENT") == n_bad
    # No other code, model or rpc.
    assert delta("pooling_requests_total") == n_ok + n_bad
    assert delta("pooling_request_seconds_count") == n_ok + n_bad
    assert delta("pooling_items_total", model="tiny-bert", task="embed") == items
    assert delta("pooling_items_total") == items
    assert delta("pooling_prompt_tokens_total", model="tiny-bert", task="embed") == tokens
    assert delta("pooling_prompt_tokens_total") == tokens
    assert delta("pooling_batch_real_tokens_total", model="tiny-bert") == tokens
    assert delta("pooling_queue_seconds_count", model="tiny-bert") == items
    assert metric_sum(after, "pooling_queue_depth", model="tiny-bert") == 0


# ---------------------------------------------------------------------------------------
# A burst answers as one-by-one requests do
# ---------------------------------------------------------------------------------------


def parity_requests(count: int = 64) -> list[pb.PoolRequest]:
    """Every task, with per-request params mixed so per-item heads differ within a batch."""
    # MIXED_KINDS, and truncation and token activations beside them.
    kinds: list[Kind] = [
        *MIXED_KINDS,
        ("embed", "tiny-bert", {"truncate_prompt_tokens": 6}),
        ("token_classify", "tiny-ner", {}),
    ]
    return mixed_requests(kinds, count, phrase, query="where is the river")


async def stream_all(address: str, requests: Sequence[pb.PoolRequest]) -> list[Any]:
    """One PoolStream: every request is sent before any answer is read."""
    async with grpc.aio.insecure_channel(address) as channel:
        call = Stub(channel).PoolStream(timeout=120)

        async def read() -> list[pb.PoolStreamResponse]:
            return [answer async for answer in call]

        reader = asyncio.ensure_future(read())
        for request in requests:
            await call.write(pb.PoolStreamRequest(request=request))
        await call.done_writing()
        return await reader


def test_a_burst_answers_as_one_by_one_requests_do(quiet: Quiet, quiet_stub: Stub) -> None:
    requests = parity_requests()
    alone = {r.request_id: quiet_stub.Pool(r, timeout=30) for r in requests}
    tasks = {response.WhichOneof("output") for response in alone.values()}
    assert tasks == {"embed", "classify", "score", "token_embed", "token_classify"}

    unary = asyncio.run(fire(quiet.process.address, requests, channels=2))
    for request, response in zip(requests, unary, strict=True):
        assert isinstance(response, pb.PoolResponse), response
        assert_same_response(response, alone[request.request_id])

    streamed = asyncio.run(stream_all(quiet.process.address, requests))
    assert sorted(a.request_id for a in streamed) == sorted(alone)
    for answer in streamed:
        assert answer.WhichOneof("result") == "response", answer.error.message
        assert_same_response(answer.response, alone[answer.request_id])


# --log-requests (one JSON line per request): tests/service/ops/test_observability.py's
# test_log_requests_writes_one_line_per_request, on that module's --log-requests server.


# ---------------------------------------------------------------------------------------
# Spans: none by default, every request's with a tracer configured
# ---------------------------------------------------------------------------------------


@contextmanager
def counting_span_starts(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """Count every span start on any tracer: the API's no-op and proxy ones and the SDK's."""
    started: list[str] = []
    for cls in (trace.NoOpTracer, trace.ProxyTracer, sdk_trace.Tracer):
        for name in ("start_span", "start_as_current_span"):
            original = getattr(cls, name)

            def counted(self: Any, *args: Any, __original: Any = original, **kwargs: Any) -> Any:
                started.append(str(args[0] if args else kwargs.get("name")))
                return __original(self, *args, **kwargs)

            monkeypatch.setattr(cls, name, counted)
    yield started


def in_process_workload(folder: Path, provider: trace.TracerProvider | None) -> None:
    """Start a server in this process, send Pool and PoolStream calls, stop it."""

    async def main() -> None:
        config = ServerConfig(
            models=[ModelSpec(source=str(folder), name="tiny-bert")],
            port=0,
            device="cpu",
            dtype="float32",
            shutdown_grace_s=5,
        )
        server = PoolingServer(config) if provider is None else PoolingServer(config, provider)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                stub = Stub(channel)
                for i in range(3):
                    await stub.Pool(
                        text_request("embed", f"span-{i}", [phrase(i)]),
                        timeout=30,
                        metadata=(TRACEPARENT,),
                    )
                with pytest.raises(grpc.aio.AioRpcError):
                    await stub.Pool(
                        text_request("embed", "span-missing", ["x"], "no-such-model"), timeout=30
                    )
                call = stub.PoolStream(timeout=30)
                for i in range(2):
                    request = text_request("embed", f"span-stream-{i}", [phrase(i, 2)])
                    await call.write(pb.PoolStreamRequest(request=request))
                await call.done_writing()
                answers = [answer async for answer in call]
                assert len(answers) == 2
        finally:
            await server.stop()

    asyncio.run(main())


def memory_provider() -> tuple[sdk_trace.TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = sdk_trace.TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_default_tracing_creates_no_spans(
    model_folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    # A recording SDK provider stands as the global one, so a server that fell back on
    # the global tracer would record there; set privately, so it is undone after the test.
    provider, exporter = memory_provider()
    monkeypatch.setattr(trace, "_TRACER_PROVIDER", provider)
    with counting_span_starts(monkeypatch) as started:
        in_process_workload(model_folders["tiny-bert"], None)
    provider.shutdown()
    assert exporter.get_finished_spans() == ()
    assert started == []


def test_a_configured_tracer_gets_every_requests_span(
    model_folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    provider, exporter = memory_provider()
    with counting_span_starts(monkeypatch) as started:
        in_process_workload(model_folders["tiny-bert"], provider)
    provider.shutdown()
    assert started  # the counter sees span starts, so the test above can trust a zero
    servers = [s for s in exporter.get_finished_spans() if s.kind == trace.SpanKind.SERVER]
    by_id = {dict(s.attributes or {})["pooling.request_id"]: s for s in servers}
    assert len(by_id) == len(servers)
    ids = ["span-0", "span-1", "span-2", "span-missing", "span-stream-0", "span-stream-1"]
    assert sorted(by_id) == ids
    for rid in ("span-0", "span-1", "span-2"):
        assert format(by_id[rid].context.trace_id, "032x") == TRACE_ID
    for rid in ("span-0", "span-1", "span-2", "span-missing"):
        assert by_id[rid].name == "pooling.v1.PoolingService/Pool"
    assert by_id["span-missing"].status.status_code == trace.StatusCode.ERROR
    assert by_id["span-stream-0"].name == "pooling.v1.PoolingService/PoolStream"


# ---------------------------------------------------------------------------------------
# --otlp-endpoint: spans reach a collector
# ---------------------------------------------------------------------------------------


class Collector(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC trace collector that keeps what it is sent."""

    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(
        self, request: trace_service_pb2.ExportTraceServiceRequest, context: Any
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()

    def spans(self) -> list[tuple[dict[str, str], trace_pb2.Span]]:
        """(resource attributes, span) for every span received so far."""
        found = []
        for request in list(self.requests):
            for resource_spans in request.resource_spans:
                resource = {a.key: a.value.string_value for a in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    found += [(resource, span) for span in scope_spans.spans]
        return found


@contextmanager
def collecting() -> Iterator[tuple[Collector, str]]:
    """A Collector on a free loopback port, and its endpoint as --otlp-endpoint takes it."""
    collector = Collector()
    grpc_server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(collector, grpc_server)
    port = grpc_server.add_insecure_port("127.0.0.1:0")
    grpc_server.start()
    try:
        yield collector, f"http://127.0.0.1:{port}"
    finally:
        grpc_server.stop(0)


@dataclass
class Exporting:
    process: ServerProcess
    collector: Collector


@pytest.fixture(scope="module")
def exporting(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Exporting]:
    args = ["--model", f"tiny-bert={model_folders['tiny-bert']}", "--dtype", "float32"]
    with collecting() as (collector, endpoint):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")  # export within 0.2 s, not 5 s
            log_dir = tmp_path_factory.mktemp("otlp")
            process = start_server([*args, "--otlp-endpoint", endpoint], log_dir, "otlp")
        try:
            yield Exporting(process, collector)
        finally:
            process.stop(signal.SIGTERM)


def test_otlp_endpoint_exports_the_server_span(exporting: Exporting) -> None:
    with grpc.insecure_channel(exporting.process.address) as channel:
        stub = Stub(channel)
        stub.Pool(
            text_request("embed", "otlp-1", ["export me"]), timeout=30, metadata=(TRACEPARENT,)
        )
        messages = [pb.PoolStreamRequest(request=text_request("embed", "otlp-2", ["and me"]))]
        assert len(list(stub.PoolStream(iter(messages), timeout=30))) == 1

    def server_spans() -> dict[str, tuple[dict[str, str], trace_pb2.Span]]:
        found = {}
        for resource, span in exporting.collector.spans():
            attributes = {a.key: a.value.string_value for a in span.attributes}
            if span.kind == trace_pb2.Span.SPAN_KIND_SERVER:
                found[attributes.get("pooling.request_id", "")] = (resource, span)
        return found if {"otlp-1", "otlp-2"} <= set(found) else {}

    spans = wait_for(server_spans, "the collector to receive both server spans", timeout=20)
    resource, pool = spans["otlp-1"]
    assert pool.name == "pooling.v1.PoolingService/Pool"
    assert pool.trace_id.hex() == TRACE_ID
    assert pool.parent_span_id.hex() == PARENT_SPAN_ID
    assert resource.get("service.name") == "pooling-server"
    assert spans["otlp-2"][1].name == "pooling.v1.PoolingService/PoolStream"


def test_standard_otel_variables_configure_export(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> None:
    """No --otlp-endpoint: OTEL_EXPORTER_OTLP_ENDPOINT turns export on, and OTEL_SERVICE_NAME
    names the service (a hard-coded name used to override it)."""
    args = ["--model", f"tiny-bert={model_folders['tiny-bert']}", "--dtype", "float32"]
    with collecting() as (collector, endpoint):
        with pytest.MonkeyPatch.context() as env:
            env.setenv("OTEL_BSP_SCHEDULE_DELAY", "200")
            env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
            env.setenv("OTEL_SERVICE_NAME", "search-embedder")
            env.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test")
            process = start_server(args, tmp_path_factory.mktemp("otel-env"), "otel-env")
        try:
            with grpc.insecure_channel(process.address) as channel:
                Stub(channel).Pool(text_request("embed", "env-1", ["export me"]), timeout=30)

            def resources() -> list[dict[str, str]]:
                return [resource for resource, _ in collector.spans()]

            resource = wait_for(resources, "a span exported by the variables", timeout=20)[0]
            assert resource.get("service.name") == "search-embedder"
            assert resource.get("deployment.environment") == "test"
        finally:
            process.stop(signal.SIGTERM)
