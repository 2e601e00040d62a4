"""What a call tells the result cache (docs/cache.md), read once per call by the runner for
every door: the scope its entries are kept under, and whether it bypasses the cache.

- Scope: with --api-key and --cache-scope key (the default), a digest of the call's bearer
  key, so that one tenant never reads another's entries (nor learns from the time taken
  that another embedded a text). The key itself never leaves the front end.
- Bypass: `Cache-Control: no-cache` or `no-store` (an HTTP header, or gRPC metadata), or
  PoolingParams.bypass_cache: neither read nor written.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace
from typing import TypeVar

from pooling_server.engine.caching.key import scope_of
from pooling_server.engine.requests.request import PoolRequest, RerankRequest
from pooling_server.service.ops.config import ServerConfig

R = TypeVar("R", PoolRequest, RerankRequest)

BYPASS_DIRECTIVES = frozenset({"no-cache", "no-store"})


class CacheControl:
    def __init__(self, config: ServerConfig) -> None:
        self.scoped = bool(config.api_keys) and config.cache_scope == "key"

    def apply(self, request: R, headers: Iterable[tuple[str, str | bytes]]) -> R:
        """The request with its scope and bypass set from the call's headers."""
        scope, bypass = "", request.bypass_cache
        for name, value in headers:
            if name == "authorization" and self.scoped and not scope:
                text = value.decode("latin-1") if isinstance(value, bytes) else value
                method, _, token = text.partition(" ")
                if method.lower() == "bearer":
                    scope = scope_of(token)
            elif name == "cache-control" and not bypass:
                text = value.decode("latin-1") if isinstance(value, bytes) else value
                directives = {part.strip().lower() for part in text.split(",")}
                bypass = not directives.isdisjoint(BYPASS_DIRECTIVES)
        if scope == request.cache_scope and bypass == request.bypass_cache:
            return request
        return replace(request, cache_scope=scope, bypass_cache=bypass)
