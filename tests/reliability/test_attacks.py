"""Attacks: requests that are cheap to send and must stay cheap to refuse.

Compressed messages that inflate to megabytes of text, keyless floods against an
authenticated server, garbage and repeated ids inside a stream, oversized identifiers,
reset streams, messages flagged compressed without an encoding and bodiless calls sent
over a bare HTTP/2 connection (h2). While each attack runs, a bystander on its own
connection makes one short Pool call every 100 ms and a sampler reads the resident memory
of every server process every 10 ms. Each test prints one `RELIABILITY <name>:` line with
the time to answer, the extra RSS in MB and what the bystander saw. A rapid-reset flood is
in test_attacks_envoy.py: the server's gRPC core does not end such a connection; Envoy does.

The inflated-text tests run last: a server that tokenizes an 8 MB text before refusing
it stays busy for many seconds, and nothing else should run on it afterwards.
"""

from __future__ import annotations

import socket
import threading
import time
import zlib
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import h2.config
import h2.connection
import h2.errors
import h2.events
import h2.exceptions
import pytest

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.reliability.attack_kit import (
    ANSWER_TIMEOUT_S,
    INVALID,
    MB,
    REFUSAL,
    Bound,
    refusal,
    timed,
    watching,
)
from tests.reliability.support import (
    assert_alive,
    check_status,
    check_success,
    embed_request,
    report,
)
from tests.server_process import ServerProcess, all_serving, spawn_server

pytestmark = pytest.mark.quiet  # times a bystander: `make test` runs it with nothing beside it

SERVICE = "/pooling.v1.PoolingService"
API_KEY = "secret"
KEYED = (("authorization", f"Bearer {API_KEY}"),)
INFLATED_WORDS = 4_000_000  # "a " repeated: 8 MB of text, a few KB gzip-compressed
FLOOD_WORDS = 30_000_000  # 60 MB of text: over any message limit
FLOOD_CALLS = 10
FLOOD_REFUSAL = Bound(target_s=5.0, limit_s=10.0)  # all FLOOD_CALLS refused
# The issue asks for 20,000; measured once on the 2-core machine, that takes 23-24 s (all
# answered, +64 MB, bystander never failed but waited up to 1.3 s), too long for the suite.
BODILESS_CALLS = 2000
MAX_INPUT_CHARS = 1000
MAX_REQUEST_CHARS = 5000
Stub = pooling_pb2_grpc.PoolingServiceStub
# An 11-byte varint: no PoolingService message parses it.
GARBAGE = b"\xff" * 10 + b"\x01"


# --------------------------------------------------------------------------- servers


@pytest.fixture(scope="module")
def model_args(model_folders: dict[str, Path]) -> list[str]:
    """tiny-bert alone (128 positions): the default model of every server here."""
    return ["--model", f"tiny-bert={model_folders['tiny-bert']}", "--dtype", "float32"]


@pytest.fixture(scope="module")
def servers(model_args: list[str], tmp_path_factory: pytest.TempPathFactory):
    """The module's three servers, started side by side (each waits on its own imports):
    `attacked` with default limits serves every test without flags of its own, `keyed`
    wants an API key, `bounded` has low character limits."""
    flags = {
        "attacked": [],
        "keyed": ["--api-key", API_KEY],
        "bounded": [
            *("--max-input-chars", str(MAX_INPUT_CHARS)),
            *("--max-request-chars", str(MAX_REQUEST_CHARS)),
        ],
    }
    log_dir = tmp_path_factory.mktemp("attacks")
    started = {name: spawn_server([*model_args, *f], log_dir, name) for name, f in flags.items()}
    with all_serving(started.values()):
        yield started


@pytest.fixture(scope="module")
def attacked(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["attacked"]


@pytest.fixture(scope="module")
def keyed(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["keyed"]


@pytest.fixture(scope="module")
def bounded(servers: dict[str, ServerProcess]) -> ServerProcess:
    return servers["bounded"]


def _stub(server: ServerProcess) -> Iterator[pooling_pb2_grpc.PoolingServiceStub]:
    with grpc.insecure_channel(server.address) as channel:
        yield pooling_pb2_grpc.PoolingServiceStub(channel)


@pytest.fixture(scope="module")
def stub(attacked: ServerProcess):
    yield from _stub(attacked)


@pytest.fixture(scope="module")
def bounded_stub(bounded: ServerProcess):
    yield from _stub(bounded)


# --------------------------------------------------------------------------- bare HTTP/2


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def gzip_pool_request(words: int) -> bytes:
    """A serialized PoolRequest whose one embed text is "a " * words, gzip-compressed a
    megabyte at a time: the inflated message never exists in the test process."""
    text_len = 2 * words
    texts_tag = pb.TextInput.DESCRIPTOR.fields_by_name["texts"].number << 3 | 2
    embed_tag = pb.PoolRequest.DESCRIPTOR.fields_by_name["embed"].number << 3 | 2
    text_input_head = _varint(texts_tag) + _varint(text_len)
    head = _varint(embed_tag) + _varint(len(text_input_head) + text_len) + text_input_head
    compressor = zlib.compressobj(6, zlib.DEFLATED, 31)  # wbits 31: a gzip stream
    parts = [compressor.compress(head)]
    chunk = b"a " * (MB // 2)
    for start in range(0, words, MB // 2):
        parts.append(compressor.compress(chunk[: 2 * min(MB // 2, words - start)]))
    parts.append(compressor.flush())
    return b"".join(parts)


def grpc_frame(message: bytes, compressed: bool = False) -> bytes:
    """gRPC's length-prefixed message: a compressed flag, a 4-byte length, the bytes."""
    return bytes([int(compressed)]) + len(message).to_bytes(4, "big") + message


@dataclass
class RawCall:
    headers: dict[str, str] = field(default_factory=dict)  # response headers and trailers
    ended: bool = False
    reset: int | None = None  # the RST_STREAM error code, if the server reset the stream

    @property
    def done(self) -> bool:
        return self.ended or self.reset is not None

    @property
    def grpc_status(self) -> int | None:
        status = self.headers.get("grpc-status")
        return int(status) if status is not None else None

    def outcome(self) -> str:
        if self.grpc_status is not None:
            return f"grpc-status {self.grpc_status}"
        if self.reset is not None:
            return f"RST_STREAM {self.reset}"
        return "unanswered"


class RawHttp2:
    """A bare HTTP/2 connection speaking just enough gRPC to send what grpcio never would."""

    def __init__(self, port: int, timeout: float = 5.0, source: str | None = None) -> None:
        """`source`: the client address to connect from (any of 127/8 is loopback)."""
        self.timeout = timeout
        self.sock = socket.create_connection(
            ("127.0.0.1", port), timeout=timeout, source_address=source and (source, 0)
        )
        config = h2.config.H2Configuration(client_side=True, header_encoding="utf-8")
        self.conn = h2.connection.H2Connection(config)
        self.conn.initiate_connection()
        self.flush()
        self.calls: dict[int, RawCall] = {}
        self.terminated: str | None = None
        self._settings = False
        deadline = time.monotonic() + timeout
        while not self._settings:  # the server's SETTINGS: its stream limit and windows
            assert time.monotonic() < deadline, "no SETTINGS from the server"
            self.pump(deadline - time.monotonic())

    def close(self) -> None:
        try:
            self.conn.close_connection()
            self.flush()
        except (OSError, h2.exceptions.ProtocolError):
            pass
        self.sock.close()

    def flush(self) -> None:
        data = self.conn.data_to_send()
        if data:
            self.sock.sendall(data)

    def open(
        self, method: str, metadata: tuple[tuple[str, str], ...] = (), end_stream: bool = False
    ) -> int:
        """Send a call's HEADERS; with end_stream, the call has no body at all. `method`: a
        PoolingService method's name, or a whole path (another service's)."""
        stream_id = self.conn.get_next_available_stream_id()
        headers = [
            (":method", "POST"),
            (":scheme", "http"),
            (":path", method if method.startswith("/") else f"{SERVICE}/{method}"),
            (":authority", "127.0.0.1"),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
            *metadata,
        ]
        self.conn.send_headers(stream_id, headers, end_stream=end_stream)
        self.calls[stream_id] = RawCall()
        return stream_id

    def start(
        self,
        method: str,
        body: bytes | None = None,
        metadata: tuple[tuple[str, str], ...] = (),
        flush: bool = True,
    ) -> int:
        """A whole call; without a body, HEADERS carry END_STREAM and no DATA follows."""
        stream_id = self.open(method, metadata, end_stream=body is None)
        if body is not None:
            self.send(stream_id, body, end_stream=True)
        if flush:
            self.flush()
        return stream_id

    def send(
        self,
        stream_id: int,
        data: bytes,
        end_stream: bool = False,
        frame_bytes: int | None = None,
    ) -> None:
        """`data` in DATA frames as large as flow control allows, or of `frame_bytes`."""
        view = memoryview(data)
        # A window that stays shut this long is a hang; a slow reader on a busy host is not.
        deadline = time.monotonic() + max(ANSWER_TIMEOUT_S, self.timeout)
        largest = frame_bytes or self.conn.max_outbound_frame_size
        while view and not self.calls[stream_id].done:
            window = min(self.conn.local_flow_control_window(stream_id), largest)
            if window <= 0:
                self.flush()
                assert time.monotonic() < deadline, "the server never opened its window"
                self.pump(0.1)
                continue
            self.conn.send_data(stream_id, bytes(view[:window]))
            view = view[window:]
        if end_stream and not self.calls[stream_id].done:
            self.conn.end_stream(stream_id)

    def reset(self, stream_id: int) -> None:
        self.conn.reset_stream(stream_id, h2.errors.ErrorCodes.CANCEL)
        self.flush()

    def pump(self, timeout: float) -> bool:
        """Read and handle what the server sent within `timeout`; False if nothing came."""
        self.sock.settimeout(max(timeout, 0.001))
        try:
            data = self.sock.recv(1 << 16)
        except TimeoutError:
            return False
        if not data:
            self.terminated = self.terminated or "connection closed"
            return False
        for event in self.conn.receive_data(data):
            call = self.calls.get(getattr(event, "stream_id", 0) or 0)
            if isinstance(event, h2.events.RemoteSettingsChanged):
                self._settings = True
            elif isinstance(event, h2.events.ResponseReceived | h2.events.TrailersReceived):
                if call is not None:
                    call.headers.update(event.headers)  # type: ignore[arg-type]
            elif isinstance(event, h2.events.DataReceived):
                self.conn.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.StreamEnded):
                if call is not None:
                    call.ended = True
            elif isinstance(event, h2.events.StreamReset):
                if call is not None:
                    call.reset = int(event.error_code)
            elif isinstance(event, h2.events.ConnectionTerminated):
                self.terminated = f"GOAWAY {event.error_code}"
        self.flush()
        return True

    def wait(self, stream_ids: list[int], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.calls[s].done for s in stream_ids) and self.terminated is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            self.pump(remaining)


@contextmanager
def raw_connection(server: ServerProcess) -> Iterator[RawHttp2]:
    raw = RawHttp2(server.port)
    try:
        yield raw
    finally:
        raw.close()


def test_inflating_payload_is_a_pool_request() -> None:
    """The hand-built compressed message is what protobuf itself would have serialized."""
    for words in (1, 5, MB // 2, MB // 2 + 3):
        expected = pb.PoolRequest(embed=pb.TextInput(texts=["a " * words])).SerializeToString()
        assert zlib.decompress(gzip_pool_request(words), 31) == expected


# --------------------------------------------------------------------------- compressed flag


@pytest.mark.parametrize("encoding", [None, "identity"])
def test_compressed_flag_without_an_encoding_is_internal(
    attacked: ServerProcess, encoding: str | None, record_property
) -> None:
    """A message whose Compressed-Flag is 1 on a call with no grpc-encoding (or identity).

    INTERNAL is the answer the gRPC spec requires, not a server fault: doc/compression.md in
    grpc/grpc, test case 6, says such an ill-constructed message MUST fail with INTERNAL
    and a description of the invalid Compressed-Flag. gRPC core answers it before the
    servicer runs, so this is the one INTERNAL a client can provoke on purpose."""
    body = grpc_frame(embed_request(["flagged"]).SerializeToString(), compressed=True)
    metadata = (("grpc-encoding", encoding),) if encoding else ()
    with watching(attacked) as watch, raw_connection(attacked) as raw:
        started = time.monotonic()
        stream_id = raw.start("Pool", body, metadata=metadata)
        raw.wait([stream_id], timeout=ANSWER_TIMEOUT_S)
        watch.answer_s = time.monotonic() - started
        call = raw.calls[stream_id]
    report(
        record_property,
        f"attacks_compressed_flag_{encoding or 'no'}_encoding",
        outcome=call.outcome(),
        message=call.headers.get("grpc-message", ""),
        **watch.figures(),
    )
    assert call.grpc_status == grpc.StatusCode.INTERNAL.value[0], call.outcome()
    assert "compress" in call.headers.get("grpc-message", "").lower(), call.headers
    REFUSAL.check(watch.answer_s, "the refusal")
    watch.assert_unharmed()
    assert_alive(attacked)


# --------------------------------------------------------------------------- auth before parsing


def test_keyless_flood_of_inflating_messages(keyed: ServerProcess, record_property) -> None:
    """Ten keyless calls, each ~60 KB of gzip inflating to 60 MB: UNAUTHENTICATED, unread."""
    body = grpc_frame(gzip_pool_request(FLOOD_WORDS), compressed=True)
    with watching(keyed, KEYED) as watch, raw_connection(keyed) as raw:
        started = time.monotonic()
        calls = [
            raw.start("Pool", body, metadata=(("grpc-encoding", "gzip"),), flush=False)
            for _ in range(FLOOD_CALLS)
        ]
        raw.flush()
        raw.wait(calls, timeout=10)
        watch.answer_s = time.monotonic() - started
        outcomes = Counter(raw.calls[c].outcome() for c in calls)
    report(
        record_property,
        "attacks_keyless_flood",
        calls=FLOOD_CALLS,
        wire_kb=len(body) / 1024,
        inflated_bytes=2 * FLOOD_WORDS,
        outcomes=dict(outcomes),
        **watch.figures(),
    )
    unauthenticated = f"grpc-status {grpc.StatusCode.UNAUTHENTICATED.value[0]}"
    assert outcomes == {unauthenticated: FLOOD_CALLS}, outcomes
    FLOOD_REFUSAL.check(watch.answer_s, "refusing the flood")
    watch.assert_unharmed()


def test_keyless_garbage_is_unauthenticated(keyed: ServerProcess, record_property) -> None:
    """Bytes that are not protobuf, without a key: UNAUTHENTICATED, not MALFORMED_REQUEST."""
    with watching(keyed, KEYED) as watch, grpc.insecure_channel(keyed.address) as channel:
        raw_pool = channel.unary_unary(f"{SERVICE}/Pool")  # bytes in, bytes out
        watch.answer_s, keyless = timed(raw_pool, GARBAGE, timeout=ANSWER_TIMEOUT_S)
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        _, keyed_answer = timed(
            stub.Pool, embed_request(["with a key"]), timeout=30, metadata=KEYED
        )
        _, wrong_key = timed(
            stub.Pool,
            embed_request(["with a wrong key"]),
            timeout=30,
            metadata=(("authorization", "Bearer wrong"),),
        )
    report(record_property, "attacks_keyless_garbage", **watch.figures())
    assert isinstance(keyless, grpc.RpcError), "garbage without a key was answered"
    assert keyless.code() == grpc.StatusCode.UNAUTHENTICATED, (keyless.code(), keyless.details())
    assert isinstance(wrong_key, grpc.RpcError)
    assert wrong_key.code() == grpc.StatusCode.UNAUTHENTICATED
    assert not isinstance(keyed_answer, grpc.RpcError), keyed_answer
    check_success(embed_request(["with a key"]), keyed_answer)
    watch.assert_unharmed()


# --------------------------------------------------------------------------- streams


def _stream_message(request_id: str, text: str = "a short text") -> bytes:
    return pb.PoolStreamRequest(
        request=embed_request([text], request_id=request_id)
    ).SerializeToString()


def test_garbage_inside_a_stream_is_answered_in_band(
    attacked: ServerProcess, record_property
) -> None:
    """r0..r4, one unparseable message, r5..r9: ten results, one in-band error, status OK."""
    payloads = [_stream_message(f"r{i}") for i in range(5)]
    payloads += [GARBAGE, *(_stream_message(f"r{i}") for i in range(5, 10))]
    answers: list[pb.PoolStreamResponse] = []
    with watching(attacked) as watch, grpc.insecure_channel(attacked.address) as channel:
        call = channel.stream_stream(
            f"{SERVICE}/PoolStream", response_deserializer=pb.PoolStreamResponse.FromString
        )
        started = time.monotonic()
        ended: grpc.RpcError | None = None
        try:
            answers.extend(call(iter(payloads), timeout=30))
        except grpc.RpcError as error:
            ended = error
        watch.answer_s = time.monotonic() - started
    results = sorted(a.request_id for a in answers if a.WhichOneof("result") == "response")
    errors = [a for a in answers if a.WhichOneof("result") == "error"]
    report(
        record_property,
        "attacks_stream_garbage",
        results=len(results),
        errors=len(errors),
        ended=ended.code().name if ended else "OK",  # type: ignore[attr-defined]
        **watch.figures(),
    )
    assert ended is None, f"the stream ended with {ended.code()}: {ended.details()}"  # type: ignore[attr-defined]
    assert results == sorted(f"r{i}" for i in range(10))
    assert len(errors) == 1, [a.request_id for a in errors]
    assert errors[0].request_id == ""
    error = check_status(errors[0].error, INVALID)
    assert error.reason == "MALFORMED_REQUEST"
    assert error.fields == ["messages[5]"]
    watch.assert_unharmed()


def test_duplicate_request_id_on_a_stream(attacked: ServerProcess, record_property) -> None:
    """r0 twice in a row: the first is served; the second is refused without its id."""
    messages = [
        pb.PoolStreamRequest(request=embed_request([text], request_id="r0"))
        for text in ("the original", "the duplicate")
    ]
    with watching(attacked) as watch, grpc.insecure_channel(attacked.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        watch.answer_s, answers = timed(lambda: list(stub.PoolStream(iter(messages), timeout=30)))
    report(record_property, "attacks_stream_duplicate_id", **watch.figures())
    assert not isinstance(answers, grpc.RpcError), answers
    results = [a for a in answers if a.WhichOneof("result") == "response"]
    errors = [a for a in answers if a.WhichOneof("result") == "error"]
    assert [a.request_id for a in results] == ["r0"]
    check_success(messages[0].request, results[0].response)
    assert [a.request_id for a in errors] == [""]
    error = check_status(errors[0].error, INVALID)
    assert error.reason == "REQUEST_ID_DUPLICATE"
    assert error.info is not None and error.info.metadata.get("request_id") == "r0"
    assert error.fields == ["messages[1].request.request_id"]
    watch.assert_unharmed()


def test_client_resets_streams(attacked: ServerProcess, record_property) -> None:
    """Streams cancelled before, during and after their work, and an RST_STREAM mid-message:
    no traceback in the server log, and the server goes on serving."""
    log_start = len(attacked.log())
    cancelled = 0
    with watching(attacked) as watch, grpc.insecure_channel(attacked.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        started = time.monotonic()
        for round_ in range(12):
            hold = threading.Event()

            def messages(
                k: int = round_, hold: threading.Event = hold
            ) -> Iterator[pb.PoolStreamRequest]:
                for i in range(1 + k % 3 * 10):
                    yield pb.PoolStreamRequest(
                        request=embed_request([f"reset {k} {i} " * 20], request_id=f"{k}-{i}")
                    )
                hold.wait(10)  # the client keeps its side open until it resets

            call = stub.PoolStream(messages(), timeout=30)
            if round_ % 3 == 0:
                next(call)  # after the first answer
            else:
                time.sleep(0.005 * round_)  # before or while the work runs
            call.cancel()
            hold.set()
            cancelled += call.code() == grpc.StatusCode.CANCELLED
        with raw_connection(attacked) as raw:  # a message and half of another, then reset
            whole = grpc_frame(_stream_message("raw-0"))
            half = grpc_frame(_stream_message("raw-1"))[:9]
            stream_id = raw.open("PoolStream")
            raw.send(stream_id, whole + half)
            raw.flush()
            raw.pump(0.05)
            raw.reset(stream_id)
        watch.answer_s = time.monotonic() - started
        time.sleep(0.5)  # let the server finish with the cancelled calls
        _, after = timed(stub.Pool, embed_request(["after the resets"]), timeout=30)
    new_log = attacked.log()[log_start:]
    report(
        record_property,
        "attacks_stream_resets",
        streams=13,
        cancelled=cancelled,
        tracebacks=new_log.count("Traceback"),
        **watch.figures(),
    )
    assert "Traceback" not in new_log, new_log[-4000:]
    assert not isinstance(after, grpc.RpcError), after
    check_success(embed_request(["after the resets"]), after)
    assert_alive(attacked)
    watch.assert_unharmed()


# --------------------------------------------------------------------------- bodiless calls

# What a unary call without its one message may get: INVALID_ARGUMENT, or INTERNAL or
# UNIMPLEMENTED from gRPC itself.
BODILESS_STATUSES = {3, 12, 13}


@pytest.mark.parametrize("method", ["Pool", "Tokenize"])
def test_bodiless_unary_call_is_answered(
    attacked: ServerProcess, method: str, record_property
) -> None:
    """HEADERS with END_STREAM and no DATA: a unary call that never sends its message."""
    with watching(attacked) as watch, raw_connection(attacked) as raw:
        started = time.monotonic()
        stream_id = raw.start(method)
        raw.wait([stream_id], timeout=1.0)
        watch.answer_s = time.monotonic() - started
        call = raw.calls[stream_id]
    report(
        record_property,
        f"attacks_bodiless_{method.lower()}",
        outcome=call.outcome(),
        **watch.figures(),
    )
    assert call.grpc_status in BODILESS_STATUSES, f"{call.outcome()} after {watch.answer_s:.2f}s"
    REFUSAL.check(watch.answer_s, "the refusal")
    watch.assert_unharmed()


def test_two_thousand_bodiless_calls_pipelined(attacked: ServerProcess, record_property) -> None:
    """2,000 bodiless Pool calls on one connection, as many open as SETTINGS allow."""
    stall_s = 2.0  # give up once nothing has been answered for this long
    with watching(attacked) as watch, raw_connection(attacked) as raw:
        limit = raw.conn.remote_settings.max_concurrent_streams
        started = last_progress = time.monotonic()
        sent, done, peak_open = 0, 0, 0
        while (
            done < BODILESS_CALLS
            and time.monotonic() - last_progress < stall_s
            and raw.terminated is None
        ):
            room = raw.conn.remote_settings.max_concurrent_streams - raw.conn.open_outbound_streams
            for _ in range(max(0, min(room, BODILESS_CALLS - sent))):
                raw.start("Pool", flush=False)
                sent += 1
            raw.flush()
            peak_open = max(peak_open, raw.conn.open_outbound_streams)
            raw.pump(0.1)
            now_done = sum(call.done for call in raw.calls.values())
            if now_done != done:
                done, last_progress = now_done, time.monotonic()
        watch.answer_s = time.monotonic() - started
        outcomes = Counter(call.outcome() for call in raw.calls.values())
    report(
        record_property,
        "attacks_bodiless_pipelined",
        calls=BODILESS_CALLS,
        sent=sent,
        answered=done,
        max_concurrent_streams=limit,
        peak_open=peak_open,
        outcomes=dict(outcomes),
        connection=raw.terminated or "open",
        **watch.figures(),
    )
    assert raw.terminated is None, raw.terminated
    assert sent == BODILESS_CALLS
    answered = sum(n for o, n in outcomes.items() if o.startswith("grpc-status "))
    assert answered == BODILESS_CALLS, dict(outcomes)
    assert {int(o.split()[1]) for o in outcomes} <= BODILESS_STATUSES, dict(outcomes)
    watch.assert_unharmed()
    assert_alive(attacked)


# --------------------------------------------------------------------------- bounded fields


def test_request_id_bound(attacked: ServerProcess, stub: Stub, record_property) -> None:
    """256 bytes of request_id are accepted; 257 bytes (even as 129 characters) are not."""
    with watching(attacked) as watch:
        watch.answer_s, accepted = timed(
            stub.Pool, embed_request(["a"], request_id="x" * 256), timeout=30
        )
        refused = [
            timed(stub.Pool, embed_request(["a"], request_id=rid), timeout=30)[1]
            for rid in ("x" * 257, "é" * 128 + "x")
        ]
    report(record_property, "attacks_request_id_bound", **watch.figures())
    assert not isinstance(accepted, grpc.RpcError), accepted
    assert accepted.request_id == "x" * 256
    for result in refused:
        error = refusal(result)
        assert (error.reason, error.fields) == ("REQUEST_ID_TOO_LONG", ["request_id"])
    watch.assert_unharmed()


def test_model_name_bound(attacked: ServerProcess, stub: Stub, record_property) -> None:
    """An unknown name of 256 characters is NOT_FOUND; 257 characters are refused unread."""
    with watching(attacked) as watch:
        watch.answer_s, too_long = timed(
            stub.Pool, embed_request(["a"], model="m" * 257), timeout=30
        )
        _, unknown = timed(stub.Pool, embed_request(["a"], model="m" * 256), timeout=30)
    report(record_property, "attacks_model_name_bound", **watch.figures())
    error = refusal(too_long)
    assert (error.reason, error.fields) == ("MODEL_NAME_TOO_LONG", ["model"])
    assert refusal(unknown, [grpc.StatusCode.NOT_FOUND]).reason == "MODEL_NOT_FOUND"
    watch.assert_unharmed()


def test_huge_request_id_is_not_echoed(
    attacked: ServerProcess, stub: Stub, record_property
) -> None:
    """A 10 MB request_id: refused, and neither the message nor the details carry it."""
    with watching(attacked) as watch:
        watch.answer_s, result = timed(
            stub.Pool, embed_request(["a"], request_id="x" * (10 * MB)), timeout=30
        )
    report(record_property, "attacks_huge_request_id", **watch.figures())
    error = refusal(result)
    assert error.reason == "REQUEST_ID_TOO_LONG"
    assert len(error.message.encode()) < 1024, len(error.message)
    details = error.info.SerializeToString() if error.info else b""  # type: ignore[union-attr]
    details += error.bad_request.SerializeToString() if error.bad_request else b""
    assert len(details) < 4096, f"the error details hold {len(details)} bytes"
    REFUSAL.check(watch.answer_s, "the refusal")
    watch.assert_unharmed()


def _text(chars: int, word: str = "ab") -> str:
    return ((word + " ") * (chars // (len(word) + 1) + 1))[:chars]


def test_text_character_bound(bounded: ServerProcess, bounded_stub: Stub, record_property) -> None:
    """--max-input-chars 1000: 1001 characters are refused before tokenizing, truncation or
    not; 1000 characters (about 330 tokens, over tiny-bert's 128) truncate and succeed."""
    at_bound = embed_request([_text(MAX_INPUT_CHARS)], truncate_prompt_tokens=-1)
    with watching(bounded) as watch:
        watch.answer_s, over = timed(bounded_stub.Pool, embed_request([_text(1001)]), timeout=30)
        _, over_truncated = timed(
            bounded_stub.Pool, embed_request([_text(1001)], truncate_prompt_tokens=-1), timeout=30
        )
        _, accepted = timed(bounded_stub.Pool, at_bound, timeout=30)
    report(record_property, "attacks_text_char_bound", **watch.figures())
    for result in (over, over_truncated):
        error = refusal(result)
        assert (error.reason, error.fields) == ("INPUT_TOO_LONG", ["embed.texts[0]"])
    assert not isinstance(accepted, grpc.RpcError), accepted
    check_success(at_bound, accepted)
    assert accepted.usage.prompt_tokens == 128  # tiny-bert's maximum
    watch.assert_unharmed()


def test_request_character_bound(
    bounded: ServerProcess, bounded_stub: Stub, record_property
) -> None:
    """--max-request-chars 5000: six texts of 900 characters are refused as a whole; five
    are served."""
    six = embed_request([_text(900)] * 6, truncate_prompt_tokens=-1)
    five = embed_request([_text(900)] * 5, truncate_prompt_tokens=-1)
    with watching(bounded) as watch:
        watch.answer_s, refused = timed(bounded_stub.Pool, six, timeout=30)
        _, accepted = timed(bounded_stub.Pool, five, timeout=30)
    report(record_property, "attacks_request_char_bound", **watch.figures())
    error = refusal(refused)
    assert (error.reason, error.fields) == ("REQUEST_TOO_LARGE", ["embed.texts"])
    assert not isinstance(accepted, grpc.RpcError), accepted
    check_success(five, accepted)
    watch.assert_unharmed()


def test_tokenize_character_bounds(
    bounded: ServerProcess, bounded_stub: Stub, record_property
) -> None:
    """The same bounds on Tokenize: `texts[i]` for one text, `texts` for all of them."""
    with watching(bounded) as watch:
        watch.answer_s, too_long = timed(
            bounded_stub.Tokenize, pb.TokenizeRequest(texts=["short", _text(1001)]), timeout=30
        )
        _, too_large = timed(
            bounded_stub.Tokenize, pb.TokenizeRequest(texts=[_text(900)] * 6), timeout=30
        )
        _, accepted = timed(
            bounded_stub.Tokenize, pb.TokenizeRequest(texts=[_text(MAX_INPUT_CHARS)]), timeout=30
        )
    report(record_property, "attacks_tokenize_char_bounds", **watch.figures())
    error = refusal(too_long)
    assert (error.reason, error.fields) == ("INPUT_TOO_LONG", ["texts[1]"])
    error = refusal(too_large)
    assert (error.reason, error.fields) == ("REQUEST_TOO_LARGE", ["texts"])
    assert not isinstance(accepted, grpc.RpcError), accepted
    assert len(accepted.items) == 1 and len(accepted.items[0].token_ids) > 128
    watch.assert_unharmed()


# --------------------------------------------------------------------------- inflated text (last)


@pytest.fixture(scope="module")
def inflated_request() -> pb.PoolRequest:
    return embed_request(["a " * INFLATED_WORDS])


@pytest.mark.parametrize("case", ["pool", "pool_truncated", "tokenize"])
def test_inflated_long_text(
    attacked: ServerProcess,
    stub: Stub,
    inflated_request: pb.PoolRequest,
    case: str,
    record_property,
) -> None:
    """8 MB of "a " (4 million words) in one text, gzip-compressed by the client to a few KB:
    refused by its character count, before any tokenizing, in under a second."""
    if case == "tokenize":
        call, request = stub.Tokenize, pb.TokenizeRequest(texts=inflated_request.embed.texts)
        path = "texts[0]"
    else:
        call, request, path = stub.Pool, pb.PoolRequest(), "embed.texts[0]"
        request.CopyFrom(inflated_request)
        if case == "pool_truncated":
            request.params.truncate_prompt_tokens = -1
    with watching(attacked) as watch:
        watch.answer_s, result = timed(
            call, request, timeout=ANSWER_TIMEOUT_S, compression=grpc.Compression.Gzip
        )
    report(
        record_property,
        f"attacks_inflated_text_{case}",
        text_chars=2 * INFLATED_WORDS,
        outcome=result.code().name if isinstance(result, grpc.RpcError) else "OK",
        **watch.figures(),
    )
    error = refusal(result)
    assert error.reason == "INPUT_TOO_LONG", (error.reason, error.message[:200])
    assert path in error.fields, error.fields
    REFUSAL.check(watch.answer_s, "the refusal")
    watch.assert_unharmed()
