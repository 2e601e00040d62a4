"""The result cache of one engine process: the memory tier, then the shared Redis tier,
and the counters /metrics reads."""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from pooling_server.engine.caching.entries import pack, unpack
from pooling_server.engine.caching.memory import MemoryTier


@dataclass(frozen=True)
class CacheSettings:
    """--cache-mb, --cache-redis and their bounds; --cache-scope is the front end's."""

    memory_mb: int = 0
    redis_url: str = ""
    redis_ttl_s: int = 86400
    redis_timeout_ms: float = 5.0
    redis_mb: int = 0

    @property
    def enabled(self) -> bool:
        return self.memory_mb > 0 or bool(self.redis_url)


@dataclass
class CacheStats:
    """What /metrics exports: look-ups answered by each tier, misses, stores; bytes and
    evictions are the memory tier's, errors the Redis tier's."""

    memory_hits: int = 0
    redis_hits: int = 0
    misses: int = 0
    shared_flights: int = 0  # items answered by another request's forward in flight
    corrupt: int = 0  # entries that failed their check (read as misses)
    stores: int = 0


class ResultCache:
    def __init__(self, settings: CacheSettings) -> None:
        self.settings = settings
        self.memory = MemoryTier(settings.memory_mb << 20) if settings.memory_mb > 0 else None
        self.redis = None
        if settings.redis_url:
            from pooling_server.engine.caching.redis_tier import RedisTier

            self.redis = RedisTier(
                settings.redis_url,
                settings.redis_ttl_s,
                settings.redis_timeout_ms / 1000,
                settings.redis_mb,
            )
        self.stats = CacheStats()
        self._lock = threading.Lock()

    def find(self, keys: list[bytes]) -> list[np.ndarray | None]:
        """Each key's raw output, from memory, else Redis (kept in memory then), else None."""
        found: list[np.ndarray | None] = (
            self.memory.get_many(keys) if self.memory is not None else [None] * len(keys)
        )
        memory_hits = sum(value is not None for value in found)
        redis_hits = corrupt = 0
        if self.redis is not None and memory_hits < len(keys):
            missing = [k for k, value in enumerate(found) if value is None]
            stored = self.redis.get_many([keys[k] for k in missing])
            for k, data in zip(missing, stored, strict=True):
                if data is None:
                    continue
                value = unpack(keys[k], data)
                if value is None:
                    corrupt += 1
                    continue
                found[k] = value
                redis_hits += 1
                if self.memory is not None:
                    self.memory.put(keys[k], value)
        with self._lock:
            stats = self.stats
            stats.memory_hits += memory_hits
            stats.redis_hits += redis_hits
            stats.corrupt += corrupt
        return found

    def recheck(self, key: bytes) -> np.ndarray | None:
        """A look-up in memory only, uncounted: under the queue's lock, for a result that
        landed since `find` (so an item in flight is never computed twice)."""
        return self.memory.get(key) if self.memory is not None else None

    def count(self, misses: int, shared: int) -> None:
        with self._lock:
            self.stats.misses += misses
            self.stats.shared_flights += shared

    def store(self, key: bytes, values: np.ndarray) -> np.ndarray:
        """Keep a computed output (a copy, read-only) in memory, and send it to Redis;
        returns the copy, which the flight's waiters share."""
        value = np.array(values, copy=True)
        value.flags.writeable = False
        if self.memory is not None:
            self.memory.put(key, value)
        if self.redis is not None:
            self.redis.put(key, pack(key, value))
        with self._lock:  # the engine's forward workers store side by side
            self.stats.stores += 1
        return value

    def close(self) -> None:
        if self.redis is not None:
            self.redis.close()
