"""The gRPC door on Node.js (--grpc-door node, what `auto` picks where Node.js is on PATH):
a real server on a real port, its answers compared with the grpcio door's call by call."""

from __future__ import annotations

import collections
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import h2.errors
import psutil
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.conftest import DEFAULT_MODEL, Served
from tests.reliability.test_attacks import RawHttp2, grpc_frame
from tests.rpc_errors import decode_rpc_error, decode_status
from tests.server_process import (
    ServerProcess,
    all_serving,
    free_port,
    spawn_server,
    start_server,
)

pytestmark = pytest.mark.skipif(shutil.which("node") is None, reason="needs Node.js")

SERVICE = pb.DESCRIPTOR.services_by_name["PoolingService"]
KEY = "door-key"
AUTH = (("authorization", f"Bearer {KEY}"),)
MODELS = ("tiny-classifier", "tiny-cross-encoder")
DOORS = ("grpcio", "node")
OPEN_CAP = 200  # --max-open-calls


@pytest.fixture(scope="module")
def both_doors(
    served: dict[str, Served], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, ServerProcess]]:
    """The same server behind each door, started side by side."""
    args = ["--api-key", KEY, "--max-message-mb", "1", "--max-open-calls", str(OPEN_CAP)]
    args += ["--max-client-batch-size", "64", "--dtype", "float32"]
    args += ["--model", DEFAULT_MODEL]
    for name in MODELS:
        args += ["--model", f"{name}={served[name].folder}"]
    logs = tmp_path_factory.mktemp("doors")
    servers = {door: spawn_server(["--grpc-door", door, *args], logs, door) for door in DOORS}
    with all_serving(servers.values()):
        yield servers


@pytest.fixture(scope="module")
def node_server(both_doors: dict[str, ServerProcess]) -> ServerProcess:
    return both_doors["node"]


@pytest.fixture(scope="module")
def node_stub(node_server: ServerProcess) -> Iterator[pooling_pb2_grpc.PoolingServiceStub]:
    with grpc.insecure_channel(node_server.address) as channel:
        yield pooling_pb2_grpc.PoolingServiceStub(channel)


@pytest.fixture(scope="module")
def stub(both_doors: dict[str, ServerProcess]) -> Iterator[pooling_pb2_grpc.PoolingServiceStub]:
    """The grpcio door's (this module's own, not the suite's shared server's)."""
    with grpc.insecure_channel(both_doors["grpcio"].address) as channel:
        yield pooling_pb2_grpc.PoolingServiceStub(channel)


def _strip(response: pb.PoolResponse) -> pb.PoolResponse:
    """The parts that differ between two servers' answers to one request (ids, timings)."""
    response.request_id = ""
    return response


REQUESTS = [
    pb.PoolRequest(embed=pb.TextInput(texts=["a door in front", "of the same handlers"])),
    pb.PoolRequest(
        model="tiny-classifier", classify=pb.TextInput(texts=["positive", "negative words"])
    ),
    pb.PoolRequest(
        model="tiny-cross-encoder",
        score=pb.ScoreInput(text_1=["query"], text_2=["a document", "another"]),
    ),
]


@pytest.mark.parametrize("index", range(len(REQUESTS)), ids=["embed", "classify", "score"])
def test_pool_answers_as_grpcio_does(
    stub: pooling_pb2_grpc.PoolingServiceStub,
    node_stub: pooling_pb2_grpc.PoolingServiceStub,
    index: int,
) -> None:
    request = REQUESTS[index]
    expected, on_grpcio = stub.Pool.with_call(request, timeout=30, metadata=AUTH)
    got, on_node = node_stub.Pool.with_call(request, timeout=30, metadata=AUTH)
    assert _strip(got) == _strip(expected)
    timings = {key for key, _ in on_node.trailing_metadata() if key.startswith("x-")}
    assert timings == {key for key, _ in on_grpcio.trailing_metadata() if key.startswith("x-")}
    assert "x-total-time-ms" in timings


def test_rerank_tokenize_and_list_models_as_grpcio(
    stub: pooling_pb2_grpc.PoolingServiceStub,
    node_stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    rerank = pb.RerankRequest(
        model="tiny-cross-encoder", query="q", documents=["one", "two", "three"], top_n=2
    )
    expected = stub.Rerank(rerank, timeout=30, metadata=AUTH)
    got = node_stub.Rerank(rerank, timeout=30, metadata=AUTH)
    assert [(r.index, r.relevance_score) for r in got.results] == [
        (r.index, r.relevance_score) for r in expected.results
    ]
    tokenize = pb.TokenizeRequest(texts=["naïve café 🙂", "two"])
    expected_tokens = stub.Tokenize(tokenize, timeout=30, metadata=AUTH)
    assert node_stub.Tokenize(tokenize, timeout=30, metadata=AUTH) == expected_tokens
    cards = node_stub.ListModels(pb.ListModelsRequest(), timeout=30, metadata=AUTH).models
    assert [card.name for card in cards] == [DEFAULT_MODEL, *MODELS]


def test_a_stream_answers_each_message_and_errors_in_band(
    node_stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    requests = [
        pb.PoolStreamRequest(request=pb.PoolRequest(request_id=f"r{i}", embed={"texts": [t]}))
        for i, t in enumerate(["one", "two", "three"])
    ]
    requests.append(pb.PoolStreamRequest(request=pb.PoolRequest(request_id="bad", embed={})))
    answers = list(node_stub.PoolStream(iter(requests * 1), timeout=30, metadata=AUTH))
    by_id = {a.request_id: a for a in answers}
    assert sorted(by_id) == ["bad", "r0", "r1", "r2"]
    assert all(len(by_id[f"r{i}"].response.embed.embeddings) == 1 for i in range(3))
    error = decode_status(by_id["bad"].error)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT and error.fields


def test_a_long_stream_is_pulled_in_turn(node_stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    """More messages than the stream's in-flight limit: the reader holds back, none lost."""
    requests = (
        pb.PoolStreamRequest(request=pb.PoolRequest(request_id=str(i), embed={"texts": ["x"]}))
        for i in range(600)
    )
    answers = list(node_stub.PoolStream(requests, timeout=120, metadata=AUTH))
    assert sorted(int(a.request_id) for a in answers) == list(range(600))


def test_errors_carry_the_same_rich_status(
    stub: pooling_pb2_grpc.PoolingServiceStub,
    node_stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    bad = pb.PoolRequest(embed=pb.TextInput(texts=["x"]), params=pb.PoolingParams(dimensions=7))
    with pytest.raises(grpc.RpcError) as on_grpcio:
        stub.Pool(bad, timeout=30, metadata=AUTH)
    with pytest.raises(grpc.RpcError) as on_node:
        node_stub.Pool(bad, timeout=30, metadata=AUTH)
    expected, got = decode_rpc_error(on_grpcio.value), decode_rpc_error(on_node.value)
    assert (got.code, got.reason, got.fields, got.message) == (
        expected.code,
        expected.reason,
        expected.fields,
        expected.message,
    )


def test_api_keys_guard_the_service_not_health(node_server: ServerProcess) -> None:
    with grpc.insecure_channel(node_server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        for metadata in ((), (("authorization", "Bearer wrong"),)):
            with pytest.raises(grpc.RpcError) as caught:
                stub.ListModels(pb.ListModelsRequest(), timeout=10, metadata=metadata)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        check = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert check.status == health_pb2.HealthCheckResponse.SERVING
        with pytest.raises(grpc.RpcError) as unknown:
            health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="no.such.Service"), timeout=10
            )
        assert unknown.value.code() == grpc.StatusCode.NOT_FOUND


def test_reflection_and_watch(node_server: ServerProcess) -> None:
    with grpc.insecure_channel(node_server.address) as channel:
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(reflect.ServerReflectionInfo(iter([request]), timeout=10))
        names = {service.name for service in response.list_services_response.service}
        assert {SERVICE.full_name, "grpc.health.v1.Health"} <= names
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(service=SERVICE.full_name), timeout=10
        )
        assert next(watch).status == health_pb2.HealthCheckResponse.SERVING
        watch.cancel()


def _identity(data: bytes) -> bytes:
    return data


def test_the_wire_rules(node_server: ServerProcess) -> None:
    """One message per unary call, the message size bound, unknown methods, compression."""
    pool = f"/{SERVICE.full_name}/Pool"
    message = pb.PoolRequest(embed=pb.TextInput(texts=["x"])).SerializeToString()
    with grpc.insecure_channel(node_server.address) as channel:
        for messages in ([], [message, message]):
            call = channel.stream_stream(pool, _identity, _identity)
            with pytest.raises(grpc.RpcError) as caught:
                list(call(iter(messages), timeout=10, metadata=AUTH))
            error = decode_rpc_error(caught.value)
            assert (error.code, error.reason) == (
                grpc.StatusCode.INVALID_ARGUMENT,
                "ONE_MESSAGE_EXPECTED",
            )
        huge = pb.PoolRequest(embed=pb.TextInput(texts=["y" * (2 << 20)])).SerializeToString()
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary(pool, _identity, _identity)(huge, timeout=10, metadata=AUTH)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        with pytest.raises(grpc.RpcError) as caught:
            channel.unary_unary("/no.Such/Method", _identity, _identity)(b"", timeout=10)
        assert caught.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # A gzip-compressed request is inflated (and still bounded once inflated).
    with grpc.insecure_channel(node_server.address, compression=grpc.Compression.Gzip) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        answer = stub.Pool(pb.PoolRequest(embed={"texts": ["z" * 5000]}), metadata=AUTH)
        assert len(answer.embed.embeddings) == 1
        with pytest.raises(grpc.RpcError) as caught:
            stub.Pool(pb.PoolRequest(embed={"texts": ["z" * (2 << 20)]}), metadata=AUTH)
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_a_deadline_ends_the_call_on_the_server(node_server: ServerProcess) -> None:
    """Node answers DEADLINE_EXCEEDED itself when the grpc-timeout passes, and Python's
    handler is cancelled: the call is counted CANCELLED, never answered twice."""
    texts = [f"sentence number {i} " * 20 for i in range(64)]
    with grpc.insecure_channel(node_server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        for _ in range(3):
            with pytest.raises(grpc.RpcError) as caught:
                stub.Pool(pb.PoolRequest(embed={"texts": texts}), timeout=0.005, metadata=AUTH)
            assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        answer = stub.Pool(pb.PoolRequest(embed={"texts": ["after"]}), timeout=30, metadata=AUTH)
        assert len(answer.embed.embeddings) == 1


def test_drain_finishes_every_call_in_flight(served: dict[str, Served], tmp_path: Path) -> None:
    """SIGTERM during a burst over two front ends (sharing the port): every accepted call is
    answered, and the server exits 0."""
    server = start_server(
        ["--grpc-door", "node", "--frontends", "2", "--model", DEFAULT_MODEL], tmp_path
    )
    texts = [f"text {i} " * 30 for i in range(16)]
    channels = [grpc.insecure_channel(server.address) for _ in range(4)]
    try:
        stubs = [pooling_pb2_grpc.PoolingServiceStub(c) for c in channels]
        for stub in stubs:  # connected before the burst
            stub.Pool(pb.PoolRequest(embed={"texts": ["warm"]}), timeout=60)
        futures = [
            stubs[i % 4].Pool.future(pb.PoolRequest(embed={"texts": texts}), timeout=60)
            for i in range(32)
        ]
        time.sleep(0.3)
        server.process.send_signal(signal.SIGTERM)
        answers = [future.result() for future in futures]
        assert all(len(answer.embed.embeddings) == 16 for answer in answers)
        assert server.process.wait(60) == 0
    finally:
        for channel in channels:
            channel.close()
        server.stop(signal.SIGKILL)


def test_calls_reset_as_they_arrive_do_not_hold_the_drain(
    served: dict[str, Served], tmp_path: Path
) -> None:
    """Calls whose reset reaches the server with the calls themselves (so Python hears of
    each call and its end in one read, before the call's task first runs): the drain that
    follows ends at once, with exit 0, instead of waiting out the grace for calls that never
    ran."""
    server = start_server(
        ["--grpc-door", "node", "--shutdown-grace-s", "20", "--model", DEFAULT_MODEL], tmp_path
    )
    body = grpc_frame(pb.PoolRequest(embed={"texts": ["reset me"]}).SerializeToString())
    try:
        for _ in range(3):
            raw = RawHttp2(server.port)
            try:
                for _ in range(32):
                    stream_id = raw.start("Pool", body, flush=False)
                    raw.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
                raw.flush()  # every call and its reset in one write
                time.sleep(0.3)
            finally:
                raw.close()
        with grpc.insecure_channel(server.address) as channel:
            answer = pooling_pb2_grpc.PoolingServiceStub(channel).Pool(
                pb.PoolRequest(embed={"texts": ["alive"]}), timeout=30
            )
        assert len(answer.embed.embeddings) == 1
        started = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
        assert time.monotonic() - started < 10
        assert "ran out" not in server.log()
    finally:
        server.stop(signal.SIGKILL)


def test_node_dying_stops_the_server_with_an_error(tmp_path: Path) -> None:
    server = start_server(["--grpc-door", "node", "--model", DEFAULT_MODEL], tmp_path)
    try:
        [node] = [
            p
            for p in psutil.Process(server.process.pid).children(recursive=True)
            if p.name() == "node"
        ]
        node.kill()
        assert server.process.wait(60) == 1
        assert "the Node.js gRPC door exited" in server.log()
    finally:
        server.stop(signal.SIGKILL)


def _fake_node(folder: Path, version: str) -> str:
    """A PATH whose `node` says `version` (and serves nothing), beside this Python."""
    folder.mkdir()
    script = folder / "node"
    script.write_text(f"#!/bin/sh\necho {version}\n")
    script.chmod(0o755)
    return f"{folder}:{Path(sys.executable).parent}"


@pytest.mark.parametrize(
    ("version", "found"), [(None, "no `node` on PATH"), ("v18.19.0", "Node.js 18 on PATH")]
)
def test_without_node_20_the_start_fails_clearly(
    tmp_path: Path, version: str | None, found: str
) -> None:
    """Refused before any model loads, saying which Node was found."""
    here = str(Path(sys.executable).parent)
    path = here if version is None else _fake_node(tmp_path / "bin", version)
    started = subprocess.run(
        [
            sys.executable,
            "-m",
            "pooling_server.service.launch",
            "--port",
            str(free_port()),
            "--grpc-door",
            "node",
        ],
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode != 0
    assert f"--grpc-door node needs Node.js 20 or newer as `node` on PATH ({found})" in (
        started.stderr
    )


def _tree_names(server: ServerProcess) -> list[str]:
    return [p.name() for p in psutil.Process(server.process.pid).children(recursive=True)]


def test_auto_picks_node_where_it_is_on_path_and_grpcio_where_not(tmp_path: Path) -> None:
    """The default door, resolved once by the supervisor and logged: Node.js 20+ on PATH
    gives the Node door; an older one (or none) gives grpcio, and the server serves."""
    auto = {"POOLING_GRPC_DOOR": "auto"}  # whatever door the suite was told to run
    old_node = {**auto, "PATH": _fake_node(tmp_path / "bin", "v18.19.0")}
    servers = [
        spawn_server(["--model", DEFAULT_MODEL], tmp_path, "auto-node", extra_env=auto),
        spawn_server(["--model", DEFAULT_MODEL], tmp_path, "auto-old", extra_env=old_node),
    ]
    with all_serving(servers):
        for server in servers:
            with grpc.insecure_channel(server.address) as channel:
                answer = pooling_pb2_grpc.PoolingServiceStub(channel).Pool(
                    pb.PoolRequest(embed={"texts": ["which door"]}), timeout=30
                )
            assert len(answer.embed.embeddings) == 1
        on_node, on_grpcio = servers
        assert "gRPC door: node (Node.js" in on_node.log()
        assert "node" in _tree_names(on_node)
        assert "gRPC door: grpcio (auto: Node.js 18 on PATH" in on_grpcio.log()
        assert "node" not in _tree_names(on_grpcio)
        assert on_grpcio.log().count("gRPC door:") == 1  # the front end is told, not asking


@pytest.mark.parametrize("door", DOORS)
def test_grpc_timeouts_long_and_malformed(both_doors: dict[str, ServerProcess], door: str) -> None:
    """A deadline past Node's timer range (24.8 days) is served, not ended at once; a
    grpc-timeout that does not parse is the client's INVALID_ARGUMENT on Node's door (gRPC
    core, and so grpcio's door, answers INTERNAL)."""
    server = both_doors[door]
    with grpc.insecure_channel(server.address) as channel:
        answer = pooling_pb2_grpc.PoolingServiceStub(channel).Pool(
            pb.PoolRequest(embed={"texts": ["a month"]}), timeout=30 * 86400, metadata=AUTH
        )
    assert len(answer.embed.embeddings) == 1
    body = grpc_frame(pb.PoolRequest(embed={"texts": ["raw"]}).SerializeToString())
    raw = RawHttp2(server.port)
    try:
        cases = {value: (*AUTH, ("grpc-timeout", value)) for value in ("99999999H", "abc")}
        streams = {value: raw.start("Pool", body, metadata) for value, metadata in cases.items()}
        raw.wait(list(streams.values()), 30)
        outcomes = {value: raw.calls[stream].outcome() for value, stream in streams.items()}
    finally:
        raw.close()
    malformed = {"node": "grpc-status 3", "grpcio": "grpc-status 13"}[door]
    assert outcomes == {"99999999H": "grpc-status 0", "abc": malformed}


def test_requests_that_do_not_parse_leave_no_tracebacks(
    both_doors: dict[str, ServerProcess],
) -> None:
    """Garbage sent to health (whose parsing is the door's, not PoolingService's): refused
    on each door, INVALID_ARGUMENT on Node's and grpcio's own UNKNOWN, and never a traceback
    per call in the log (grpcio's are folded into one line a minute)."""
    expected = {"node": "grpc-status 3", "grpcio": "grpc-status 2"}
    for door, server in both_doors.items():
        raw = RawHttp2(server.port)
        try:
            streams = [
                raw.start("/grpc.health.v1.Health/Check", grpc_frame(b"\xff\xff\xff"))
                for _ in range(20)
            ]
            raw.wait(streams, 30)
            assert {raw.calls[s].outcome() for s in streams} == {expected[door]}
        finally:
            raw.close()
        assert "Traceback" not in server.log(), door
    assert "request message(s) that do not parse received" in both_doors["grpcio"].log()


@pytest.mark.parametrize("door", DOORS)
def test_calls_past_the_open_cap_are_refused_at_once(
    both_doors: dict[str, ServerProcess], door: str
) -> None:
    """Streams opened and never ended hold --max-open-calls: past it every new call, from
    any client, is RESOURCE_EXHAUSTED at once, and the slots free once those streams go.
    (At a cap this small, one connection's share and one client's share are the whole cap;
    the Node door also tells each connection it may open no more streams than that.)"""
    server = both_doors[door]
    raw, second = RawHttp2(server.port), RawHttp2(server.port)
    try:
        held = [raw.open("Pool", AUTH) for _ in range(OPEN_CAP)]
        raw.flush()
        past = [second.open("Pool", AUTH) for _ in range(10)]
        second.flush()
        second.wait(past, 5)
        raw.wait(held, 1)  # held: unanswered (until --handshake-timeout-s, 10 s, on Node's)
        outcomes = collections.Counter(raw.calls[stream].outcome() for stream in held)
        outcomes.update(second.calls[stream].outcome() for stream in past)
        another = pb.PoolRequest(embed={"texts": ["another client"]})
        with (
            grpc.insecure_channel(server.address) as channel,
            pytest.raises(grpc.RpcError) as refused,
        ):
            pooling_pb2_grpc.PoolingServiceStub(channel).Pool(another, timeout=10, metadata=AUTH)
    finally:
        raw.close()
        second.close()
    assert outcomes == {"unanswered": OPEN_CAP, "grpc-status 8": 10}
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    deadline = time.monotonic() + 10
    with grpc.insecure_channel(server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        while True:  # the held streams close as the server reads the connection's end
            try:
                answer = stub.Pool(pb.PoolRequest(embed={"texts": ["after"]}), metadata=AUTH)
                break
            except grpc.RpcError as error:
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert time.monotonic() < deadline, "the slots were never freed"
                time.sleep(0.1)
    assert len(answer.embed.embeddings) == 1


def _node_rss(server: ServerProcess) -> int:
    [node] = [
        p for p in psutil.Process(server.process.pid).children(recursive=True) if p.name() == "node"
    ]
    return node.memory_info().rss


def test_a_message_sent_a_byte_a_frame_is_read_as_its_bytes(
    both_doors: dict[str, ServerProcess],
) -> None:
    """Each DATA frame reaches Node as a Buffer of its own (~160 bytes of heap): a message
    sent a byte a frame is answered as it is sent whole, and Node holds about its size for
    it, not 160 times that (300 KB so grew Node by about 50 MB)."""
    server = both_doors["node"]
    request = pb.TokenizeRequest(texts=[f"word{i} " * 600 for i in range(64)])
    body = grpc_frame(request.SerializeToString())
    before = _node_rss(server)
    raw = RawHttp2(server.port, timeout=30)
    try:
        whole = raw.start("Tokenize", body, AUTH)
        trickled = raw.open("Tokenize", AUTH)
        raw.send(trickled, body, end_stream=True, frame_bytes=1)
        raw.flush()
        raw.wait([whole, trickled], 60)
        answers = [
            {k: v for k, v in raw.calls[stream].headers.items() if k != "date"}
            for stream in (whole, trickled)
        ]
    finally:
        raw.close()
    # Tokens past this server's answer cap (--max-message-mb 1): refused once the request
    # is parsed and tokenized, in the same words either way.
    assert answers[0].get("grpc-status") == "3"
    assert answers[1] == answers[0]
    assert "--max-message-mb" in answers[0]["grpc-message"]
    assert _node_rss(server) - before < 20 << 20


def test_half_open_streams_are_capped_per_connection_and_client_and_timed_out(
    tmp_path: Path,
) -> None:
    """--max-open-calls 1024: a connection may hold 256 calls (and is told so in SETTINGS),
    a client address 512; calls whose request never comes end after --handshake-timeout-s
    (DEADLINE_EXCEEDED),
    and other connections are served meanwhile up to the client's share."""
    server = start_server(
        ["--grpc-door", "node", "--max-open-calls", "1024", "--handshake-timeout-s", "4"],
        tmp_path,
    )
    raws = [RawHttp2(server.port) for _ in range(3)]
    try:
        assert raws[0].conn.remote_settings.max_concurrent_streams == 256
        held = [[raw.open("Pool") for _ in range(256)] for raw in raws[:2]]
        for raw in raws[:2]:
            raw.flush()
        time.sleep(1.0)  # half-open streams get no answer: give the server time to see them
        past = [raws[2].open("Pool") for _ in range(5)]
        raws[2].flush()
        raws[2].wait(past, 5)
        assert {raws[2].calls[s].outcome() for s in past} == {"grpc-status 8"}
        assert "from%20this%20client" in raws[2].calls[past[0]].headers["grpc-message"]
        for raw, streams in zip(raws, held, strict=False):
            raw.wait(streams, 10)
            outcomes = collections.Counter(raw.calls[s].outcome() for s in streams)
            assert outcomes == {"grpc-status 4": 256}, outcomes  # the request never came
        with grpc.insecure_channel(server.address) as channel:
            answer = pooling_pb2_grpc.PoolingServiceStub(channel).Pool(
                pb.PoolRequest(embed={"texts": ["after"]}), timeout=30
            )
        assert len(answer.embed.embeddings) == 1
    finally:
        for raw in raws:
            raw.close()
        server.stop()


def test_a_client_pinging_too_often_gets_goaway_too_many_pings(node_server: ServerProcess) -> None:
    """--min-client-ping-interval-s (10 s here): a client pinging three times in a row is
    sent GOAWAY ENHANCE_YOUR_CALM with "too_many_pings", as gRPC core does."""
    raw = RawHttp2(node_server.port)
    try:
        for i in range(4):
            raw.conn.ping(b"%08d" % i)
            raw.flush()
            raw.pump(0.2)
        deadline = time.monotonic() + 5
        while raw.terminated is None and time.monotonic() < deadline:
            raw.pump(0.2)
        assert raw.terminated == f"GOAWAY {h2.errors.ErrorCodes.ENHANCE_YOUR_CALM}"
    finally:
        raw.close()


def test_open_call_caps_share_the_total() -> None:
    """A connection's share of --max-open-calls is 1/32 (never below 256 or the cap), a
    client address's 1/2: 8 connections x 4,096 half-open streams hold 8,192 of the default
    32,768, and one client on many connections still leaves half for the others."""
    from pooling_server.service.grpc.node_door import open_call_caps

    assert open_call_caps(32768) == {"total": 32768, "per_connection": 1024, "per_client": 16384}
    assert open_call_caps(200) == {"total": 200, "per_connection": 200, "per_client": 200}
    assert open_call_caps(0) == {"total": 0, "per_connection": 0, "per_client": 0}
