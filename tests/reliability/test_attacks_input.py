"""Attacks on request decoding: client input that once got 500 INTERNAL, and bodies that
amplify into millions of objects.

Integers far outside their type (`dimensions: 10^12`, `top_n: 10^18`), JSON nested 1,000
deep, header bytes that are not UTF-8, and 16 MB requests of four million two-character
texts sent by three clients at once, over gRPC and over HTTP. Each attack runs beside a
bystander (tests/reliability/attack_kit.py) with the server tree's RSS sampled, and prints
one `RELIABILITY <name>:` line. Every answer must be a documented 4xx / INVALID_ARGUMENT,
and the log must hold no traceback.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest

from pooling_client.v1 import pooling_pb2 as pb
from tests.reliability.attack_kit import ANSWER_TIMEOUT_S, MB, REFUSAL, Watch, timed, watching
from tests.reliability.support import (
    CLIENT_ERROR_CODES,
    assert_alive,
    check_rpc_error,
    check_status,
    report,
)
from tests.server_process import ServerProcess, free_port, start_server

pytestmark = pytest.mark.quiet  # times a bystander: `make test` runs it with nothing beside it

SERVICE = "/pooling.v1.PoolingService"
KEY = "input-attack-key"
KEYED = (("authorization", f"Bearer {KEY}"),)
# Two-character texts in a message just under --max-message-mb's default 16 MiB: four bytes
# each in protobuf, five in a JSON list.
GRPC_TEXTS = 4_100_000
HTTP_TEXTS = 3_300_000
ATTACKERS = 3
ATTACK_S = 2.0
# While a 16 MB message is read it is held more than once: gRPC core's slices, then a
# bytearray and the bytes handed to Python; aiohttp's chunks, then the joined body. So the
# peak is bounded by the messages in flight (no longer by the objects their texts would
# make: +3.2 GB before), and both doors read one large message at a time: HTTP knows one by
# its Content-Length (service/http/guard.py); gRPC reads a connection's first message in
# turn, and every message once a large one has come (service/grpc/read_gate.py), handing the
# free pages between gRPC core's slices back after each (service/ops/memory.py). Measured:
# +55-58 MB for the first gRPC flood on a fresh server (+80-100 MB before the turns for
# first messages and the trim), +35 MB for HTTP's.


@dataclass
class Served:
    process: ServerProcess
    http_port: int

    def post(
        self, path: str, body: bytes, headers: dict[str, str] | None = None, key: bool = True
    ) -> tuple[int, dict[str, Any]]:
        """(status, JSON) of one POST on a connection of its own. Header values are sent
        as latin-1, so "\\xff" arrives as the byte 0xFF: not UTF-8."""
        connection = http.client.HTTPConnection("127.0.0.1", self.http_port, timeout=30)
        try:
            sent = {"Content-Type": "application/json", **(headers or {})}
            if key and "Authorization" not in sent:
                sent["Authorization"] = f"Bearer {KEY}"
            connection.request("POST", path, body=body, headers=sent)
            response = connection.getresponse()
            return response.status, json.loads(response.read() or b"{}")
        finally:
            connection.close()


@pytest.fixture(scope="module")
def served(model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory):
    http_port = free_port()
    args = ["--model", f"tiny-bert={model_folders['tiny-bert']}", "--dtype", "float32"]
    args += ["--http-port", str(http_port), "--api-key", KEY]
    process = start_server(args, tmp_path_factory.mktemp("attacks-input"), "input")
    try:
        yield Served(process, http_port)
    finally:
        process.stop(signal.SIGTERM, timeout=10)


@pytest.fixture(scope="module")
def channel(served: Served) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(served.process.address) as channel:
        yield channel


def _no_tracebacks(served: Served) -> None:
    log = served.process.log()
    assert "Traceback" not in log, log[-3000:]
    assert_alive(served.process)


# ----------------------------------------------------------------- integers out of range

HUGE = [10**12, 10**18, -(10**18), 2**31, -(2**31) - 1, 10**30]
NOT_INTS = ["2.5", "1e3", "true", '"7"', "[1]", "{}"]


def _integer_cases() -> Iterator[tuple[str, str, str]]:
    """(route, field, raw JSON value) for every integer field of every route."""
    fields = [
        ("/v1/embeddings", "dimensions"),
        ("/pooling", "dimensions"),
        ("/pooling", "truncate_prompt_tokens"),
        ("/classify", "truncate_prompt_tokens"),
        ("/v1/score", "truncate_prompt_tokens"),
        ("/v1/rerank", "top_n"),
        ("/v1/rerank", "truncate_prompt_tokens"),
    ]
    for route, field in fields:
        for value in [*map(str, HUGE), *NOT_INTS]:
            yield route, field, value


BASE = {
    "/v1/embeddings": {"input": "x"},
    "/pooling": {"input": "x"},
    "/classify": {"input": "x"},
    "/v1/score": {"text_1": "a", "text_2": "b"},
    "/v1/rerank": {"query": "q", "documents": ["a", "b"]},
}


def test_http_integers_out_of_range(served: Served, record_property) -> None:
    """Each integer field with values beyond int32 (400 VALUE_OUT_OF_RANGE, naming the
    field and the range) and values of other types (422 INVALID_BODY): never a 500."""
    statuses: Counter[int] = Counter()
    with watching(served.process, KEYED) as watch:
        started = time.monotonic()
        slowest = 0.0
        for route, field, value in _integer_cases():
            body = json.dumps(BASE[route])[:-1] + f', "{field}": {value}}}'
            took, (status, answer) = timed(served.post, route, body.encode())
            slowest = max(slowest, took)
            statuses[status] += 1
            error = answer["error"]
            assert error["param"] == field, (route, field, value, answer)
            if value in NOT_INTS:
                assert (status, error["reason"]) == (422, "INVALID_BODY"), (route, value, answer)
            else:
                assert (status, error["reason"]) == (400, "VALUE_OUT_OF_RANGE"), answer
                assert "from -2147483648 to 2147483647" in error["message"]
        watch.answer_s = slowest
        total_s = time.monotonic() - started
    report(
        record_property,
        "http_integers_out_of_range",
        cases=sum(statuses.values()),
        statuses=dict(statuses),
        total_s=total_s,
        **watch.figures(),
    )
    REFUSAL.check(slowest, "the slowest refusal")
    watch.assert_unharmed()
    _no_tracebacks(served)


# Integer fields of TEI's and Cohere's bodies, and nested ones (late chunking's window,
# overlap and spans; TEI's parameters): (route, body with VALUE where the integer goes, path).
NESTED_INTEGERS = [
    ("/embed", '{"inputs": "x", "dimensions": VALUE}', "dimensions"),
    ("/predict", '{"inputs": "x", "parameters": {"top_k": VALUE}}', "parameters.top_k"),
    ("/v2/embed", '{"texts": ["x"], "output_dimension": VALUE}', "output_dimension"),
    ("/v2/embed", '{"texts": ["x"], "max_tokens": VALUE}', "max_tokens"),
    ("/v2/rerank", '{"query": "q", "documents": ["a"], "top_n": VALUE}', "top_n"),
    (
        "/v2/rerank",
        '{"query": "q", "documents": ["a"], "max_tokens_per_doc": VALUE}',
        "max_tokens_per_doc",
    ),
    (
        "/v1/embeddings",
        '{"input": "x", "late_chunking": {"rule": "tokens", "window": VALUE}}',
        "late_chunking.window",
    ),
    (
        "/pooling",
        '{"input": "x", "late_chunking": {"rule": "tokens", "window": 4, "overlap": VALUE}}',
        "late_chunking.overlap",
    ),
    (
        "/v1/embeddings",
        '{"input": "x", "late_chunking": {"spans": [[0, 1], [0, VALUE]]}}',
        "late_chunking.spans[1]",
    ),
]


def test_http_integers_of_every_family_out_of_range(served: Served, record_property) -> None:
    """TEI's, Cohere's and nested integer fields beyond int32 are 400 VALUE_OUT_OF_RANGE
    naming the field and the range, as docs/http.md promises (before: a late-chunking
    window of 2^40 was taken)."""
    statuses: Counter[int] = Counter()
    with watching(served.process, KEYED) as watch:
        slowest = 0.0
        for route, template, path in NESTED_INTEGERS:
            for value in [*map(str, HUGE), str(2**40)]:
                body = template.replace("VALUE", value).encode()
                took, (status, answer) = timed(served.post, route, body)
                slowest = max(slowest, took)
                statuses[status] += 1
                # Each family's envelope (OpenAI's, TEI's, Cohere's) names the field and
                # the range in its message.
                tei = route in ("/embed", "/predict")  # TEI answers a validation error 422
                assert status == (422 if tei else 400), (route, path, value, answer)
                assert f"{path}: must be an integer from -2147483648 to 2147483647" in str(
                    answer
                ) or ("VALUE_OUT_OF_RANGE" in str(answer) and path in str(answer)), answer
        watch.answer_s = slowest
    report(
        record_property,
        "http_integers_of_every_family_out_of_range",
        cases=sum(statuses.values()),
        statuses=dict(statuses),
        **watch.figures(),
    )
    REFUSAL.check(slowest, "the slowest refusal")
    watch.assert_unharmed()
    _no_tracebacks(served)


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative values as protobuf writes them: ten bytes
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def test_grpc_integers_out_of_range(served: Served, channel: grpc.Channel, record_property) -> None:
    """Varints too wide for their int32 field (protobuf keeps the low 32 bits) and enum
    values nobody defined: each is served, or refused with a documented client error."""
    embed = pb.PoolRequest(model="tiny-bert", embed=pb.TextInput(texts=["x"])).SerializeToString()
    rerank = pb.RerankRequest(query="q", documents=["a", "b"]).SerializeToString()
    sparse_texts = b"\x0a\x01x"  # SparseInput.texts = ["x"]
    cases: list[tuple[str, bytes]] = []
    for value in [*HUGE, -1, 2**63 - 1, -(2**63)]:
        for number in (2, 3, 4):  # dimensions, task, truncate_prompt_tokens
            params = _field(number, value)
            cases.append(("Pool", embed + b"\x1a" + _varint(len(params)) + params))
        cases.append(("Pool", embed + _field(12, value)))  # encoding
        sparse = sparse_texts + _field(2, value)  # top_k
        cases.append(("Pool", b"\x4a" + _varint(len(sparse)) + sparse))
        cases.append(("Rerank", rerank + _field(5, value)))  # top_n
    outcomes: Counter[str] = Counter()
    with watching(served.process, KEYED) as watch:
        slowest = 0.0
        for method, data in cases:
            call = channel.unary_unary(f"{SERVICE}/{method}")  # bytes in, bytes out
            took, result = timed(call, data, timeout=ANSWER_TIMEOUT_S, metadata=KEYED)
            slowest = max(slowest, took)
            if isinstance(result, grpc.RpcError):
                outcomes[check_rpc_error(result, CLIENT_ERROR_CODES).code.name] += 1
            else:
                outcomes["OK"] += 1
        watch.answer_s = slowest
    report(
        record_property,
        "grpc_integers_out_of_range",
        cases=len(cases),
        outcomes=dict(outcomes),
        **watch.figures(),
    )
    REFUSAL.check(slowest, "the slowest refusal")
    watch.assert_unharmed()
    _no_tracebacks(served)


# ------------------------------------------------------------------- nesting and headers


@pytest.mark.parametrize("depth", [33, 1000, 1_000_000])
def test_json_nested_deep(served: Served, depth: int, record_property) -> None:
    nested = b"[" * depth + b"]" * depth
    body = b'{"input": "x", "user": ' + nested + b"}"
    with watching(served.process, KEYED) as watch:
        watch.answer_s, (status, answer) = timed(served.post, "/v1/embeddings", body)
    report(record_property, f"json_nested_{depth}", status=status, **watch.figures())
    assert (status, answer["error"]["reason"]) == (400, "MALFORMED_REQUEST"), answer
    REFUSAL.check(watch.answer_s, "the refusal")
    watch.assert_unharmed()
    _no_tracebacks(served)


BAD_BYTES = "\xff\xfe\x80"  # latin-1 on the wire: bytes that are not UTF-8


def test_header_bytes_that_are_not_utf8(served: Served, record_property) -> None:
    body = b'{"input": "x"}'
    with watching(served.process, KEYED) as watch:
        started = time.monotonic()
        bad_id = {"X-Request-Id": f"id-{BAD_BYTES}"}
        request_id = served.post("/v1/embeddings", body, bad_id)
        tei = served.post("/embed", b'{"inputs": "x"}', bad_id)
        cohere_body = b'{"model": "tiny-bert", "texts": ["x"], "input_type": "search_query"}'
        cohere = served.post("/v2/embed", cohere_body, bad_id)
        auth = served.post("/v1/embeddings", body, {"Authorization": f"Bearer {BAD_BYTES}"})
        scheme = served.post("/v1/embeddings", body, {"Authorization": f"{BAD_BYTES} {KEY}"})
        trace = served.post("/v1/embeddings", body, {"traceparent": f"00-{BAD_BYTES}"})
        other = served.post("/v1/embeddings", body, {"X-Anything": BAD_BYTES})
        watch.answer_s = time.monotonic() - started
    report(
        record_property,
        "header_bytes_not_utf8",
        statuses=",".join(str(s) for s, _ in (request_id, tei, cohere, auth, scheme, trace, other)),
        **watch.figures(),
    )
    status, answer = request_id
    assert (status, answer["error"]["param"]) == (400, "X-Request-Id"), answer
    assert answer["error"]["reason"] == "REQUEST_ID_INVALID"
    # TEI's and Cohere's doors refuse it the same way, in their own shapes
    assert tei[0] == 422 and "X-Request-Id" in tei[1]["error"], tei
    assert cohere[0] == 400 and cohere[1]["reason"] == "REQUEST_ID_INVALID", cohere
    for status, answer in (auth, scheme):
        assert (status, answer["error"]["reason"]) == (401, "UNAUTHENTICATED"), answer
    for status, answer in (trace, other):  # headers the server need not read: served
        assert status == 200, answer
    watch.assert_unharmed()
    _no_tracebacks(served)


# --------------------------------------------------------------- millions of tiny texts


def _flood(
    send: Callable[[], object], refused: Callable[[object], bool]
) -> tuple[int, float, Counter[str]]:
    """ATTACKERS threads sending for ATTACK_S: (calls, slowest answer, what came back)."""
    calls, slowest, seen = 0, 0.0, Counter[str]()
    lock = threading.Lock()
    stop = time.monotonic() + ATTACK_S

    def attacker() -> None:
        nonlocal calls, slowest
        while time.monotonic() < stop:
            took, result = timed(send)
            with lock:
                calls += 1
                slowest = max(slowest, took)
                seen["refused" if refused(result) else repr(result)[:120]] += 1

    threads = [threading.Thread(target=attacker) for _ in range(ATTACKERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return calls, slowest, seen


def _too_many(result: object) -> bool:
    if not isinstance(result, grpc.RpcError):
        return False
    decoded = check_rpc_error(result, [grpc.StatusCode.INVALID_ARGUMENT])
    return decoded.info is not None and decoded.info.reason == "TOO_MANY_INPUTS"


def _grpc_messages() -> Iterator[tuple[str, bytes]]:
    texts = ["ab"] * GRPC_TEXTS
    yield "Pool", pb.PoolRequest(embed=pb.TextInput(texts=texts)).SerializeToString()
    yield "Rerank", pb.RerankRequest(query="q", documents=texts).SerializeToString()
    yield "Tokenize", pb.TokenizeRequest(texts=texts).SerializeToString()


@pytest.mark.parametrize("method", ["Pool", "Rerank", "Tokenize", "PoolStream"])
def test_millions_of_texts_over_grpc(served: Served, method: str, record_property) -> None:
    """Three clients send 16 MB messages of four million two-character texts for two
    seconds: each is refused as TOO_MANY_INPUTS, counted on the wire, in well under 1 s."""
    messages = dict(_grpc_messages())
    # Each attacker has a connection of its own, as three clients would.
    channels = [
        grpc.insecure_channel(
            served.process.address,
            options=[("grpc.use_local_subchannel_pool", 1), ("grpc.max_send_message_length", -1)],
        )
        for _ in range(ATTACKERS)
    ]
    counter = iter(range(1 << 30))
    if method == "PoolStream":
        inner = messages["Pool"]
        data = b"\x0a" + _varint(len(inner)) + inner  # PoolStreamRequest.request

        def send() -> object:
            call = channels[next(counter) % ATTACKERS].stream_stream(f"{SERVICE}/PoolStream")
            try:
                responses = list(call(iter([data]), timeout=ANSWER_TIMEOUT_S, metadata=KEYED))
            except grpc.RpcError as error:
                return error
            return responses

        def refused(result: object) -> bool:
            if not isinstance(result, list) or len(result) != 1:
                return False
            answer = pb.PoolStreamResponse.FromString(result[0])
            decoded = check_status(answer.error, [grpc.StatusCode.INVALID_ARGUMENT])
            return decoded.info is not None and decoded.info.reason == "TOO_MANY_INPUTS"

    else:
        data = messages[method]

        def send() -> object:
            call = channels[next(counter) % ATTACKERS].unary_unary(f"{SERVICE}/{method}")
            return call(data, timeout=ANSWER_TIMEOUT_S, metadata=KEYED)

        refused = _too_many
    try:
        with watching(served.process, KEYED) as watch:
            calls, watch.answer_s, seen = _flood(send, refused)
    finally:
        for channel in channels:
            channel.close()
    name = f"million_texts_grpc_{method}"
    _all_refused(served, watch, record_property, name, calls, seen, message_mb=len(data) / MB)


def _all_refused(
    served: Served,
    watch: Watch,
    record_property: Callable[[str, object], None],
    name: str,
    calls: int,
    seen: Counter[str],
    **figures: float,
) -> None:
    """A flood's figures reported; every call refused in time, the bystander unharmed, no
    traceback in the log."""
    report(
        record_property,
        name,
        **figures,
        attackers=ATTACKERS,
        calls=calls,
        outcomes=dict(seen),
        **watch.figures(),
    )
    assert set(seen) == {"refused"}, seen
    REFUSAL.check(watch.answer_s, "the slowest refusal")
    watch.assert_unharmed()
    _no_tracebacks(served)


@pytest.mark.parametrize("route", ["/v1/embeddings", "/v1/rerank"])
def test_millions_of_texts_over_http(served: Served, route: str, record_property) -> None:
    texts = b"[" + b",".join([b'"ab"'] * HTTP_TEXTS) + b"]"
    if route == "/v1/rerank":
        body = b'{"query": "q", "documents": ' + texts + b"}"
    else:
        body = b'{"input": ' + texts + b"}"

    def send() -> object:
        return served.post(route, body)

    def refused(result: object) -> bool:
        status, answer = result  # type: ignore[misc]
        return status == 400 and answer["error"]["reason"] == "TOO_MANY_INPUTS"

    with watching(served.process, KEYED) as watch:
        calls, watch.answer_s, seen = _flood(send, refused)
    name = f"million_texts_http_{route.strip('/').replace('/', '_')}"
    _all_refused(served, watch, record_property, name, calls, seen, body_mb=len(body) / MB)


def test_grpc_metadata_bytes_that_are_not_utf8(served: Served, record_property) -> None:
    """Metadata grpcio's clients would refuse to send, over a bare HTTP/2 connection: an
    Authorization, a request id and a traceparent of bytes that are not UTF-8. A bad key is
    UNAUTHENTICATED; with a good key the call is served or refused as a client error."""
    from tests.reliability.test_attacks import grpc_frame, raw_connection

    body = grpc_frame(pb.PoolRequest(embed=pb.TextInput(texts=["x"])).SerializeToString())
    bad = BAD_BYTES.encode("latin-1")
    keyed = (b"authorization", f"Bearer {KEY}".encode())
    cases = {
        "authorization": ((b"authorization", b"Bearer " + bad),),
        "scheme": ((b"authorization", bad + b" " + KEY.encode()),),
        "x-request-id": (keyed, (b"x-request-id", bad)),
        "traceparent": (keyed, (b"traceparent", b"00-" + bad)),
    }
    with watching(served.process, KEYED) as watch, raw_connection(served.process) as raw:
        started = time.monotonic()
        streams = {
            name: raw.start("Pool", body, metadata)  # type: ignore[arg-type]
            for name, metadata in cases.items()
        }
        raw.wait(list(streams.values()), ANSWER_TIMEOUT_S)
        watch.answer_s = time.monotonic() - started
        outcomes = {name: raw.calls[stream].outcome() for name, stream in streams.items()}
    report(record_property, "grpc_metadata_not_utf8", outcomes=outcomes, **watch.figures())
    assert outcomes["authorization"] == outcomes["scheme"] == "grpc-status 16", outcomes
    for name in ("x-request-id", "traceparent"):  # served (0) or a documented client error
        assert outcomes[name] in ("grpc-status 0", "grpc-status 3"), outcomes
    watch.assert_unharmed()
    _no_tracebacks(served)  # grpcio's traceback per value: one rate-limited line instead
    if served.process.grpc_door() == "grpcio":  # Node's door reads such bytes as latin-1
        assert "metadata value(s) that are not UTF-8" in served.process.log()
