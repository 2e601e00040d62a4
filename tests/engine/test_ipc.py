"""The link between a front end and an engine process: framing, closing, a peer that stops."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from pooling_server.engine.scheduling import ipc
from pooling_server.engine.scheduling.ipc import Link


def _pair() -> tuple[Link, Link]:
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    return Link(a), Link(b)


def test_messages_arrive_whole_and_in_order() -> None:
    """Small messages, an empty payload, and one far larger than the socket's buffer (sent
    in several sendmsg calls), from two threads at once, each read whole."""
    sender, reader = _pair()
    big = np.arange(3_000_000, dtype="<f4")  # 12 MB
    small = [(f"h{k}".encode(), [np.full(k, k, dtype="<i4")]) for k in range(50)]

    def send(messages: list[tuple[bytes, list[np.ndarray]]]) -> None:
        for header, payload in messages:
            sender.send(header, payload)

    threads = [
        threading.Thread(target=send, args=(small,)),
        threading.Thread(target=send, args=([(b"big", [big[:1_000_000], big[1_000_000:]])],)),
    ]
    for thread in threads:
        thread.start()
    received = {}
    for _ in range(len(small) + 1):
        message = reader.read()
        assert message is not None
        received[message[0]] = message[1]
    for thread in threads:
        thread.join()
    assert np.array_equal(np.frombuffer(received[b"big"], dtype="<f4"), big)
    for k in range(50):
        assert np.array_equal(np.frombuffer(received[f"h{k}".encode()], dtype="<i4"), [k] * k)
    sender.send(b"empty")
    assert reader.read() == (b"empty", bytearray())


def test_a_closed_link_ends_reading_and_refuses_sending() -> None:
    sender, reader = _pair()
    sender.send(b"last", [b"x"])
    sender.close()
    assert reader.read() == (b"last", bytearray(b"x"))
    assert reader.read() is None  # the peer's end closed
    with pytest.raises(OSError):
        sender.send(b"more")


def test_closing_wakes_a_blocked_reader() -> None:
    _, reader = _pair()
    result: list[object] = []
    thread = threading.Thread(target=lambda: result.append(reader.read()))
    thread.start()
    time.sleep(0.1)
    reader.close()
    thread.join(5)
    assert result == [None]


@pytest.mark.timeout(20)  # a send that blocks for ever is the failure
def test_a_peer_that_stops_reading_cannot_stall_the_sender(monkeypatch) -> None:
    """A stopped front end: the engine's forward worker gives up after SEND_TIMEOUT_S
    without progress, and the link is closed rather than left cut mid-message."""
    monkeypatch.setattr(ipc, "SEND_TIMEOUT_S", 0.3)
    sender, _stopped = _pair()
    started = time.monotonic()
    with pytest.raises(OSError):
        sender.send(b"h", [np.zeros(16_000_000, dtype="<f4")])  # 64 MB: never read
    assert time.monotonic() - started < 3.0
    with pytest.raises(OSError):
        sender.send(b"after")
