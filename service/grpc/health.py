"""The standard health service, with Watch streams that end once the server drains.

grpc's own servicer never ends a Watch, and a server stop waits for every open call, so
one client doing client-side health checking would hold every shutdown for the whole
grace period. Watchers have been told NOT_SERVING by then; ending their streams lets them
move on to other replicas and lets the server exit.
"""

from __future__ import annotations

import asyncio

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
        try:
            await asyncio.wait({watch, closing}, return_when=asyncio.FIRST_COMPLETED)
        finally:  # also when the client went away and this handler was cancelled
            for task in (watch, closing):
                task.cancel()
            # A write to a call the client closed fails; the watch is over either way.
            await asyncio.gather(watch, closing, return_exceptions=True)

    def close_watches(self) -> None:
        """End every open Watch stream (call after the drain delay)."""
        self._closing.set()
