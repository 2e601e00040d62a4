"""Flow control of what a call leaves unanswered or unread: a weighted limit on a stream's
unanswered items, and the bound on answers sent and not yet read (per connection, in all)."""

from __future__ import annotations

import asyncio

from pooling_server.service.ops.config import TransportConfig


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


def unsent_per_connection(transport: TransportConfig, max_message_bytes: int) -> int:
    """What one connection may have handed to HTTP/2 and not yet sent: a quarter of the
    process's --max-unsent-answer-mb, at least two messages' worth, never more than it."""
    total = transport.max_unsent_answer_bytes
    return min(total, max(total // 4, 2 * max_message_bytes))


class AnswerBudget:
    """Answers handed to gRPC core and not yet sent, per connection (gRPC's peer) and in
    all: the grpcio door's bound on what clients that never read may make it hold (the
    Node door keeps the same accounting in node_door.mjs). A small answer may use a reserve
    of a quarter beyond the total, so stalled readers of large answers cannot starve small
    calls; a connection or a server with nothing unsent always takes one answer.

    `copies`: what an answer costs while unsent, in answers: grpcio holds it twice (the
    bytes its handler returned, kept until the send completes, and gRPC core's copy)."""

    def __init__(self, total: int, per_connection: int, large: int, copies: int = 1) -> None:
        self.total = total
        self.per_connection = per_connection
        self.large = large
        self.copies = copies
        self.used = 0
        self._by_peer: dict[str, int] = {}

    def refusal(self, peer: str, size: int) -> str | None:
        """Take `size` bytes (times `copies`) for `peer`'s answer; or, where it does not
        fit, why not. `give` takes the same `size` back."""
        size *= self.copies
        held = self._by_peer.get(peer, 0)
        if held and held + size > self.per_connection:
            return f"the client has not read {held} bytes of earlier answers on this connection"
        room = self.total if size >= self.large else self.total + self.total // 4
        if self.used and self.used + size > room:
            return f"clients have not read {self.used} bytes of earlier answers from this server"
        self._by_peer[peer] = held + size
        self.used += size
        return None

    def give(self, peer: str, size: int) -> None:
        """`size` bytes of `peer`'s answers were sent, or their call is over."""
        size *= self.copies
        self.used -= size
        left = self._by_peer.get(peer, 0) - size
        if left > 0:
            self._by_peer[peer] = left
        else:
            self._by_peer.pop(peer, None)
