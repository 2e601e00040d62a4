"""Single-flight: an item being computed is computed once, however many requests ask for
it meanwhile, from any front end of the engine process.

The batching queue (engine/scheduling/batch_queue.py) owns one `Flights` per model, under
its lock: the first request to miss an item queues it and opens its flight; the others
join it as waiters, and its forward answers them all. A flight whose owner goes away
before its item runs passes to a waiter still waiting.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from pooling_server.engine.caching.cache import ResultCache
from pooling_server.engine.caching.key import KEY_BYTES, folder_digest, item_key

# A waiter: (its job, the item's index in job.work).
Waiter = tuple[Any, int]


class Flights(dict[bytes, list[Waiter]]):
    """Each item key being computed: the requests waiting for it besides its owner."""


@dataclass
class ModelCache:
    """One model's view of the process's result cache: its identity, and its flights.
    `runner`: its LoRA adapters' folders, hashed into the identity of a job run with one."""

    results: ResultCache
    identity: bytes
    runner: Any = None

    def __post_init__(self) -> None:
        self.flights = Flights()

    def keys(self, job: Any) -> list[bytes]:
        tag, identity = job.cache, self.identity
        adapter = getattr(job, "adapter", None)
        if adapter is not None:
            identity = self._with_adapter(adapter)
        return [item_key(identity, tag, sequence, keep) for sequence, keep in job.work]

    def _with_adapter(self, adapter: str) -> bytes:
        """The identity with the adapter's name and its folder's digest (files re-hashed
        only when their sizes or mtimes change: an adapter reloaded with new weights misses)."""
        paths = getattr(getattr(self.runner, "adapters", None), "paths", None) or {}
        folder = paths.get(adapter)
        hasher = hashlib.blake2b(self.identity, digest_size=KEY_BYTES)
        hasher.update(adapter.encode())
        hasher.update(b"\0")
        hasher.update(folder_digest(folder) if folder is not None else b"")
        return hasher.digest()

    def store(self, key: bytes, values: np.ndarray) -> np.ndarray:
        return self.results.store(key, values)
