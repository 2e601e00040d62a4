"""Attacks on the gRPC door, each beside a bystander (issue 36's held-out table).

Run against the default door (`--grpc-door auto`: Node.js where it is installed), a server
per attack, serving all-MiniLM-L6-v2 as in the issue's figures (and, for the token_embed
answers, a one-layer BERT of MiniLM's width, so that computing them takes seconds on 2 cores):

- 200 concurrent calls, each ~15 KB of gzip inflating to a 15.8 MB request;
- a client that never opens its receive window and asks 30 large token_embed answers;
- 8 connections x 4,096 half-open streams (HEADERS, no DATA);
- Tokenize of 8 texts of 250,000 characters (about 1M tokens), one call, then four at once.

Each must hold: the bystander (attack_kit's Bystander: one small Pool every 100 ms on its
own connection) never fails and never waits 1 s (attack_kit's QUICK_BYSTANDER: its target;
2 s fails the test on a busy host); the resident memory of the server's processes but its
engines (the supervisor, the front end and the door's Node.js child, see DoorRss) grows
less than 300 MB at the peak and is back under 100 MB of growth once the attacker has gone;
every answer is a documented status (never INTERNAL, never hung); answers that scale with
the input stay within the response cap. Each test prints one `RELIABILITY <name>:` line
with its figures, and fails naming the attack and the figures.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import pytest
from hyperframe.frame import HeadersFrame

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.fixture_models import MINILM, wide_bert
from tests.reliability.attack_kit import (
    MB,
    QUICK_BYSTANDER,
    Verdict,
    node_rss_mb,
    warm_up,
    watching_door,
    wide_token_embed,
)
from tests.reliability.support import CLIENT_ERROR_CODES, check_rpc_error
from tests.reliability.test_attacks import RawHttp2, grpc_frame, gzip_pool_request
from tests.server_process import ServerProcess, all_serving, spawn_server

pytestmark = pytest.mark.quiet  # times a bystander: `make test` runs it with nothing beside it

SERVICE = "/pooling.v1.PoolingService"
RESPONSE_CAP = 16 << 20  # --max-message-mb's default
BOMB_CALLS = 200
BOMB_CONNECTIONS = 4
BOMB_WORDS = 7_900_000  # "a " repeated: a 15.8 MB text, ~15 KB of gzip
UNREAD_CALLS = 30
UNREAD_TEXTS = 32  # each answer: 32 x 128 tokens x 384 floats, about 6.3 MB
HALF_OPEN_CONNECTIONS = 8
HALF_OPEN_STREAMS = 4096
HOLD_S = 3.0
TOKENIZE_TEXTS = 8
TOKENIZE_CHARS = 250_000  # within Tokenize's 1,024 characters a token of MiniLM's maximum


ATTACKS = ("bombs", "unread", "half_open", "tokenize")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """A server per attack, started side by side, so that what one attack leaves behind
    (memory, work) is never counted against the next: MiniLM (the default, the bystander's
    and Tokenize's model) and the wide BERT."""
    root = tmp_path_factory.mktemp("attacks-grpc-door")
    wide = wide_bert(root / "wide")
    args = ["--model", f"minilm={MINILM}", "--model", f"wide={wide}", "--dtype", "float32"]
    started = {name: spawn_server(args, root, name) for name in ATTACKS}
    with all_serving(started.values(), stop_timeout=20):
        for process in started.values():
            warm_up(process, token_embed_texts=2, tokenize=True)
        yield started


# --------------------------------------------------------------------------- bare HTTP/2


def send_bodies(raw: RawHttp2, bodies: dict[int, bytes], timeout: float) -> int:
    """Send each stream's body (then END_STREAM) as flow control allows, round robin;
    returns how many bodies went out whole within `timeout`."""
    left = {stream_id: memoryview(body) for stream_id, body in bodies.items()}
    deadline = time.monotonic() + timeout
    while left and time.monotonic() < deadline and raw.terminated is None:
        sent = False
        for stream_id in list(left):
            if raw.calls[stream_id].done:
                del left[stream_id]
                continue
            room = min(
                raw.conn.local_flow_control_window(stream_id), raw.conn.max_outbound_frame_size
            )
            if room <= 0:
                continue
            chunk, left[stream_id] = left[stream_id][:room], left[stream_id][room:]
            raw.conn.send_data(stream_id, bytes(chunk), end_stream=not left[stream_id])
            sent = True
            if not left[stream_id]:
                del left[stream_id]
        raw.flush()
        if not sent:
            raw.pump(0.05)
    return len(bodies) - len(left)


class HalfOpen:
    """One connection that opens `streams` calls with HEADERS and never sends DATA.

    h2 opens streams in quadratic time (each counts the open ones), so after h2's
    handshake the HEADERS are written by hand: one header block without HPACK indexing,
    the same bytes for every stream. What the server sends back is read and dropped."""

    def __init__(self, port: int, streams: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        conn = h2.connection.H2Connection(config)
        conn.initiate_connection()
        self.sock.sendall(conn.data_to_send())
        deadline = time.monotonic() + 10
        settled = False
        while not settled:  # the server's SETTINGS, acknowledged
            assert time.monotonic() < deadline, "no SETTINGS from the server"
            events = conn.receive_data(self.sock.recv(1 << 16))
            settled = any(isinstance(e, h2.events.RemoteSettingsChanged) for e in events)
        self.sock.sendall(conn.data_to_send())
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", f"{SERVICE}/Pool"),
            (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        ]
        block = hpack.Encoder().encode([hpack.NeverIndexedHeaderTuple(*h) for h in headers])
        frames = b"".join(
            HeadersFrame(stream_id, data=block, flags=["END_HEADERS"]).serialize()
            for stream_id in range(1, 2 * streams, 2)
        )
        self.received = 0
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()
        self.sock.sendall(frames)

    def _drain(self) -> None:
        try:
            while data := self.sock.recv(1 << 16):
                self.received += len(data)
        except OSError:
            pass

    def close(self) -> None:
        self.sock.close()
        self._reader.join(5)


# --------------------------------------------------------------------------- the attacks


def test_gzip_bombs_two_hundred_at_once(servers: dict[str, ServerProcess], record_property) -> None:
    """200 concurrent calls over 4 connections, each 15 KB of gzip that inflates to a
    15.8 MB embed text (under the 16 MiB message cap): each refused as a documented
    status, with the server's memory bounded by what it reads at once."""
    server = servers["bombs"]
    body = grpc_frame(gzip_pool_request(BOMB_WORDS), compressed=True)
    per_connection = BOMB_CALLS // BOMB_CONNECTIONS
    outcomes: Counter[str] = Counter()
    sent: list[int] = []

    def attack() -> None:
        raw = RawHttp2(server.port, timeout=10)
        try:
            streams = [
                raw.open("Pool", (("grpc-encoding", "gzip"),)) for _ in range(per_connection)
            ]
            raw.flush()
            sent.append(send_bodies(raw, dict.fromkeys(streams, body), timeout=30))
            raw.wait(streams, timeout=30)
            outcomes.update(raw.calls[s].outcome() for s in streams)
        finally:
            raw.close()

    with watching_door(server, QUICK_BYSTANDER) as watch:
        started = time.monotonic()
        attackers = [threading.Thread(target=attack) for _ in range(BOMB_CONNECTIONS)]
        for thread in attackers:
            thread.start()
        for thread in attackers:
            thread.join(90)
        watch.answer_s = time.monotonic() - started
    verdict = Verdict.after("200 gzip bombs", server, watch, record_property)
    verdict.report(
        "attacks_grpc_door_gzip_bombs",
        wire_kb=len(body) / 1024,
        inflated_mb=2 * BOMB_WORDS / 1e6,
        sent=sum(sent),
        outcomes=dict(outcomes),
        node_rss_mb=node_rss_mb(server),
    )
    documented = {f"grpc-status {code.value[0]}" for code in CLIENT_ERROR_CODES}
    answered = sum(n for outcome, n in outcomes.items() if outcome.split(" (")[0] in documented)
    if answered != BOMB_CALLS:
        verdict.problems.append(
            f"{answered} of {BOMB_CALLS} calls refused as documented: {dict(outcomes)}"
        )
    verdict.check()


def test_a_client_that_never_reads_thirty_large_answers(
    servers: dict[str, ServerProcess], record_property
) -> None:
    """One connection whose receive window is 0 and stays so asks 30 token_embed answers
    of about 6 MB each, holds them a while, and leaves: the server may not keep them."""
    server = servers["unread"]
    request = grpc_frame(wide_token_embed(UNREAD_TEXTS).SerializeToString())
    with watching_door(server, QUICK_BYSTANDER) as watch:
        started = time.monotonic()
        raw = RawHttp2(server.port, timeout=10)
        try:
            raw.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
            raw.flush()
            streams = [raw.start("Pool", request, flush=False) for _ in range(UNREAD_CALLS)]
            raw.flush()
            hold_until = time.monotonic() + 12
            while time.monotonic() < hold_until:  # until every answer has begun, or 12 s
                raw.pump(0.2)  # no DATA can come: nothing is acknowledged
                if all(raw.calls[s].headers or raw.calls[s].done for s in streams):
                    break
            time.sleep(1.0)
            begun = sum(bool(raw.calls[s].headers) for s in streams)
            node_held = node_rss_mb(server)
        finally:
            raw.close()
        watch.answer_s = time.monotonic() - started
    verdict = Verdict.after("30 unread token_embed answers", server, watch, record_property)
    verdict.report(
        "attacks_grpc_door_unread_answers",
        calls=UNREAD_CALLS,
        answers_begun=begun,
        node_rss_held_mb=node_held,
    )
    verdict.check()


def test_half_open_streams_lock_no_one_out(
    servers: dict[str, ServerProcess], record_property
) -> None:
    """8 connections x 4,096 streams with HEADERS and no DATA, held 3 s: others are still
    served (open calls are capped per connection and per client, not only in all), and
    the streams' memory goes when their connections do."""
    server = servers["half_open"]
    with watching_door(server, QUICK_BYSTANDER) as watch:
        started = time.monotonic()
        attackers = [HalfOpen(server.port, HALF_OPEN_STREAMS) for _ in range(HALF_OPEN_CONNECTIONS)]
        try:
            time.sleep(HOLD_S)
            received_kb = sum(a.received for a in attackers) / 1024
            node_held = node_rss_mb(server)
        finally:
            for attacker in attackers:
                attacker.close()
        watch.answer_s = time.monotonic() - started
    verdict = Verdict.after("8 x 4,096 half-open streams", server, watch, record_property)
    verdict.report(
        "attacks_grpc_door_half_open_streams",
        streams=HALF_OPEN_CONNECTIONS * HALF_OPEN_STREAMS,
        answered_kb=received_kb,
        node_rss_held_mb=node_held,
    )
    verdict.check()


def _tokenize(address: str, request: pb.TokenizeRequest) -> object:
    with grpc.insecure_channel(
        address, options=[("grpc.max_receive_message_length", -1)]
    ) as channel:
        try:
            return pooling_pb2_grpc.PoolingServiceStub(channel).Tokenize(request, timeout=60)
        except grpc.RpcError as error:
            return error


@pytest.mark.parametrize("at_once", [1, 4])
def test_tokenize_of_a_million_tokens(
    servers: dict[str, ServerProcess], at_once: int, record_property
) -> None:
    """8 texts of 250,000 characters (about 1M tokens, inside every documented bound) in
    one Tokenize call, then four such calls at once: each answer fits the response cap
    or is refused as too large, without the server's memory or the bystander paying."""
    server = servers["tokenize"]  # one call, then four at once: the same attack, grown
    request = pb.TokenizeRequest(texts=["a " * (TOKENIZE_CHARS // 2)] * TOKENIZE_TEXTS)
    results: list[object] = []
    with watching_door(server, QUICK_BYSTANDER) as watch:
        started = time.monotonic()
        callers = [
            threading.Thread(target=lambda: results.append(_tokenize(server.address, request)))
            for _ in range(at_once)
        ]
        for thread in callers:
            thread.start()
        for thread in callers:
            thread.join(90)
        watch.answer_s = time.monotonic() - started
    verdict = Verdict.after(
        f"Tokenize of ~1M tokens, {at_once} at once", server, watch, record_property
    )
    outcomes = Counter(
        r.code().name if isinstance(r, grpc.RpcError) else "OK"  # type: ignore[attr-defined]
        for r in results
    )
    sizes = [r.ByteSize() for r in results if isinstance(r, pb.TokenizeResponse)]
    verdict.report(
        f"attacks_grpc_door_tokenize_{at_once}",
        calls=at_once,
        outcomes=dict(outcomes),
        largest_answer_mb=max(sizes, default=0) / MB,
    )
    if len(results) != at_once:
        verdict.problems.append(f"{at_once - len(results)} calls never returned")
    for result in results:
        if isinstance(result, grpc.RpcError):
            try:
                check_rpc_error(result, CLIENT_ERROR_CODES)
            except AssertionError as problem:
                verdict.problems.append(f"refused without a documented status: {problem}")
    if any(size > RESPONSE_CAP for size in sizes):
        verdict.problems.append(f"answers of {max(sizes) / MB:.1f} MB, over the response cap")
    verdict.check()
