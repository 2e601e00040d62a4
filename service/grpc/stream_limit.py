"""A weighted limit on unanswered items per stream (the stream's flow control)."""

from __future__ import annotations

import asyncio


class InflightLimit:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.used = 0
        self._changed = asyncio.Condition()

    async def acquire(self, weight: int) -> None:
        """Wait for room; a request heavier than the whole capacity waits for an empty stream."""
        weight = min(weight, self.capacity)
        async with self._changed:
            await self._changed.wait_for(lambda: self.used + weight <= self.capacity)
            self.used += weight

    def release(self, weight: int) -> None:
        self.used -= min(weight, self.capacity)
        asyncio.get_running_loop().create_task(self._notify())

    async def _notify(self) -> None:
        async with self._changed:
            self._changed.notify_all()
