"""The standard health service, with Watch streams that end once the server drains.

grpc's own servicer never ends a Watch, and a server stop waits for every open call, so
one client doing client-side health checking would hold every shutdown for the whole
grace period. Watchers have been told NOT_SERVING by then; ending their streams lets them
move on to other replicas and lets the server exit.
"""

from __future__ import annotations

import asyncio
import contextlib

import grpc
from grpc_health.v1 import health, health_pb2


class HealthServicer(health.aio.HealthServicer):
    def __init__(self) -> None:
        super().__init__()
        self._closing = asyncio.Event()

    async def Watch(
        self, request: health_pb2.HealthCheckRequest, context: grpc.aio.ServicerContext
    ) -> None:
        watch = asyncio.ensure_future(super().Watch(request, context))
        closing = asyncio.ensure_future(self._closing.wait())
        await asyncio.wait({watch, closing}, return_when=asyncio.FIRST_COMPLETED)
        for task in (watch, closing):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def close_watches(self) -> None:
        """End every open Watch stream (call after the drain delay)."""
        self._closing.set()
