"""Clients that hold connections or answers rather than make calls (issue 43, rows 6, 7, 9).

Two servers side by side, MiniLM and the wide one-layer BERT of test_attacks_grpc_door.py,
each with a 2 s --handshake-timeout-s: one on the Node door (with the HTTP door), one on
grpcio's. The attacker connects from 127.0.0.2, the newcomer and the bystander from
127.0.0.1 (every address in 127/8 is loopback):

- 3,000 idle sockets from one address on the gRPC port, with the HTTP/2 preface and
  without, and on the HTTP port: the address holds its share (a quarter of the cap), the
  rest are closed at once, the held ones once the handshake time has passed with no call,
  and a newcomer from another address is served throughout (before: UNAVAILABLE for all);
- 16 connections that never open their receive window, each asking an answer of 14 MB:
  what is held unsent is bounded in all, not only per connection (before: +1,043 MB);
- 40 requests sent a byte a second: ended DEADLINE_EXCEEDED once the handshake time has
  passed (on grpcio, before: never);
- on grpcio, 8 connections x 4,096 half-open streams: a connection's streams are capped
  at its share of the open calls, so the bystander is never refused (before: 8 CANCELLED).

Each test prints a `RELIABILITY <name>:` line and checks what issue 43 asks: newcomers
served, refusals within 1 s, peak growth under 300 MB and under 100 MB 10 s after the
attacker left (the server's processes but its engines, as test_attacks_grpc_door.py counts
them), the bystander under 1.5 s and never failing. The times are attack_kit's targets;
twice each fails the test (a busy host's noise is not the server's).
"""

from __future__ import annotations

import resource
import shutil
import socket
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import grpc
import h2.connection
import h2.settings
import pytest

from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.service.grpc import node_door
from tests.fixture_models import MINILM, wide_bert
from tests.reliability.attack_kit import (
    BYSTANDER,
    REFUSAL,
    Verdict,
    door,
    warm_up,
    watching_door,
    wide_token_embed,
)
from tests.reliability.support import embed_request
from tests.reliability.test_attacks import RawHttp2, grpc_frame
from tests.reliability.test_attacks_grpc_door import HalfOpen
from tests.reliability.test_attacks_http import _refused_within
from tests.server_process import ServerProcess, all_serving, free_port, spawn_server

pytestmark = pytest.mark.quiet  # times a bystander: `make test` runs it with nothing beside it

ATTACKER = "127.0.0.2"
NEWCOMER = "127.0.0.1"
HANDSHAKE_S = 2.0  # the servers' --handshake-timeout-s: also the no-call and arrival bound
SLACK_S = 2.5  # scheduling noise on a shared 2-core machine
# A socket over its address's share, once the flood is refused, is refused within
# attack_kit's REFUSAL; a newcomer is served within its BYSTANDER.
# The flood itself: 3,000 sockets accepted and all but the share closed (or answered 503),
# about 0.5 s on an idle 2-core machine; more where the machine is shared.
FLOOD_S = 8.0
IDLE_SOCKETS = 3000
CONNECTION_CAP = 1024  # --max-connections' default
ADDRESS_SHARE = CONNECTION_CAP // 4  # --max-connections-per-address's default
UNREAD_CONNECTIONS = 16
UNREAD_CALLS = 16
UNREAD_AT_ONCE = 2
UNREAD_PACE_S = 2.0  # a call not refused by then is taken as held (it computes in ~0.5 s)
UNREAD_TEXTS = 72  # each answer: 72 x 128 tokens x 384 floats and their tokens, ~14 MB
UNSENT_TOTAL = 64 << 20  # --max-unsent-answer-mb's default
SLOW_CALLS = 40
HALF_OPEN_CONNECTIONS = 8
HALF_OPEN_STREAMS = 4096


def _node_door_installed() -> bool:
    return shutil.which("node") is not None and node_door.installed()


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, ServerProcess]]:
    """`node`: the Node door and the HTTP door (its port as `http_port`); `grpcio`: grpcio's
    door. This process opens 3,000 sockets: its soft open-file limit is raised."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard < IDLE_SOCKETS + 500:
        pytest.skip(f"the tests open {IDLE_SOCKETS} sockets; the open-file limit is {hard}")
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    root = tmp_path_factory.mktemp("attacks-connections")
    wide = wide_bert(root / "wide")
    args = ["--model", f"minilm={MINILM}", "--model", f"wide={wide}", "--dtype", "float32"]
    args += ["--handshake-timeout-s", str(HANDSHAKE_S)]
    doors = {"grpcio": ["--grpc-door", "grpcio"]}
    http_port = free_port()
    if _node_door_installed():
        doors["node"] = ["--grpc-door", "node", "--http-port", str(http_port)]
    started = {name: spawn_server([*args, *flags], root, name) for name, flags in doors.items()}
    with all_serving(started.values(), stop_timeout=20):
        for server in started.values():
            warm_up(server, token_embed_texts=4)
        if "node" in started:
            started["node"].http_port = http_port  # type: ignore[attr-defined]
        yield started


def _server(servers: dict[str, ServerProcess], name: str) -> ServerProcess:
    if name not in servers:
        pytest.skip("the Node.js door is not installed (make node-door)")
    server = servers[name]
    assert door(server) == name
    return server


@pytest.fixture(params=["node", "grpcio"])
def either(servers: dict[str, ServerProcess], request: pytest.FixtureRequest) -> ServerProcess:
    """Each door's server in turn, for the attacks both must hold."""
    return _server(servers, request.param)


def _connect(port: int, source: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))


def _refusal_s(port: int, probes: int = 10) -> float:
    """The slowest of `probes` more sockets from the attacker's address, over its share
    now: seconds from connecting to the server's close (or its 503 and close)."""
    slowest = 0.0
    for _ in range(probes):
        started = time.monotonic()
        with _connect(port, ATTACKER) as sock:
            sock.settimeout(5)
            try:
                while sock.recv(4096):
                    pass
            except OSError:
                pass
        slowest = max(slowest, time.monotonic() - started)
    return slowest


def _newcomer(server: ServerProcess) -> tuple[float, str]:
    """A new client from another address, on a connection of its own: its first call's
    seconds (from connecting) and outcome."""
    started = time.monotonic()
    with grpc.insecure_channel(
        server.address, options=[("grpc.use_local_subchannel_pool", 1)]
    ) as channel:
        try:
            pooling_pb2_grpc.PoolingServiceStub(channel).Pool(
                embed_request(["a newcomer"]), timeout=5
            )
            outcome = "OK"
        except grpc.RpcError as error:
            outcome = error.code().name  # type: ignore[attr-defined]
    return time.monotonic() - started, outcome


# --------------------------------------------------------------------------- row 6


@pytest.mark.parametrize("preface", [True, False], ids=["preface", "bare"])
def test_idle_sockets_from_one_address_lock_no_one_out(
    servers: dict[str, ServerProcess], preface: bool, record_property
) -> None:
    """3,000 sockets from 127.0.0.2 that send the HTTP/2 preface (or nothing) and no call:
    that address holds its share of the connections, the rest are closed at once, the
    held ones once the handshake time has passed; a newcomer from 127.0.0.1 is served, and
    one more socket from 127.0.0.2 is closed at once."""
    server = _server(servers, "node")
    hello = b""
    if preface:
        client = h2.connection.H2Connection()
        client.initiate_connection()
        hello = client.data_to_send()

    def attack(_: int) -> socket.socket:
        sock = _connect(server.port, ATTACKER)
        if hello:
            sock.sendall(hello)
        return sock

    with watching_door(server) as watch:
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            socks = list(pool.map(attack, range(IDLE_SOCKETS)))
        opened_s = time.monotonic() - started
        held = _refused_within(socks, FLOOD_S, want=IDLE_SOCKETS - ADDRESS_SHARE)
        flood_s = time.monotonic() - started
        refusal_s = _refusal_s(server.port)
        newcomer_s, newcomer = _newcomer(server)
        still_open = _refused_within(held, HANDSHAKE_S + SLACK_S)
        watch.answer_s = time.monotonic() - started
    for sock in socks:
        sock.close()
    verdict = Verdict.after("3,000 idle sockets", server, watch, record_property)
    verdict.report(
        f"attacks_connections_idle_sockets_{'preface' if preface else 'bare'}",
        sockets=IDLE_SOCKETS,
        opened_s=opened_s,
        held=len(held),
        flood_refused_s=flood_s,
        refusal_s=refusal_s,
        open_after_handshake_time=len(still_open),
        newcomer=newcomer,
        newcomer_s=newcomer_s,
    )
    if len(held) > ADDRESS_SHARE:
        verdict.problems.append(f"{len(held)} held, over the address's share {ADDRESS_SHARE}")
    verdict.within(REFUSAL, refusal_s, "closing a socket over the share")
    if newcomer != "OK":
        verdict.problems.append(f"the newcomer got {newcomer}")
    verdict.within(BYSTANDER, newcomer_s, "the newcomer's call")
    if still_open:
        verdict.problems.append(
            f"{len(still_open)} held sockets still open after the handshake time"
        )
    verdict.check()


def test_idle_http_sockets_from_one_address_lock_no_one_out(
    servers: dict[str, ServerProcess], record_property
) -> None:
    """The same 3,000 sockets on the HTTP port: the address's share is held, the rest are
    answered 503 at once; a newcomer's request from 127.0.0.1 is answered."""
    server = _server(servers, "node")
    port = server.http_port  # type: ignore[attr-defined]
    with watching_door(server) as watch:
        started = time.monotonic()
        with ThreadPoolExecutor(8) as pool:
            socks = list(pool.map(lambda _: _connect(port, ATTACKER), range(IDLE_SOCKETS)))
        opened_s = time.monotonic() - started
        held = _refused_within(
            socks,
            FLOOD_S,
            want=IDLE_SOCKETS - ADDRESS_SHARE,
            refusal=lambda data: not data or data.startswith(b"HTTP/1.1 503"),
        )
        flood_s = time.monotonic() - started
        refusal_s = _refusal_s(port)
        asked = time.monotonic()
        with _connect(port, NEWCOMER) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
        newcomer_s = time.monotonic() - asked
        watch.answer_s = time.monotonic() - started
    for sock in socks:
        sock.close()
    verdict = Verdict.after("3,000 idle HTTP sockets", server, watch, record_property, idle=False)
    verdict.report(
        "attacks_connections_idle_http_sockets",
        sockets=IDLE_SOCKETS,
        opened_s=opened_s,
        held=len(held),
        flood_refused_s=flood_s,
        refusal_s=refusal_s,
        newcomer_status=answer[:12].decode(errors="replace"),
        newcomer_s=newcomer_s,
    )
    if len(held) > ADDRESS_SHARE:
        verdict.problems.append(f"{len(held)} held, over the address's share {ADDRESS_SHARE}")
    verdict.within(REFUSAL, refusal_s, "answering a socket over the share")
    if not answer.startswith(b"HTTP/1.1 200"):
        verdict.problems.append(f"the newcomer got {answer[:40]!r}")
    verdict.within(BYSTANDER, newcomer_s, "the newcomer's request")
    verdict.check()


# --------------------------------------------------------------------------- row 7


def test_unread_answers_are_bounded_in_all(either: ServerProcess, record_property) -> None:
    """16 connections whose receive window is 0 and stays so ask an answer of 14 MB each
    (within the per-connection bound, 224 MB in all): the server holds what fits its total
    of unsent answers and refuses the rest RESOURCE_EXHAUSTED, instead of holding them
    all. Asked two at a time, so that what is measured is the answers held, not 16 results
    computed side by side."""
    server, name = either, door(either)
    request = grpc_frame(wide_token_embed(UNREAD_TEXTS).SerializeToString())
    calls: list[tuple[RawHttp2, int, float]] = []

    def pending() -> int:
        now = time.monotonic()
        return sum(
            not raw.calls[stream].done and now - began < UNREAD_PACE_S
            for raw, stream, began in calls
        )

    def pump_all() -> None:
        for raw in attackers:
            raw.pump(0.01)  # no DATA can come: nothing is acknowledged
        time.sleep(0.01)

    attackers: list[RawHttp2] = []
    with watching_door(server) as watch:
        started = time.monotonic()
        try:
            for index in range(UNREAD_CALLS):
                while pending() >= UNREAD_AT_ONCE:
                    pump_all()
                if len(attackers) < UNREAD_CONNECTIONS:  # each connected as it first asks
                    raw = RawHttp2(server.port, timeout=10, source=ATTACKER)
                    raw.conn.update_settings({h2.settings.SettingCodes.INITIAL_WINDOW_SIZE: 0})
                    attackers.append(raw)
                raw = attackers[index % UNREAD_CONNECTIONS]
                calls.append((raw, raw.start("Pool", request), time.monotonic()))
            while pending():
                pump_all()
            pump_all()
            outcomes = Counter(raw.calls[stream].outcome() for raw, stream, _ in calls)
            newcomer_s, newcomer = _newcomer(server)
        finally:
            for raw in attackers:
                raw.close()
        watch.answer_s = time.monotonic() - started
    verdict = Verdict.after(f"unread answers ({name})", server, watch, record_property)
    refused = outcomes.get(f"grpc-status {grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]}", 0)
    verdict.report(
        f"attacks_connections_unread_answers_{name}",
        connections=UNREAD_CONNECTIONS,
        calls=UNREAD_CALLS,
        outcomes=dict(outcomes),
        newcomer=newcomer,
        newcomer_s=newcomer_s,
    )
    # At most the total's worth of 14 MB answers, and one more, are held; the rest refused.
    most_held = UNSENT_TOTAL // (14 << 20) + 1
    if refused < UNREAD_CALLS - most_held:
        verdict.problems.append(f"only {refused} refused: {dict(outcomes)}")
    if newcomer != "OK":
        verdict.problems.append(f"the newcomer got {newcomer}")
    verdict.within(BYSTANDER, newcomer_s, "the newcomer's call")
    verdict.check()


# --------------------------------------------------------------------------- row 9


def test_requests_sent_a_byte_a_second_are_ended(either: ServerProcess, record_property) -> None:
    """40 Pool calls on 4 connections, each message sent a byte a second: each is ended
    DEADLINE_EXCEEDED once the handshake time has passed, not read for ever."""
    server, name = either, door(either)
    body = grpc_frame(embed_request(["a slow request"]).SerializeToString())
    attackers = [RawHttp2(server.port, timeout=10, source=ATTACKER) for _ in range(4)]
    ended: dict[tuple[int, int], float] = {}
    with watching_door(server) as watch:
        started = time.monotonic()
        try:
            streams = [(raw, raw.open("Pool")) for raw in attackers for _ in range(SLOW_CALLS // 4)]
            sent = 0
            while (
                len(ended) < SLOW_CALLS and time.monotonic() < started + HANDSHAKE_S + 2 * SLACK_S
            ):
                for raw, stream_id in streams:
                    if not raw.calls[stream_id].done and sent < len(body) - 1:
                        raw.conn.send_data(stream_id, body[sent : sent + 1])
                sent += 1
                tick = time.monotonic() + 1.0
                for raw in attackers:
                    raw.flush()
                while time.monotonic() < tick:
                    for raw in attackers:
                        raw.pump(0.05)
                    for index, (raw, stream_id) in enumerate(streams):
                        if raw.calls[stream_id].done and (index, stream_id) not in ended:
                            ended[index, stream_id] = time.monotonic() - started
            outcomes = Counter(raw.calls[s].outcome() for raw, s in streams)
        finally:
            for raw in attackers:
                raw.close()
        watch.answer_s = max(ended.values(), default=float("inf"))
    verdict = Verdict(f"40 requests a byte a second ({name})", server, watch, record_property)
    verdict.report(
        f"attacks_connections_byte_a_second_{name}",
        calls=SLOW_CALLS,
        bytes_sent=sent,
        outcomes=dict(outcomes),
    )
    deadline_exceeded = f"grpc-status {grpc.StatusCode.DEADLINE_EXCEEDED.value[0]}"
    if outcomes.get(deadline_exceeded, 0) != SLOW_CALLS:
        verdict.problems.append(f"outcomes {dict(outcomes)}")
    elif watch.answer_s > HANDSHAKE_S + SLACK_S:
        verdict.problems.append(f"the last was ended after {watch.answer_s:.1f}s")
    verdict.check()


def test_half_open_streams_on_grpcio_lock_no_one_out(
    servers: dict[str, ServerProcess], record_property
) -> None:
    """8 connections x 4,096 HEADERS with no DATA on grpcio's door: each connection may open
    its share of the open calls (1,024), and those are ended when their requests do not
    come, so the bystander is served throughout and the memory goes with them."""
    server = _server(servers, "grpcio")
    with watching_door(server) as watch:
        started = time.monotonic()
        attackers = [HalfOpen(server.port, HALF_OPEN_STREAMS) for _ in range(HALF_OPEN_CONNECTIONS)]
        try:
            time.sleep(HANDSHAKE_S + SLACK_S)
            newcomer_s, newcomer = _newcomer(server)
            answered_kb = sum(a.received for a in attackers) / 1024
        finally:
            for attacker in attackers:
                attacker.close()
        watch.answer_s = time.monotonic() - started
    verdict = Verdict.after("8 x 4,096 half-open streams (grpcio)", server, watch, record_property)
    verdict.report(
        "attacks_connections_half_open_grpcio",
        streams=HALF_OPEN_CONNECTIONS * HALF_OPEN_STREAMS,
        answered_kb=answered_kb,
        newcomer=newcomer,
        newcomer_s=newcomer_s,
    )
    if newcomer != "OK":
        verdict.problems.append(f"the newcomer got {newcomer}")
    verdict.check()
