"""Per-request observation: one span, one log line, the metrics, and the timing trailers."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from engine.engine import Timings
from pooling_client.v1 import pooling_pb2 as pb
from service.logs import FIELDS_ATTR
from service.metrics import Metrics

request_log = logging.getLogger("pooling.requests")


def _epoch_ns(monotonic: float) -> int:
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


class RequestRecord:
    """Opened when a request arrives, closed once with its outcome."""

    def __init__(
        self,
        telemetry: Telemetry,
        rpc: str,
        request: pb.PoolRequest,
        metadata: Sequence[tuple[str, str | bytes]],
    ) -> None:
        self.telemetry = telemetry
        self.rpc = rpc
        self.request = request
        self.task = request.WhichOneof("input") or "none"
        self.timings = Timings()
        self.started = time.monotonic()
        carrier = {key: value for key, value in metadata if isinstance(value, str)}
        self.span = telemetry.tracer.start_span(
            f"pooling.v1.PoolingService/{rpc}",
            context=propagate.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={
                "rpc.system": "grpc",
                "rpc.service": "pooling.v1.PoolingService",
                "rpc.method": rpc,
                "pooling.task": self.task,
                "pooling.request_id": request.request_id,
            },
        )

    def trailing_metadata(self, prompt_tokens: int) -> tuple[tuple[str, str], ...]:
        """Like TEI's x-* headers: where the time went, in milliseconds."""
        t = self.timings
        return (
            ("x-total-time-ms", f"{1000 * t.total_s:.3f}"),
            ("x-tokenization-time-ms", f"{1000 * t.tokenize_s:.3f}"),
            ("x-queue-time-ms", f"{1000 * t.queue_s:.3f}"),
            ("x-inference-time-ms", f"{1000 * t.inference_s:.3f}"),
            ("x-prompt-tokens", str(prompt_tokens)),
        )

    def finish(
        self, code: str, model: str, items: int = 0, tokens: int = 0, reason: str = ""
    ) -> None:
        t = self.timings
        t.total_s = time.monotonic() - self.started
        self.telemetry.metrics.observe_request(self.rpc, self.task, model, code, t, items, tokens)
        self._child_spans()
        self.span.set_attributes(
            {"pooling.model": model, "pooling.items": items, "pooling.prompt_tokens": tokens}
        )
        self.span.set_attribute("rpc.grpc.status_code", code)
        if code != "OK":
            self.span.set_status(Status(StatusCode.ERROR, reason or code))
        self.span.end()
        fields = {
            "request_id": self.request.request_id,
            "rpc": self.rpc,
            "model": model,
            "task": self.task,
            "items": items,
            "prompt_tokens": tokens,
            "code": code,
            "reason": reason,
            "total_ms": round(1000 * t.total_s, 3),
            "tokenize_ms": round(1000 * t.tokenize_s, 3),
            "queue_ms": round(1000 * t.queue_s, 3),
            "inference_ms": round(1000 * t.inference_s, 3),
            "trace_id": format(self.span.get_span_context().trace_id, "032x"),
        }
        if self.telemetry.log_inputs:
            case = self.request.WhichOneof("input")
            if case == "score":
                fields["text_1"] = list(self.request.score.text_1)
                fields["text_2"] = list(self.request.score.text_2)
            elif case:
                fields["texts"] = list(getattr(self.request, case).texts)
        request_log.info("request", extra={FIELDS_ATTR: fields})

    def _child_spans(self) -> None:
        batches = self.timings.batches
        if batches.started is None or batches.finished is None:
            return
        parent = trace.set_span_in_context(self.span)
        for name, start, end in (
            ("tokenize", self.started, self.started + self.timings.tokenize_s),
            ("queue", batches.enqueued, batches.started),
            ("forward", batches.started, batches.finished),
        ):
            span = self.telemetry.tracer.start_span(
                name, context=parent, start_time=_epoch_ns(start)
            )
            span.end(end_time=_epoch_ns(end))


class Telemetry:
    def __init__(
        self,
        metrics: Metrics,
        tracer_provider: trace.TracerProvider | None = None,
        log_inputs: bool = False,
    ) -> None:
        self.metrics = metrics
        self.tracer = trace.get_tracer("pooling.service", tracer_provider=tracer_provider)
        self.log_inputs = log_inputs

    def begin(
        self, rpc: str, request: pb.PoolRequest, metadata: Sequence[tuple[str, str | bytes]]
    ) -> RequestRecord:
        return RequestRecord(self, rpc, request, metadata)


def tracer_provider(otlp_endpoint: str | None) -> trace.TracerProvider:
    """OTLP export when an endpoint is set; otherwise the API's no-op provider."""
    if not otlp_endpoint:
        return trace.NoOpTracerProvider()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": "pooling-server"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    return provider
