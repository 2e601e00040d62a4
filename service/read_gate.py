"""Turns for reading gRPC request messages, so that large ones are not all held at once.

grpcio hands a request to Python as gRPC core's slices, then a bytearray grown slice by
slice, then a bytes copy: a 16 MB message costs about 48 MB while it is read. Unbounded,
three clients sending such messages side by side took +105-144 MB, and more clients more.
So while large messages come, each read waits for one of `slots` turns before it asks gRPC
core for its message; until then all but the first UNREAD_WINDOW_BYTES of it stay in the
client's socket (service/config.py sets that HTTP/2 window, and turns gRPC core's window
probing off, which would open it whether anyone reads or not).

Turns cost a loop round trip per read, a fifth of the rate of small calls at C=64 when
every read took one, so they are taken only within `heavy_s` of the last message of
LARGE_MESSAGE_BYTES or more: an ordinary load never waits, a flood of large messages is
read one after another from its second message on. A read keeps its turn at most `hold_s`: a
client that sends slowly then reads on without one (its bytes arrive no faster than it
sends them), so slow senders cannot stop everyone else's reads.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc

from service.config import LARGE_MESSAGE_BYTES


class ReadGate:
    """At most `slots` request messages read at once per process while large ones come
    (0: no limit)."""

    def __init__(self, slots: int, hold_s: float, heavy_s: float = 5.0) -> None:
        self._turns = asyncio.Semaphore(slots) if slots else None
        self.hold_s = hold_s
        self.heavy_s = heavy_s
        self._heavy_until = float("-inf")  # loop time

    def saw(self, size: int) -> None:
        """A message of `size` bytes was read: a large one starts (or extends) turns."""
        if size >= LARGE_MESSAGE_BYTES and self._turns is not None:
            self._heavy_until = asyncio.get_running_loop().time() + self.heavy_s

    async def read(self, context: grpc.aio.ServicerContext) -> Any:
        """The call's next message (or grpc.aio.EOF), read in turn while large ones come."""
        if self._turns is None:
            return await context.read()
        loop = asyncio.get_running_loop()
        if loop.time() >= self._heavy_until:
            return await context.read()
        await self._turns.acquire()
        turn = _Turn(self._turns)
        timer = loop.call_later(self.hold_s, turn.give_back)
        try:
            return await context.read()
        finally:
            timer.cancel()
            turn.give_back()

    async def messages(self, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """A stream's messages, each read in turn: what grpcio's request iterator yields."""
        while (message := await self.read(context)) is not grpc.aio.EOF:
            yield message


class _Turn:
    """A turn given back once: at the end of the read or when its hold time runs out."""

    __slots__ = ("_turns",)

    def __init__(self, turns: asyncio.Semaphore) -> None:
        self._turns: asyncio.Semaphore | None = turns

    def give_back(self) -> None:
        if self._turns is not None:
            self._turns.release()
            self._turns = None
