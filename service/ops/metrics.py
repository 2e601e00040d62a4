"""Prometheus metrics: what requests asked for, and where their time went."""

from __future__ import annotations

import asyncio
import bisect
import collections
import math
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from pooling_server.engine.scheduling.batch_queue import BatchConfig, BatchQueue, BatchRecord
from pooling_server.engine.scheduling.engine import Engine, Timings
from pooling_server.service.ops import cache_metrics

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)
SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
TOKEN_BUCKETS = (16, 64, 256, 1024, 2048, 4096, 8192, 16384, 32768, 65536)


# The queue's own series: read at scrape time in one process (_EngineCollector), copied
# into shared files by an engine process (EngineStats); one name and help text for both.
DEPTH = ("pooling_queue_depth", "Items waiting in the queue")
DROPPED = (
    "pooling_dropped_items",
    "Queued items dropped before computing: cancelled by the client or past the deadline",
)
LOADED = ("pooling_models_loaded", "Models loaded and serving")
ENGINES = ("pooling_engines", "Engine processes serving, by device")
STALLED = (
    "pooling_engine_stalled",
    "1 while a front end sees this engine process stalled (--engine-stall-s)",
)
STALLS = ("pooling_engine_stalls", "Times this engine process stalled, as the front ends saw it")
# The gauges the Gateway API Inference Extension's endpoint picker routes on and a fleet
# scales on (its model-server protocol: queued requests, running requests, a utilization
# fraction); deploy/kubernetes/inferencepool.yaml names them, docs/scale-out.md explains.
QUEUED = (
    "pooling_requests_queued",
    "Requests waiting for a forward pass, none of their inputs computed yet",
)
RUNNING = (
    "pooling_requests_running",
    "Requests with an input in a forward pass or computed, not yet answered",
)
UTILIZATION = (
    "pooling_batch_utilization",
    "Share of the batching capacity used over the last 5 s (0 to 1): forward-pass seconds "
    "times how full each batch was, over 5 s times the forward workers",
)
UTILIZATION_WINDOW_S = 5.0


def observe_many(histogram: Any, amounts: Sequence[float]) -> None:
    """`histogram.observe(a)` for every amount, paid per batch rather than per item.

    A histogram child's observe costs ~3 us in a split server (each bucket and the sum are
    shared-memory values, checked for a fork on every update): per queued item, that was the
    engine process's largest cost after its own work. Here the amounts are counted into
    buckets at once and each bucket touched once. It uses prometheus_client's bucket fields
    (`_upper_bounds`, `_buckets`, `_sum`, as of the pinned 0.26), which the test checks
    against observe itself.
    """
    if not len(amounts):
        return
    values = np.asarray(amounts, dtype=np.float64)
    bounds = histogram._upper_bounds
    # observe() counts an amount in the first bucket whose bound it does not pass.
    counts = np.bincount(np.searchsorted(bounds, values, side="left"), minlength=len(bounds))
    histogram._sum.inc(float(values.sum()))
    for index in np.flatnonzero(counts):
        histogram._buckets[index].inc(int(counts[index]))


def _observe(histogram: Any, amounts: Sequence[float]) -> None:
    """observe_many for a few amounts (numpy's setup costs more than they do): each bucket
    touched once, through the same fields of prometheus_client's."""
    if len(amounts) == 1:
        histogram.observe(amounts[0])
        return
    bounds = histogram._upper_bounds
    counts = collections.Counter(bisect.bisect_left(bounds, amount) for amount in amounts)
    histogram._sum.inc(math.fsum(amounts))
    for index, count in counts.items():
        histogram._buckets[index].inc(count)


class _RequestsOfATurn:
    """The requests a split server's front end finished in one turn of its event loop, put
    into the series together at the turn's end.

    There each series update is a shared-memory value checked for a fork (~3 us), seven a
    request: more than a tenth of a front end's CPU per call. The calls one engine batch
    answers finish in the same turn, so each series is touched once a turn, not once a call.
    A request finished off the loop (another thread, no loop) is counted at once.
    """

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics
        self.loop: asyncio.AbstractEventLoop | None = None  # the first loop seen; others: at once
        self.requests: list[tuple[str, str, str, str, str, bool, float, float]] = []
        self.items: list[int] = []
        self.tokens: list[int] = []

    def add(
        self, request: tuple[str, str, str, str, str, bool, float, float], items: int, tokens: int
    ) -> bool:
        """Hold `request` until the turn ends; False if it must be counted now."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return False
        if loop is not self.loop:
            if self.loop is not None and not self.loop.is_closed():
                return False
            self.flush()  # what a closed loop never flushed
            self.loop = loop
        if not self.requests:
            loop.call_soon(self.flush)
        self.requests.append(request)
        self.items.append(items)
        self.tokens.append(tokens)
        return True

    def flush(self) -> None:
        requests, items, tokens = self.requests, self.items, self.tokens
        self.requests, self.items, self.tokens = [], [], []
        if requests:
            self.metrics._count(requests, items, tokens)


def batch_fill(record: BatchRecord, config: BatchConfig) -> float:
    """How full a batch was, 0 to 1: the larger of its padded tokens' share of
    --max-batch-tokens and its items' share of --max-batch-size. A batch stops growing at
    either limit, so a batch of many short texts is full at the item cap."""
    shares = [record.padded_tokens / config.max_batch_tokens] if config.max_batch_tokens else []
    if config.max_batch_size:
        shares.append(record.size / config.max_batch_size)
    return min(1.0, max(shares, default=1.0))


class BatchUtilization:
    """Per model, the share of its batching capacity the forward passes of the last
    `window_s` seconds used: each pass's seconds within the window times how full its batch
    was, over the window times the model's forward workers.

    This is the utilization fraction of the fleet's gauges. An embedding engine holds no KV
    cache, so what fills up as it nears its limit is its batches, and its time: 1.0 means
    every worker ran full batches back to back; passes of one short text back to back read
    low, since concurrent requests would share those passes at little cost. A pass is
    counted when it ends (the gauge lags by at most one pass).
    """

    def __init__(self, window_s: float = UTILIZATION_WINDOW_S) -> None:
        self.window_s = window_s
        self._configs: dict[str, BatchConfig] = {}
        self._passes: dict[str, deque[tuple[float, float, float]]] = {}  # ended, seconds, fill
        self._lock = threading.Lock()  # passes come on the loop, scrapes on their thread

    def track(self, model: str, config: BatchConfig) -> None:
        with self._lock:
            self._configs[model] = config
            self._passes.setdefault(model, deque())

    def record(self, model: str, record: BatchRecord, now: float | None = None) -> None:
        config = self._configs.get(model)
        if config is None:
            return
        now = time.monotonic() if now is None else now
        with self._lock:
            passes = self._passes[model]
            passes.append((now, record.forward_s, batch_fill(record, config)))
            while passes and passes[0][0] < now - self.window_s:
                passes.popleft()

    def value(self, model: str, now: float | None = None) -> float:
        config = self._configs.get(model)
        if config is None:
            return 0.0
        now = time.monotonic() if now is None else now
        start = now - self.window_s
        with self._lock:
            used = sum(
                max(0.0, ended - max(ended - seconds, start)) * fill
                for ended, seconds, fill in self._passes[model]
            )
        return min(1.0, used / (self.window_s * max(1, config.workers)))


class _EngineCollector(Collector):
    """Reads the engine's own counters at scrape time, so the engine needs no metrics code."""

    def __init__(self, utilization: BatchUtilization) -> None:
        self.engine: Engine | None = None
        self.utilization = utilization

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        depth = GaugeMetricFamily(*DEPTH, labels=["model"])
        queued = GaugeMetricFamily(*QUEUED, labels=["model"])
        running = GaugeMetricFamily(*RUNNING, labels=["model"])
        utilization = GaugeMetricFamily(*UTILIZATION, labels=["model"])
        dropped = CounterMetricFamily(*DROPPED, labels=["model", "reason"])
        loaded = GaugeMetricFamily(*LOADED)
        engines = GaugeMetricFamily(*ENGINES, labels=["device"])
        queues = self.engine.queues if self.engine else {}
        for name, queue in queues.items():
            load = queue.load()  # one count under the queue's lock for all three
            depth.add_metric([name], load.items)
            queued.add_metric([name], load.queued_requests)
            running.add_metric([name], load.running_requests)
            utilization.add_metric([name], self.utilization.value(name))
            dropped.add_metric([name, "cancelled"], queue.stats.dropped_cancelled)
            dropped.add_metric([name, "expired"], queue.stats.dropped_expired)
        loaded.add_metric([], len(queues))
        if queues:  # this process is the one engine
            engines.add_metric([next(iter(queues.values())).runner.info.device], 1)
        yield from (depth, queued, running, utilization, dropped, loaded, engines)
        yield from cache_metrics.families(queues)


class _ByLabel(dict[str, Any]):
    """A metric's children for one model, by their other label, made on first use."""

    def __init__(self, make: Callable[[str], Any]) -> None:
        super().__init__()
        self._make = make

    def __missing__(self, label: str) -> Any:
        child = self[label] = self._make(label)
        return child


class _ModelChildren:
    """Every labelled series of one model."""

    def __init__(self, metrics: Metrics, model: str) -> None:
        self.request_seconds = _ByLabel(lambda rpc: metrics.request_seconds.labels(rpc, model))
        self.items = _ByLabel(lambda task: metrics.items.labels(model, task))
        self.tokens = _ByLabel(lambda task: metrics.tokens.labels(model, task))
        self.tokenize_seconds = metrics.tokenize_seconds.labels(model)
        self.queue_seconds = metrics.queue_seconds.labels(model)
        self.inference_seconds = metrics.inference_seconds.labels(model)
        self.batch_size = metrics.batch_size.labels(model)
        self.batch_tokens = metrics.batch_tokens.labels(model)
        self.real_tokens = metrics.real_tokens.labels(model)
        self.padded_tokens = metrics.padded_tokens.labels(model)


class Metrics:
    def __init__(self, multiprocess: bool = False) -> None:
        """`multiprocess`: one process of a split server; values go to the shared files
        (PROMETHEUS_MULTIPROC_DIR) that the supervisor's endpoint reads, and the queue's
        state is copied into gauges by the engine process (EngineStats) instead of being
        read at scrape time."""
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "pooling_requests",
            "Requests by RPC, task, model, status code and protocol (grpc or http)",
            ["rpc", "task", "model", "code", "protocol"],
            registry=r,
        )
        self.items = Counter(
            "pooling_items", "Inputs (texts or pairs) requested", ["model", "task"], registry=r
        )
        self.tokens = Counter(
            "pooling_prompt_tokens", "Tokens computed for requests", ["model", "task"], registry=r
        )
        self.request_seconds = Histogram(
            "pooling_request_seconds",
            "Time from receipt to response",
            ["rpc", "model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokenize_seconds = Histogram(
            "pooling_tokenize_seconds",
            "Time spent tokenizing a request",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_seconds = Histogram(
            "pooling_queue_seconds",
            "Time an item waited in the queue",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.inference_seconds = Histogram(
            "pooling_inference_seconds",
            "Time of one batch's forward pass",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.batch_size = Histogram(
            "pooling_batch_size", "Sequences per batch", ["model"], buckets=SIZE_BUCKETS, registry=r
        )
        self.batch_tokens = Histogram(
            "pooling_batch_tokens",
            "Padded tokens per batch (longest x count)",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.real_tokens = Counter(
            "pooling_batch_real_tokens", "Non-padding tokens computed", ["model"], registry=r
        )
        self.padded_tokens = Counter(
            "pooling_batch_padded_tokens",
            "Tokens computed including padding",
            ["model"],
            registry=r,
        )
        self.failed_batches = Counter(
            "pooling_failed_batches", "Batches whose forward pass failed", ["model"], registry=r
        )
        # A split server's front ends each watch every engine (engine/scheduling/remote_client.py).
        self.engine_stalled = Gauge(*STALLED, ["engine"], multiprocess_mode="livemax", registry=r)
        self.engine_stalls = Gauge(*STALLS, ["engine"], multiprocess_mode="max", registry=r)
        self._requests: dict[tuple[str, str, str, str, str], Any] = {}
        self._by_model: dict[str, _ModelChildren] = {}
        self._turn = _RequestsOfATurn(self) if multiprocess else None
        self.utilization = BatchUtilization()
        self._engine_collector = _EngineCollector(self.utilization)
        if not multiprocess:
            r.register(self._engine_collector)

    def attach(self, engine: Engine) -> None:
        self._engine_collector.engine = engine
        for name, queue in engine.queues.items():
            self.utilization.track(name, queue.config)
            queue.observers.append(self.observe_batch)

    def observe_engines(self, stalled: set[int], stalls: Sequence[int]) -> None:
        """When an engine process stalls or comes back, as this front end sees it."""
        for engine, count in enumerate(stalls):
            self.engine_stalled.labels(str(engine)).set(engine in stalled)
            self.engine_stalls.labels(str(engine)).set(count)

    def observe_batch(self, model: str, record: BatchRecord) -> None:
        """Once per batch, on the event loop: the batch's figures and each item's wait."""
        c = self._children(model)
        c.batch_size.observe(record.size)
        c.batch_tokens.observe(record.padded_tokens)
        c.real_tokens.inc(record.tokens)
        c.padded_tokens.inc(record.padded_tokens)
        c.inference_seconds.observe(record.forward_s)
        observe_many(c.queue_seconds, record.queue_wait_s)
        self.utilization.record(model, record)
        if record.error is not None:
            self.failed_batches.labels(model).inc()

    def observe_request(
        self,
        rpc: str,
        task: str,
        model: str,
        code: str,
        timings: Timings,
        items: int = 0,
        tokens: int = 0,
        protocol: str = "grpc",
        ok: bool | None = None,
    ) -> None:
        """`code`: the protocol's own status; `ok` says whether it is a success."""
        ok = code == "OK" if ok is None else ok
        request = (rpc, task, model, code, protocol, ok, timings.total_s, timings.tokenize_s)
        if self._turn is not None and self._turn.add(request, items, tokens):
            return
        key = (rpc, task, model, code, protocol)
        count = self._requests.get(key)
        if count is None:  # label sets are few (RPCs x tasks x models x codes x protocols)
            count = self._requests[key] = self.requests.labels(*key)
        count.inc()
        c = self._children(model)
        c.request_seconds[rpc].observe(timings.total_s)
        if ok:
            c.items[task].inc(items)
            c.tokens[task].inc(tokens)
            c.tokenize_seconds.observe(timings.tokenize_s)

    def _count(
        self,
        requests: Sequence[tuple[str, str, str, str, str, bool, float, float]],
        items: Sequence[int],
        tokens: Sequence[int],
    ) -> None:
        """Requests into the series, each series touched once for all of them."""
        counts: dict[tuple[str, str, str, str, str], int] = {}
        seconds: dict[tuple[str, str], list[float]] = {}
        done: dict[tuple[str, str], list[int]] = {}  # (model, task) -> [items, tokens]
        tokenize: dict[str, list[float]] = {}
        for (rpc, task, model, code, protocol, ok, total_s, tokenize_s), n, t in zip(
            requests, items, tokens, strict=True
        ):
            key = (rpc, task, model, code, protocol)
            counts[key] = counts.get(key, 0) + 1
            seconds.setdefault((model, rpc), []).append(total_s)
            if ok:
                sums = done.setdefault((model, task), [0, 0])
                sums[0] += n
                sums[1] += t
                tokenize.setdefault(model, []).append(tokenize_s)
        for key, n in counts.items():
            count = self._requests.get(key)
            if count is None:  # label sets are few (RPCs x tasks x models x codes x protocols)
                count = self._requests[key] = self.requests.labels(*key)
            count.inc(n)
        for (model, rpc), amounts in seconds.items():
            _observe(self._children(model).request_seconds[rpc], amounts)
        for (model, task), (n, t) in done.items():
            c = self._children(model)
            c.items[task].inc(n)
            c.tokens[task].inc(t)
        for model, amounts in tokenize.items():
            _observe(self._children(model).tokenize_seconds, amounts)

    def _children(self, model: str) -> _ModelChildren:
        """A model's labelled series, looked up once: `labels()` costs a lock and a hash."""
        children = self._by_model.get(model)
        if children is None:
            children = self._by_model[model] = _ModelChildren(self, model)
        return children

    def serve(self, host: str, port: int) -> None:
        start_http_server(port, addr=host, registry=self.registry)


class EngineStats:
    """In an engine process: the queues' state, copied into shared-file metrics.

    A scrape reaches the supervisor, not this process, so what the in-process collector
    reads at scrape time is copied here every `sync()` instead. The supervisor's endpoint
    sums the live engine processes' values: queue depth and requests add up across engines,
    and each engine gives its utilization over `engines` (all of the server's), so the sum
    is their mean.
    """

    def __init__(
        self, metrics: Metrics, queues: dict[str, BatchQueue], device: str, engines: int = 1
    ) -> None:
        r = metrics.registry
        self.queues = queues
        self.utilization = metrics.utilization
        self.engines = max(1, engines)
        # Each live engine process adds one on its device: K engines per device read K.
        engine_count = Gauge(*ENGINES, ["device"], multiprocess_mode="livesum", registry=r)
        engine_count.labels(device).set(1)
        self.depth = Gauge(*DEPTH, ["model"], multiprocess_mode="livesum", registry=r)
        self.queued = Gauge(*QUEUED, ["model"], multiprocess_mode="livesum", registry=r)
        self.running = Gauge(*RUNNING, ["model"], multiprocess_mode="livesum", registry=r)
        self.busy = Gauge(*UTILIZATION, ["model"], multiprocess_mode="livesum", registry=r)
        self.dropped = Counter(*DROPPED, ["model", "reason"], registry=r)
        self.mixed = Counter(
            "pooling_mixed_batches",
            "Batches holding items sent by more than one front-end process",
            ["model"],
            registry=r,
        )
        self.loaded = Gauge(*LOADED, multiprocess_mode="livemax", registry=r)
        self._seen: dict[int, int] = {}
        cache = cache_metrics.cache_of(queues)
        self.cache = None if cache is None else cache_metrics.SharedCacheStats(r, cache)
        for name, queue in queues.items():
            self.utilization.track(name, queue.config)
            queue.observers.append(metrics.observe_batch)
            queue.observers.append(self._after_batch)

    def sync(self) -> None:
        """Periodically: the depth and requests (counted under the queue's lock), the
        utilization and the counters."""
        self.loaded.set(len(self.queues))
        for name, queue in self.queues.items():
            self._sync_load(name, queue)
            self.busy.labels(name).set(self.utilization.value(name) / self.engines)
            self._sync_counters(name, queue)
        if self.cache is not None:
            self.cache.sync()

    def _sync_load(self, name: str, queue: BatchQueue) -> None:
        load = queue.load()
        self.depth.labels(name).set(load.items)
        self.queued.labels(name).set(load.queued_requests)
        self.running.labels(name).set(load.running_requests)

    def _after_batch(self, model: str, _record: BatchRecord) -> None:
        """Drops are counted as a batch is taken: they show before its callers' answers.
        An emptied queue shows at once too (counting it is cheap); a deeper one waits for
        the periodic count."""
        queue = self.queues[model]
        self._sync_counters(model, queue)
        if queue.empty:
            self._sync_load(model, queue)

    def _sync_counters(self, name: str, queue: BatchQueue) -> None:
        stats = queue.stats
        self._add(self.dropped.labels(name, "cancelled"), stats.dropped_cancelled)
        self._add(self.dropped.labels(name, "expired"), stats.dropped_expired)
        self._add(self.mixed.labels(name), stats.mixed_batches)

    def _add(self, counter: Any, total: int) -> None:
        """Counters only go up: add what the queue counted since the last sync."""
        seen = self._seen.get(id(counter), 0)
        if total > seen:
            counter.inc(total - seen)
            self._seen[id(counter)] = total


def serve_multiprocess(host: str, port: int, path: str) -> None:
    """The one /metrics endpoint of a split server: every process's shared files, summed."""
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=path)
    start_http_server(port, addr=host, registry=registry)
