"""The memory tier: an LRU of raw outputs with a byte budget (--cache-mb), one per engine
process, shared by its models (the model is in every key) and its threads."""

from __future__ import annotations

import threading
from collections import OrderedDict

import numpy as np

# What an entry costs beyond its values: the key, the array object, the LRU's node.
ENTRY_OVERHEAD = 200


class MemoryTier:
    def __init__(self, budget_bytes: int) -> None:
        self.budget = budget_bytes
        self._entries: OrderedDict[bytes, np.ndarray] = OrderedDict()
        self._lock = threading.Lock()
        self.bytes = 0
        self.evictions = 0

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: bytes) -> np.ndarray | None:
        with self._lock:
            value = self._entries.get(key)
            if value is not None:
                self._entries.move_to_end(key)
            return value

    def get_many(self, keys: list[bytes]) -> list[np.ndarray | None]:
        with self._lock:
            entries = self._entries
            found = []
            for key in keys:
                value = entries.get(key)
                if value is not None:
                    entries.move_to_end(key)
                found.append(value)
            return found

    def put(self, key: bytes, value: np.ndarray) -> None:
        """Keep `value` (read-only, never a view of a batch's buffer); an entry over the
        whole budget is not kept; the least recently used go to make room."""
        size = value.nbytes + ENTRY_OVERHEAD
        if size > self.budget:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self.bytes -= old.nbytes + ENTRY_OVERHEAD
            self._entries[key] = value
            self.bytes += size
            while self.bytes > self.budget:
                _, dropped = self._entries.popitem(last=False)
                self.bytes -= dropped.nbytes + ENTRY_OVERHEAD
                self.evictions += 1
