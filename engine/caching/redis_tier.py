"""The shared tier: entries in a Redis that a fleet of servers shares (--cache-redis URL).

Reads are one MGET per batch of look-ups, bounded by a timeout of a few milliseconds;
writes go out on a thread of their own, a bounded queue of them, dropped when it is full.
Redis unreachable or slow: the server serves without this tier, warned of once and
counted (`errors`), and tries it again after RETRY_S; a call never fails because of it.
The byte bound: entries past MAX_ENTRY_BYTES are not written, and, when asked
(--cache-redis-mb), the server's maxmemory with an LRU policy so Redis evicts, not refuses.
"""

from __future__ import annotations

import logging
import threading
import time
from queue import Full, SimpleQueue
from typing import Any

log = logging.getLogger(__name__)

PREFIX = b"pooling:cache:v1:"
RETRY_S = 1.0  # after a failure, look-ups skip Redis this long
MAX_ENTRY_BYTES = 4 << 20
WRITE_BACKLOG = 4096  # writes waiting for the writer thread, at most
WRITE_BATCH = 256


class RedisTier:
    def __init__(self, url: str, ttl_s: int, timeout_s: float, max_memory_mb: int = 0) -> None:
        import redis  # only where the tier is asked for

        self.url = url
        self.ttl_s = ttl_s
        self.errors = 0
        self.dropped_writes = 0
        self._client: Any = redis.Redis.from_url(
            url,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            retry_on_timeout=False,
            retry=None,
            health_check_interval=0,
        )
        self._down_until = 0.0
        self._warned = False
        self._lock = threading.Lock()
        self._writes: SimpleQueue[tuple[bytes, bytes] | None] = SimpleQueue()
        self._backlog = 0
        self._max_memory_mb = max_memory_mb
        self._configured = max_memory_mb <= 0
        self._writer = threading.Thread(target=self._write, name="cache-redis", daemon=True)
        self._writer.start()

    def _failed(self, exc: BaseException) -> None:
        with self._lock:
            self.errors += 1
            self._down_until = time.monotonic() + RETRY_S
            warn, self._warned = not self._warned, True
        if warn:
            log.warning(
                "the cache's Redis tier (%s) failed: %s: %s; serving without it, retrying "
                "every %.0f s (pooling_cache_redis_errors_total counts each failure)",
                _shown(self.url),
                type(exc).__name__,
                exc,
                RETRY_S,
            )

    @property
    def up(self) -> bool:
        return time.monotonic() >= self._down_until

    def get_many(self, keys: list[bytes]) -> list[bytes | None]:
        """Each key's stored bytes (None: absent); all None while Redis is down."""
        if not keys or not self.up:
            return [None] * len(keys)
        try:
            self._configure()
            found = self._client.mget([PREFIX + key for key in keys])
        except Exception as exc:  # a call never fails because of the cache
            self._failed(exc)
            return [None] * len(keys)
        return list(found)

    def put(self, key: bytes, data: bytes) -> None:
        """Queue a write (TTL'd); dropped when too large, Redis is down or the writer lags."""
        if len(data) > MAX_ENTRY_BYTES or not self.up:
            return
        if self._backlog >= WRITE_BACKLOG:
            self.dropped_writes += 1
            return
        self._backlog += 1
        try:
            self._writes.put((key, data))
        except Full:  # pragma: no cover - SimpleQueue is unbounded
            self._backlog -= 1

    def close(self) -> None:
        self._writes.put(None)

    def _configure(self) -> None:
        """--cache-redis-mb: Redis's maxmemory, evicting least recently used keys."""
        if self._configured:
            return
        self._configured = True
        try:
            self._client.config_set("maxmemory", f"{self._max_memory_mb}mb")
            self._client.config_set("maxmemory-policy", "allkeys-lru")
        except Exception as exc:
            import redis

            if not isinstance(exc, redis.ResponseError):
                self._configured = False
                raise
            log.warning("the cache's Redis refused CONFIG SET maxmemory (%s): set it there", exc)

    def _write(self) -> None:
        while True:
            first = self._writes.get()
            if first is None:
                return
            writes = [first]
            while len(writes) < WRITE_BATCH and not self._writes.empty():
                item = self._writes.get()
                if item is None:
                    self._flush(writes)
                    return
                writes.append(item)
            self._backlog -= len(writes)
            self._flush(writes)

    def _flush(self, writes: list[tuple[bytes, bytes]]) -> None:
        if not self.up:
            return
        try:
            self._configure()
            pipe = self._client.pipeline(transaction=False)
            for key, data in writes:
                pipe.set(PREFIX + key, data, ex=self.ttl_s)
            pipe.execute()
        except Exception as exc:
            self._failed(exc)


def _shown(url: str) -> str:
    """The URL without its password."""
    if "@" in url:
        scheme, _, rest = url.partition("://")
        return f"{scheme}://***@{rest.rpartition('@')[2]}"
    return url
