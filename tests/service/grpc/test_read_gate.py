"""The read gate: reads at once while calm, one at a time while large messages come or
from a connection not yet seen to send a small one."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

import grpc
import pytest

from pooling_server.service.cli import build_parser, config_from_args
from pooling_server.service.grpc.read_gate import ReadGate
from pooling_server.service.ops import config, memory
from pooling_server.service.ops.config import LARGE_MESSAGE_BYTES


class SlowReads:
    """A stand-in ServicerContext whose reads each take `read_s`, counting overlap."""

    def __init__(
        self,
        read_s: float,
        messages: int = 1,
        peer: str = "ipv4:10.0.0.1:1",
        size: Callable[[int], None] | None = None,
    ) -> None:
        self.read_s = read_s
        self.peer_name = peer
        self.size = size  # told each message's size as it is read, as the deserializer tells
        self.left = messages
        self.now = 0
        self.most = 0

    def peer(self) -> str:
        return self.peer_name

    async def read(self) -> object:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(self.read_s)
        finally:
            self.now -= 1
        if self.left == 0:
            return grpc.aio.EOF
        self.left -= 1
        if self.size is not None:
            self.size(LARGE_MESSAGE_BYTES)
        return b"message"


async def _read_side_by_side(gate: ReadGate, context: SlowReads, calls: int) -> list[object]:
    return await asyncio.gather(*(gate.read(context) for _ in range(calls)))  # type: ignore[arg-type]


async def _wait_behind(gate: ReadGate, slow: list[SlowReads], context: SlowReads) -> float:
    """How long a read of `context` waits while the `slow` reads are under way."""
    loop = asyncio.get_running_loop()
    reads = [asyncio.ensure_future(gate.read(s)) for s in slow]  # type: ignore[arg-type]
    await asyncio.sleep(0)
    started = loop.time()
    assert await gate.read(context) == b"message"  # type: ignore[arg-type]
    waited = loop.time() - started
    for read in reads:
        read.cancel()
    await asyncio.gather(*reads, return_exceptions=True)
    return waited


async def _known(gate: ReadGate, context: SlowReads) -> None:
    """The connection of `context` sends one small message, read in turn."""
    context.left += 1
    assert await gate.read(context) == b"message"  # type: ignore[arg-type]


def test_a_new_connection_reads_in_turn_until_it_has_sent_a_small_message() -> None:
    """A flood's first messages, from connections never seen, are read one at a time."""

    async def main() -> tuple[int, int]:
        gate = ReadGate(1, hold_s=5.0)
        new = SlowReads(0.05, messages=4, peer="ipv4:10.0.0.2:7")
        await _read_side_by_side(gate, new, 4)
        known = SlowReads(0.05, messages=4, peer="ipv4:10.0.0.2:7")
        await _read_side_by_side(gate, known, 4)
        return new.most, known.most

    assert asyncio.run(main()) == (1, 4)


def test_a_large_first_message_does_not_make_its_connection_known() -> None:
    async def main() -> int:
        gate = ReadGate(1, hold_s=5.0, heavy_s=0.0)
        context = SlowReads(0.0, messages=1, size=gate.saw)
        assert await gate.read(context) == b"message"  # type: ignore[arg-type]
        later = SlowReads(0.05, messages=3)
        await _read_side_by_side(gate, later, 3)
        return later.most

    assert asyncio.run(main()) == 1


def test_known_connections_are_bounded_oldest_forgotten() -> None:
    async def main() -> list[int]:
        gate = ReadGate(1, hold_s=5.0, known_peers=2)
        for port in (1, 2, 3):
            await _known(gate, SlowReads(0.0, messages=0, peer=f"ipv4:10.0.0.1:{port}"))
        overlaps = []
        for port in (1, 3):
            context = SlowReads(0.05, messages=3, peer=f"ipv4:10.0.0.1:{port}")
            await _read_side_by_side(gate, context, 3)
            overlaps.append(context.most)
        return overlaps

    assert asyncio.run(main()) == [1, 3]


def test_calm_reads_run_side_by_side() -> None:
    async def main() -> int:
        gate = ReadGate(1, hold_s=5.0)
        gate.saw(LARGE_MESSAGE_BYTES - 1)  # below the cue
        context = SlowReads(0.05, messages=4)
        await _known(gate, context)
        await _read_side_by_side(gate, context, 4)
        return context.most

    assert asyncio.run(main()) == 4


def test_after_a_large_message_reads_take_turns_until_it_is_calm_again() -> None:
    async def main() -> tuple[int, int]:
        gate = ReadGate(1, hold_s=5.0, heavy_s=0.3)
        await _known(gate, SlowReads(0.0, messages=0))
        gate.saw(LARGE_MESSAGE_BYTES)
        heavy = SlowReads(0.05, messages=4)
        await _read_side_by_side(gate, heavy, 4)
        await asyncio.sleep(0.3)
        calm = SlowReads(0.05, messages=4)
        await _read_side_by_side(gate, calm, 4)
        return heavy.most, calm.most

    assert asyncio.run(main()) == (1, 4)


def test_a_slow_read_gives_up_its_turn_after_hold_s() -> None:
    """Two readers stuck on slow senders cannot hold up a third past the hold time."""

    async def main() -> float:
        gate = ReadGate(2, hold_s=0.1)
        gate.saw(16 << 20)
        return await _wait_behind(gate, [SlowReads(2.0) for _ in range(2)], SlowReads(0.0))

    assert asyncio.run(main()) < 1.0


def test_a_stream_reads_each_message_then_ends() -> None:
    async def main() -> list[object]:
        gate = ReadGate(1, hold_s=1.0)
        gate.saw(LARGE_MESSAGE_BYTES)
        return [m async for m in gate.messages(SlowReads(0.0, messages=3))]  # type: ignore[arg-type]

    assert asyncio.run(main()) == [b"message"] * 3


def test_no_slots_means_no_gate() -> None:
    async def main() -> int:
        gate = ReadGate(0, hold_s=1.0)
        gate.saw(16 << 20)
        context = SlowReads(0.05, messages=3)
        await _read_side_by_side(gate, context, 3)
        return context.most

    assert asyncio.run(main()) == 3


@pytest.mark.parametrize(("reads", "window_fixed"), [("1", True), ("0", False)])
def test_flags_reach_the_gate_and_the_http2_window(reads: str, window_fixed: bool) -> None:
    """With turns, a message waiting for one holds at most UNREAD_WINDOW_BYTES: gRPC core's
    window probing, which would open the window regardless, is off."""
    args = build_parser().parse_args(["--max-concurrent-reads", reads, "--read-turn-s", "0.25"])
    transport = config_from_args(args).transport
    assert (transport.max_concurrent_reads, transport.read_turn_s) == (int(reads), 0.25)
    options = dict(transport.options(16 << 20))
    assert (options.get("grpc.http2.bdp_probe") == 0) is window_fixed
    assert (options.get("grpc.http2.lookahead_bytes") == config.UNREAD_WINDOW_BYTES) is window_fixed


def test_reads_must_be_a_count(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--max-concurrent-reads", "-1"])
    assert "--max-concurrent-reads" in capsys.readouterr().err


def test_each_large_message_is_followed_by_a_trim() -> None:
    """The free pages gRPC core's slices leave between live blocks go back to the system."""
    trims = []
    gate = ReadGate(1, hold_s=1.0, after_large=lambda: trims.append(1))

    async def main() -> None:
        gate.saw(LARGE_MESSAGE_BYTES - 1)
        gate.saw(LARGE_MESSAGE_BYTES)
        gate.saw(16 << 20)

    asyncio.run(main())
    assert len(trims) == 2
    memory.trimmer()()  # glibc's malloc_trim, or nothing elsewhere: it must not raise


def test_a_first_message_waits_at_most_one_hold_behind_slow_senders() -> None:
    """Ten new connections' slow first messages in line: an eleventh waits one hold, not ten."""

    async def main() -> float:
        gate = ReadGate(1, hold_s=0.1)
        slow = [SlowReads(5.0, peer=f"ipv4:10.0.0.9:{port}") for port in range(10)]
        return await _wait_behind(gate, slow, SlowReads(0.0, peer="ipv4:10.0.0.8:1"))

    assert asyncio.run(main()) < 0.5


def test_a_first_message_read_without_its_turn_still_makes_its_connection_known() -> None:
    """Behind slow senders a new connection waits one hold once, not on every call."""

    async def main() -> tuple[float, float]:
        gate = ReadGate(1, hold_s=0.3)
        peer = "ipv4:10.0.0.7:1"
        first = await _wait_behind(
            gate, [SlowReads(5.0, peer="ipv4:10.0.0.9:1")], SlowReads(0.0, peer=peer)
        )
        again = await _wait_behind(
            gate, [SlowReads(5.0, peer="ipv4:10.0.0.9:2")], SlowReads(0.0, peer=peer)
        )
        return first, again

    first, again = asyncio.run(main())
    assert first >= 0.25 and again < 0.1, (first, again)
