"""The server's version, as ListModels reports it."""

from __future__ import annotations

from functools import cache
from importlib.metadata import PackageNotFoundError, version

DISTRIBUTION = "pooling-server"
FALLBACK_VERSION = "0.1.0+unknown"  # running from a tree that was never installed


@cache
def server_version() -> str:
    try:
        return version(DISTRIBUTION)
    except PackageNotFoundError:
        return FALLBACK_VERSION
