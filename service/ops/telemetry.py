"""Per-request observation: metrics and timing trailers always; a span and a log line when asked."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from pooling_server.engine.errors import clip
from pooling_server.engine.scheduling.engine import Timings
from pooling_server.service.ops.logs import FIELDS_ATTR
from pooling_server.service.ops.metrics import Metrics

request_log = logging.getLogger("pooling.requests")
LOGGED_ID_CHARS = 64  # ids and names are cut to this in logs


def _epoch_ns(monotonic: float) -> int:
    return time.time_ns() - int((time.monotonic() - monotonic) * 1e9)


class RequestRecord:
    """Opened when a request arrives, closed once with its outcome.

    Metrics and trailers are paid by every request; a span only when tracing is
    configured, and a log line only for failures or when request logging is on.
    """

    __slots__ = (
        "headers",
        "inputs",
        "protocol",
        "request_id",
        "rpc",
        "span",
        "started",
        "task",
        "telemetry",
        "timings",
    )

    def __init__(
        self,
        telemetry: Telemetry,
        rpc: str,
        request_id: str,
        task: str,
        headers: Iterable[tuple[str, str]],
        protocol: str = "grpc",
        inputs: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """`headers`: the caller's metadata (W3C traceparent among it); `inputs` gives the
        texts for a log line with --log-inputs, called only then."""
        self.telemetry = telemetry
        self.headers = headers
        self.protocol = protocol
        self.rpc = rpc
        self.request_id = request_id
        self.task = task
        self.inputs = inputs
        self.timings = Timings()
        self.started = time.monotonic()
        self.span: trace.Span | None = None
        if telemetry.tracer is not None:
            self.span = self._start_span(telemetry.tracer)

    def _caller_trace(self) -> Context:
        """The caller's trace context, from W3C `traceparent` metadata."""
        return propagate.extract({k: v for k, v in self.headers or () if isinstance(v, str)})

    def _start_span(self, tracer: trace.Tracer) -> trace.Span:
        return tracer.start_span(
            f"pooling.v1.PoolingService/{self.rpc}",
            context=self._caller_trace(),
            kind=SpanKind.SERVER,
            attributes={
                "pooling.protocol": self.protocol,
                "rpc.system": "grpc",
                "rpc.service": "pooling.v1.PoolingService",
                "rpc.method": self.rpc,
                "pooling.task": self.task,
                "pooling.request_id": self.request_id,
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
        self,
        code: str,
        model: str,
        items: int = 0,
        tokens: int = 0,
        reason: str = "",
        ok: bool | None = None,
    ) -> None:
        """`code`: the protocol's own status (a gRPC code name, an HTTP status)."""
        ok = code == "OK" if ok is None else ok
        t = self.timings
        t.total_s = time.monotonic() - self.started
        telemetry = self.telemetry
        telemetry.metrics.observe_request(
            self.rpc, self.task, model, code, t, items, tokens, self.protocol, ok
        )
        if self.span is not None:
            self._end_span(self.span, code, model, items, tokens, reason, ok)
        if not ok or request_log.isEnabledFor(telemetry.request_log_level):
            self._log(code, model, items, tokens, reason, ok)

    def _end_span(
        self,
        span: trace.Span,
        code: str,
        model: str,
        items: int,
        tokens: int,
        reason: str,
        ok: bool,
    ) -> None:
        self._child_spans(span)
        span.set_attributes(
            {"pooling.model": model, "pooling.items": items, "pooling.prompt_tokens": tokens}
        )
        span.set_attribute(
            "rpc.grpc.status_code" if self.protocol == "grpc" else "pooling.status_code", code
        )
        if not ok:
            span.set_status(Status(StatusCode.ERROR, reason or code))
        span.end()

    def _log(self, code: str, model: str, items: int, tokens: int, reason: str, ok: bool) -> None:
        t = self.timings
        fields = {
            "request_id": clip(self.request_id, LOGGED_ID_CHARS),
            "rpc": self.rpc,
            "protocol": self.protocol,
            "model": clip(model, LOGGED_ID_CHARS),
            "task": self.task,
            "items": items,
            "prompt_tokens": tokens,
            "code": code,
            "reason": reason,
            "total_ms": round(1000 * t.total_s, 3),
            "tokenize_ms": round(1000 * t.tokenize_s, 3),
            "queue_ms": round(1000 * t.queue_s, 3),
            "inference_ms": round(1000 * t.inference_s, 3),
        }
        # Without tracing, the caller's trace id still ties the line to its trace.
        span = self.span or trace.get_current_span(self._caller_trace())
        fields["trace_id"] = format(span.get_span_context().trace_id, "032x")
        if self.telemetry.log_inputs and self.inputs is not None:
            fields.update(self.inputs())
        level = logging.INFO if not ok else self.telemetry.request_log_level
        request_log.log(level, "request", extra={FIELDS_ATTR: fields})

    def _child_spans(self, span: trace.Span) -> None:
        batches = self.timings.batches
        tracer = self.telemetry.tracer
        if batches.started is None or batches.finished is None or tracer is None:
            return
        parent = trace.set_span_in_context(span)
        for name, start, end in (
            ("tokenize", self.started, self.started + self.timings.tokenize_s),
            ("queue", batches.enqueued, batches.started),
            ("forward", batches.started, batches.finished),
        ):
            child = tracer.start_span(name, context=parent, start_time=_epoch_ns(start))
            child.end(end_time=_epoch_ns(end))


class Telemetry:
    """What every request records, and what only some do.

    `tracer` is None unless a real tracer provider is configured, so no span object is
    built per request by default. Successful requests are logged at INFO with
    `log_requests`, else at DEBUG (written only with --log-level debug); failures always.
    """

    def __init__(
        self,
        metrics: Metrics,
        tracer_provider: trace.TracerProvider | None = None,
        log_inputs: bool = False,
        log_requests: bool = False,
    ) -> None:
        self.metrics = metrics
        self.tracer: trace.Tracer | None = None
        if tracer_provider is not None and not isinstance(
            tracer_provider, trace.NoOpTracerProvider
        ):
            self.tracer = tracer_provider.get_tracer("pooling.service")
        self.log_inputs = log_inputs
        self.request_log_level = logging.INFO if log_requests else logging.DEBUG

    def open(
        self,
        rpc: str,
        request_id: str,
        task: str,
        headers: Iterable[tuple[str, str]],
        protocol: str,
        inputs: Callable[[], dict[str, Any]] | None = None,
    ) -> RequestRecord:
        """A record for a request already in engine types (the request runner's)."""
        return RequestRecord(self, rpc, request_id, task, headers, protocol, inputs)


def tracer_provider(otlp_endpoint: str | None) -> trace.TracerProvider:
    """OTLP export when an endpoint is set (--otlp-endpoint, or OpenTelemetry's own
    OTEL_EXPORTER_OTLP_[TRACES_]ENDPOINT); otherwise the API's no-op provider.

    The standard variables hold as the SDK defines them: OTEL_SDK_DISABLED,
    OTEL_TRACES_EXPORTER=none, OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES (the service
    is named pooling-server only when they name it nothing), the sampler, headers and TLS.
    """
    env = os.environ
    from_env = env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or env.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT"
    )
    disabled = env.get("OTEL_SDK_DISABLED", "").lower() == "true"
    if disabled or env.get("OTEL_TRACES_EXPORTER", "").lower() == "none":
        return trace.NoOpTracerProvider()
    if not (otlp_endpoint or from_env):
        return trace.NoOpTracerProvider()
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    resource = Resource.create()  # reads OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: "pooling-server"}))
    provider = TracerProvider(resource=resource)
    # Without --otlp-endpoint the exporter reads its endpoint (and headers) from the variables.
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    return provider
