"""The result cache's series on /metrics (docs/cache.md): read at scrape time in one
process, copied into the shared files by each engine process of a split server (whose
values the supervisor's endpoint sums), as the queue's own series are (metrics.py)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pooling_server.engine.caching.cache import ResultCache

HITS = (
    "pooling_cache_hits",
    "Items answered without a forward pass of their own: by the result cache's memory or "
    "redis tier, or by another request's forward in flight (in_flight)",
)
MISSES = ("pooling_cache_misses", "Items the result cache missed, each computed by a forward")
BYTES = ("pooling_cache_bytes", "Bytes held by the result cache's memory tier")
ENTRIES = ("pooling_cache_entries", "Entries held by the result cache's memory tier")
EVICTIONS = (
    "pooling_cache_evictions",
    "Entries the memory tier dropped, least recently used, to stay within --cache-mb",
)
REDIS_ERRORS = (
    "pooling_cache_redis_errors",
    "Redis calls that failed or timed out; the tier is then skipped for a second",
)
CORRUPT = (
    "pooling_cache_corrupt_entries",
    "Entries read back that failed their check (corrupt, truncated): served as misses",
)


def cache_of(queues: Mapping[str, Any]) -> ResultCache | None:
    """The process's result cache, which every model's queue shares; None: off."""
    for queue in queues.values():
        if queue.cache is not None:
            return queue.cache.results
    return None


def _counters(cache: ResultCache) -> list[tuple[tuple[str, str], list[str], int]]:
    stats, memory, redis = cache.stats, cache.memory, cache.redis
    return [
        (HITS, ["memory"], stats.memory_hits),
        (HITS, ["redis"], stats.redis_hits),
        (HITS, ["in_flight"], stats.shared_flights),
        (MISSES, [], stats.misses),
        (EVICTIONS, [], memory.evictions if memory is not None else 0),
        (REDIS_ERRORS, [], redis.errors if redis is not None else 0),
        (CORRUPT, [], stats.corrupt),
    ]


def _gauges(cache: ResultCache) -> list[tuple[tuple[str, str], int]]:
    memory = cache.memory
    return [
        (BYTES, memory.bytes if memory is not None else 0),
        (ENTRIES, len(memory) if memory is not None else 0),
    ]


def families(queues: Mapping[str, Any]) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
    """In one process, at scrape time: the cache's series (none while it is off)."""
    cache = cache_of(queues)
    if cache is None:
        return
    made: dict[str, CounterMetricFamily] = {}
    for (name, text), labels, value in _counters(cache):
        family = made.get(name)
        if family is None:
            family = made[name] = CounterMetricFamily(name, text, labels=["tier"] if labels else [])
        family.add_metric(labels, value)
    yield from made.values()
    for (name, text), value in _gauges(cache):
        gauge = GaugeMetricFamily(name, text)
        gauge.add_metric([], value)
        yield gauge


class SharedCacheStats:
    """In an engine process: the cache's counts copied into the shared files at each sync."""

    def __init__(self, registry: CollectorRegistry, cache: ResultCache) -> None:
        self.cache = cache
        self._counters: dict[str, Any] = {}
        for (name, text), labels, _ in _counters(cache):
            if name not in self._counters:
                labelled = ["tier"] if labels else []
                self._counters[name] = Counter(name, text, labelled, registry=registry)
        self._gauges = {
            name: Gauge(name, text, multiprocess_mode="livesum", registry=registry)
            for (name, text), _ in _gauges(cache)
        }
        self._seen: dict[tuple[str, ...], int] = {}

    def sync(self) -> None:
        for (name, _), labels, total in _counters(self.cache):
            counter = self._counters[name]
            child = counter.labels(*labels) if labels else counter
            seen = self._seen.get((name, *labels), 0)
            if total > seen:
                child.inc(total - seen)
                self._seen[(name, *labels)] = total
        for (name, _), value in _gauges(self.cache):
            self._gauges[name].set(value)
