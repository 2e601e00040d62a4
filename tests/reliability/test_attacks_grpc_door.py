"""Attacks on the gRPC door, each beside a bystander (issue 36's held-out table).

Run against the default door (`--grpc-door auto`: Node.js where it is installed), a server
per attack, serving all-MiniLM-L6-v2 as in the issue's figures (and, for the token_embed
answers, a one-layer BERT of MiniLM's width, so that computing them takes seconds on 2 cores):

- 200 concurrent calls, each ~15 KB of gzip inflating to a 15.8 MB request;
- a client that never opens its receive window and asks 30 large token_embed answers;
- 8 connections x 4,096 half-open streams (HEADERS, no DATA);
- Tokenize of 8 texts of 250,000 characters (about 1M tokens), one call, then four at once.

Each must hold: the bystander (attack_kit's Bystander: one small Pool every 100 ms on its
own connection) never fails and never waits 1 s; the resident memory of the server's
processes but its engines (the supervisor, the front end and the door's Node.js child, see
DoorRss) grows less than 300 MB at the peak and is back under 100 MB of growth once the
attacker has gone; every answer is a documented status (never INTERNAL, never hung); answers
that scale with the input stay within the response cap. Each test prints one
`RELIABILITY <name>:` line with its figures, and fails naming the attack and the figures.
"""

from __future__ import annotations

import functools
import socket
import threading
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.events
import h2.settings
import hpack
import psutil
import pytest
import torch
from hyperframe.frame import HeadersFrame
from transformers import AutoTokenizer, BertConfig, BertModel

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.fixture_models import MINILM
from tests.reliability.attack_kit import MB, Bystander, PeakRss, Watch
from tests.reliability.support import (
    CLIENT_ERROR_CODES,
    assert_alive,
    check_rpc_error,
    embed_request,
    report,
)
from tests.reliability.test_attacks import RawHttp2, grpc_frame, gzip_pool_request
from tests.server_process import ServerProcess, all_serving, spawn_server

pytestmark = pytest.mark.quiet  # times a bystander: `make test` runs it with nothing beside it

SERVICE = "/pooling.v1.PoolingService"
PEAK_LIMIT_MB = 300  # growth while an attack runs
SETTLED_LIMIT_MB = 100  # growth once the attacker has gone
SETTLE_S = 10.0  # how long the server has to give memory back after the attacker leaves
IDLE_S = 30.0  # how long the server may stay busy with an attack's work once it has gone
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


def wide_bert(folder: Path) -> Path:
    """MiniLM's width (384) in one layer of 128 positions with a narrow feed-forward:
    answers as large per token as MiniLM's at a small part of its forward cost, in batches
    short enough that the bystander's call never waits long behind one on 2 cores. The
    attack tests the door's handling of the answers, not the CPU's speed."""
    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=384,
        num_hidden_layers=1,
        num_attention_heads=6,
        intermediate_size=32,
        max_position_embeddings=128,
    )
    BertModel(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(MINILM).save_pretrained(folder)
    return folder


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
            _warm_up(process)
        yield started


def _warm_up(process: ServerProcess) -> None:
    """The first batches of each shape, so that the bystander does not pay for them."""
    with grpc.insecure_channel(process.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        for _ in range(5):
            stub.Pool(embed_request(["a bystander"]), timeout=60)
        stub.Pool(_token_embed(2), timeout=60)
        stub.Tokenize(pb.TokenizeRequest(texts=["warm " * 1000]), timeout=60)


def _token_embed(texts: int) -> pb.PoolRequest:
    """token_embed of `texts` texts cut to the wide BERT's 128 tokens: the largest answers a
    text can ask for."""
    return pb.PoolRequest(
        model="wide",
        token_embed=pb.TextInput(texts=["word and more " * 50] * texts),
        params=pb.PoolingParams(truncate_prompt_tokens=-1),
    )


# --------------------------------------------------------------------------- figures


def door(server: ServerProcess) -> str:
    return server.grpc_door()


def node_rss_mb(server: ServerProcess) -> float:
    """The Node.js door's own resident memory (0 when grpcio serves gRPC)."""
    tree = psutil.Process(server.process.pid).children(recursive=True)
    return sum(p.memory_info().rss for p in tree if p.name() == "node") / MB


@functools.lru_cache(maxsize=64)
def _is_engine(pid: int) -> bool:
    try:
        return "engine" in psutil.Process(pid).cmdline()
    except psutil.Error:
        return False


class DoorRss(PeakRss):
    """PeakRss over every server process but the engines: the supervisor, the front end
    that holds the door, and the door's Node.js child. An engine's forward pass keeps its
    own scratch memory whatever door fed it; what an attack on the door costs is here."""

    def _counted(self, process: psutil.Process) -> bool:
        return not _is_engine(process.pid)


@contextmanager
def watching(server: ServerProcess) -> Iterator[Watch]:
    """attack_kit.watching, with the door's processes sampled (DoorRss)."""
    bystander = Bystander(server.address)
    bystander.start()
    rss = DoorRss(server.process.pid)
    try:
        yield Watch(bystander, rss)
    finally:
        time.sleep(0.2)  # a last bystander call or two after the attack
        rss.stop()
        bystander.stop()


def idle_after(server: ServerProcess) -> float:
    """Seconds until a short call is answered within a second again (IDLE_S at most): the
    attack's work that outlives the attacker, and what the next test would otherwise pay."""
    started = time.monotonic()
    with grpc.insecure_channel(server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        while time.monotonic() - started < IDLE_S:
            try:
                stub.Pool(embed_request(["idle yet?"]), timeout=1.0)
                break
            except grpc.RpcError:
                time.sleep(0.5)
    return time.monotonic() - started


def settled_mb(rss: PeakRss) -> float:
    """Growth over the baseline once the attacker has gone: polled until it is under the
    limit, or SETTLE_S has passed (memory a server keeps after that, it keeps)."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        growth = (rss._total() - rss.baseline) / MB
        if growth < SETTLED_LIMIT_MB or time.monotonic() > deadline:
            return growth
        time.sleep(0.25)


@dataclass
class Verdict:
    """What one attack did to the server: checked together, so a failure names them all."""

    attack: str
    watch: Watch
    settled: float
    idle_s: float
    problems: list[str] = field(default_factory=list)
    bystander_limit_s: float = 1.0

    def check(self) -> None:
        if self.idle_s >= IDLE_S:
            self.problems.append(f"the server was still busy {IDLE_S:.0f}s after the attacker left")
        bystander = self.watch.bystander
        slowest = max(bystander.latencies, default=0.0)
        if bystander.failures:
            self.problems.append(f"bystander failures {dict(bystander.failures)}")
        if slowest >= self.bystander_limit_s:
            self.problems.append(
                f"a bystander call took {slowest:.2f}s (limit {self.bystander_limit_s:g} s)"
            )
        if self.watch.rss.extra_mb >= PEAK_LIMIT_MB:
            self.problems.append(
                f"peak growth {self.watch.rss.extra_mb:.0f} MB (limit {PEAK_LIMIT_MB} MB)"
            )
        if self.settled >= SETTLED_LIMIT_MB:
            self.problems.append(
                f"{self.settled:.0f} MB still held {SETTLE_S:.0f}s after the attacker left "
                f"(limit {SETTLED_LIMIT_MB} MB)"
            )
        assert not self.problems, f"{self.attack}: " + "; ".join(self.problems)


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

    with watching(server) as watch:
        started = time.monotonic()
        attackers = [threading.Thread(target=attack) for _ in range(BOMB_CONNECTIONS)]
        for thread in attackers:
            thread.start()
        for thread in attackers:
            thread.join(90)
        watch.answer_s = time.monotonic() - started
    idle_s = idle_after(server)
    settled = settled_mb(watch.rss)
    report(
        record_property,
        "attacks_grpc_door_gzip_bombs",
        door=door(server),
        wire_kb=len(body) / 1024,
        inflated_mb=2 * BOMB_WORDS / 1e6,
        sent=sum(sent),
        outcomes=dict(outcomes),
        settled_mb=settled,
        idle_s=idle_s,
        node_rss_mb=node_rss_mb(server),
        **watch.figures(),
    )
    verdict = Verdict("200 gzip bombs", watch, settled, idle_s)
    documented = {f"grpc-status {code.value[0]}" for code in CLIENT_ERROR_CODES}
    answered = sum(n for outcome, n in outcomes.items() if outcome.split(" (")[0] in documented)
    if answered != BOMB_CALLS:
        verdict.problems.append(
            f"{answered} of {BOMB_CALLS} calls refused as documented: {dict(outcomes)}"
        )
    verdict.check()
    assert_alive(server)


def test_a_client_that_never_reads_thirty_large_answers(
    servers: dict[str, ServerProcess], record_property
) -> None:
    """One connection whose receive window is 0 and stays so asks 30 token_embed answers
    of about 6 MB each, holds them a while, and leaves: the server may not keep them."""
    server = servers["unread"]
    request = grpc_frame(_token_embed(UNREAD_TEXTS).SerializeToString())
    with watching(server) as watch:
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
    idle_s = idle_after(server)
    settled = settled_mb(watch.rss)
    report(
        record_property,
        "attacks_grpc_door_unread_answers",
        door=door(server),
        calls=UNREAD_CALLS,
        answers_begun=begun,
        node_rss_held_mb=node_held,
        settled_mb=settled,
        idle_s=idle_s,
        **watch.figures(),
    )
    Verdict("30 unread token_embed answers", watch, settled, idle_s).check()
    assert_alive(server)


def test_half_open_streams_lock_no_one_out(
    servers: dict[str, ServerProcess], record_property
) -> None:
    """8 connections x 4,096 streams with HEADERS and no DATA, held 3 s: others are still
    served (open calls are capped per connection and per client, not only in all), and
    the streams' memory goes when their connections do."""
    server = servers["half_open"]
    with watching(server) as watch:
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
    idle_s = idle_after(server)
    settled = settled_mb(watch.rss)
    report(
        record_property,
        "attacks_grpc_door_half_open_streams",
        door=door(server),
        streams=HALF_OPEN_CONNECTIONS * HALF_OPEN_STREAMS,
        answered_kb=received_kb,
        node_rss_held_mb=node_held,
        settled_mb=settled,
        idle_s=idle_s,
        **watch.figures(),
    )
    Verdict("8 x 4,096 half-open streams", watch, settled, idle_s).check()
    assert_alive(server)


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
    with watching(server) as watch:
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
    idle_s = idle_after(server)
    settled = settled_mb(watch.rss)
    outcomes = Counter(
        r.code().name if isinstance(r, grpc.RpcError) else "OK"  # type: ignore[attr-defined]
        for r in results
    )
    sizes = [r.ByteSize() for r in results if isinstance(r, pb.TokenizeResponse)]
    report(
        record_property,
        f"attacks_grpc_door_tokenize_{at_once}",
        door=door(server),
        calls=at_once,
        outcomes=dict(outcomes),
        largest_answer_mb=max(sizes, default=0) / MB,
        settled_mb=settled,
        idle_s=idle_s,
        **watch.figures(),
    )
    verdict = Verdict(f"Tokenize of ~1M tokens, {at_once} at once", watch, settled, idle_s)
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
    assert_alive(server)
