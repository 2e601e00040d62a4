"""Turns for reading gRPC request messages, so that large ones are not all held at once.

grpcio hands a request to Python as gRPC core's slices, then a bytearray grown slice by
slice, then a bytes copy: a 16 MB message costs about 48 MB while it is read. Unbounded,
three clients sending such messages side by side took +105-144 MB, and more clients more.
So while large messages come, each read waits for one of `slots` turns before it asks gRPC
core for its message; until then all but the first UNREAD_WINDOW_BYTES of it stay in the
client's socket (service/ops/config.py sets that HTTP/2 window, and turns gRPC core's window
probing off, which would open it whether anyone reads or not).

Turns cost a loop round trip per read, a fifth of the rate of small calls at C=64 when
every read took one, so a read skips them while both of these hold: no message of
LARGE_MESSAGE_BYTES or more has come within `heavy_s`, and its connection has already sent a
small message read in turn. So a connection's first message is read in turn: a flood from
new connections is read one message at a time from its first message on (side by side, its
first messages took +80-100 MB), and an ordinary load, whose connections live on, waits
once per connection. A client that opens connections, sends a small message on each and
then large ones on all at once still has those first large ones read side by side: the
connection cap bounds that, not this gate. A read keeps its turn at most `hold_s`: a client
that sends slowly then reads on without one (its bytes arrive no faster than it sends
them), so slow senders cannot stop everyone else's reads; and a new connection's first
message waits at most `hold_s` for a turn, however many slow senders are in line.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc

from pooling_server.service.ops.config import LARGE_MESSAGE_BYTES


class ReadGate:
    """At most `slots` request messages read at once per process, while large ones come or
    from connections not yet seen to send a small one (0: no limit)."""

    def __init__(
        self,
        slots: int,
        hold_s: float,
        heavy_s: float = 5.0,
        known_peers: int = 4096,
        after_large: Callable[[], None] = lambda: None,
    ) -> None:
        """`after_large`: called once each large message is in Python's hands (its copies
        in gRPC core freed): service/ops/memory.py's trimmer."""
        self._after_large = after_large
        self._turns = asyncio.Semaphore(slots) if slots else None
        self.hold_s = hold_s
        self.heavy_s = heavy_s
        self._heavy_until = float("-inf")  # loop time
        self._large_seen = 0
        # Connections (gRPC's peer) that sent a small message, oldest first; bounded, as
        # closed connections are never announced.
        self._known: dict[str, None] = {}
        self._known_peers = known_peers

    def saw(self, size: int) -> None:
        """A message of `size` bytes was read: a large one starts (or extends) turns."""
        if size >= LARGE_MESSAGE_BYTES:
            self._after_large()
            if self._turns is not None:
                self._heavy_until = asyncio.get_running_loop().time() + self.heavy_s
                self._large_seen += 1

    def caller(self, context: grpc.aio.ServicerContext) -> str | None:
        """A call's connection, taken once per call for its reads (None without turns)."""
        return None if self._turns is None else context.peer()

    async def read(self, context: grpc.aio.ServicerContext, peer: str | None = None) -> Any:
        """The call's next message (or grpc.aio.EOF), read in turn while large ones come or
        while its connection (`peer`: `caller`'s, taken here when not given) is new."""
        if self._turns is None:
            return await context.read()
        if peer is None:
            peer = context.peer()
        loop = asyncio.get_running_loop()
        calm = loop.time() >= self._heavy_until
        if calm and peer in self._known:
            return await context.read()
        if calm:
            # Only new: slow senders holding the turns in line cannot keep a new
            # connection's first message waiting longer than one hold.
            try:
                async with asyncio.timeout(self.hold_s):
                    await self._turns.acquire()
            except TimeoutError:
                return await self._learning(context, peer)
        else:
            await self._turns.acquire()
        turn = _Turn(self._turns)
        timer = loop.call_later(self.hold_s, turn.give_back)
        try:
            return await self._learning(context, peer)
        finally:
            timer.cancel()
            turn.give_back()

    async def _learning(self, context: grpc.aio.ServicerContext, peer: str) -> Any:
        """The next message; its connection is known from now on if no large message came
        meanwhile (then this one was small)."""
        large_seen = self._large_seen
        message = await context.read()
        if message is not grpc.aio.EOF and self._large_seen == large_seen:
            self._know(peer)
        return message

    def _know(self, peer: str) -> None:
        if peer not in self._known:
            if len(self._known) >= self._known_peers:
                del self._known[next(iter(self._known))]
            self._known[peer] = None

    async def messages(self, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        """A stream's messages, each read in turn where `read` says: what grpcio's request
        iterator yields."""
        peer = self.caller(context)
        while (message := await self.read(context, peer)) is not grpc.aio.EOF:
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
