"""Attacks on what the server sends: unread streams fed garbage, and answers too large to send.

A stream whose client writes unparseable messages and never reads must stay within its
flow control like any other (every in-band error takes a slot). A request whose answer
would exceed the door's limit (gRPC's --max-message-mb, the HTTP API's
--max-http-response-mb) is refused with INVALID_ARGUMENT / 400 OUTPUT_TOO_LARGE, its
estimate and the limit, before the forward pass: Tokenize on its characters, token outputs
once tokenized. An answer under the limit is still served, a large JSON one rendered off
the event loop. Each attack runs beside a bystander (attack_kit.watching) and prints one
RELIABILITY line.

The server is all-MiniLM-L6-v2 (384 dimensions, 512 tokens), as in the issue's figures.
"""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.fixture_models import MINILM
from tests.reliability.attack_kit import INVALID, refusal, timed, watching
from tests.reliability.support import assert_alive, check_success, embed_request, report
from tests.server_process import ServerProcess, free_port, start_server

SERVICE = "/pooling.v1.PoolingService"
GARBAGE = b"\xff" * 10 + b"\x01"  # an 11-byte varint: no message parses it
GARBAGE_STREAMS = 4
GARBAGE_S = 4.0
# 205 MiniLM tokens (the model takes 256) in 152 words.
PARAGRAPH = " ".join(f"word{i % 97} and more" for i in range(90))[:800]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, int]]:
    http_port = free_port()
    args = ["--model", f"minilm={MINILM}", "--dtype", "float32", "--http-port", str(http_port)]
    process = start_server(args, tmp_path_factory.mktemp("attacks-output"), "output")
    try:
        _warm_up(process)
        yield process, http_port
    finally:
        process.stop(signal.SIGTERM, timeout=10)


def _warm_up(process: ServerProcess) -> None:
    """A fresh server's first calls run slower (first batches of each shape): made here,
    so that the first attack's bystander does not pay for them."""
    with grpc.insecure_channel(process.address) as channel:
        warm = pooling_pb2_grpc.PoolingServiceStub(channel)
        for _ in range(5):
            warm.Pool(embed_request(["a bystander"]), timeout=30)
        warm.Pool(_token_embed([PARAGRAPH]), timeout=30)


@pytest.fixture(scope="module")
def stub(server: tuple[ServerProcess, int]) -> Iterator[pooling_pb2_grpc.PoolingServiceStub]:
    with grpc.insecure_channel(server[0].address) as channel:
        yield pooling_pb2_grpc.PoolingServiceStub(channel)


def _post(port: int, path: str, body: dict[str, object]) -> tuple[int, bytes]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _token_embed(texts: list[str]) -> pb.PoolRequest:
    return pb.PoolRequest(request_id="big", token_embed=pb.TextInput(texts=texts))


# --------------------------------------------------------------------------- streams


def test_unread_streams_writing_garbage_stay_bounded(
    server: tuple[ServerProcess, int], record_property
) -> None:
    """Four streams write unparseable messages as fast as they can and never read: each
    stops being read once its in-band errors fill its slots, so memory stays flat."""
    process, _ = server
    stop = threading.Event()
    sent = [0] * GARBAGE_STREAMS

    def garbage(k: int) -> Iterator[bytes]:
        """About 10,000 messages a second: the 256 slots fill within a tenth of a second,
        and this process leaves the bystander (in the same interpreter) its share."""
        while not stop.is_set():
            sent[k] += 1
            if sent[k] % 10 == 0:
                time.sleep(0.001)
            yield GARBAGE

    with watching(process) as watch, grpc.insecure_channel(process.address) as channel:
        call = channel.stream_stream(
            f"{SERVICE}/PoolStream", response_deserializer=pb.PoolStreamResponse.FromString
        )
        streams = [call(garbage(k), timeout=60) for k in range(GARBAGE_STREAMS)]
        time.sleep(GARBAGE_S)
        held = list(sent)
        stop.set()
        for stream in streams:
            stream.cancel()
        # A stream still answers once read: the server held its errors, not dropped them.
        watch.answer_s, answers = timed(
            lambda: list(call(iter([GARBAGE]), timeout=10))  # type: ignore[arg-type]
        )
    report(
        record_property,
        "attacks_output_unread_garbage_streams",
        streams=GARBAGE_STREAMS,
        seconds=GARBAGE_S,
        messages_taken=sum(held),
        **watch.figures(),
    )
    assert not isinstance(answers, grpc.RpcError), answers
    assert [a.WhichOneof("result") for a in answers] == ["error"]
    watch.assert_unharmed()
    assert_alive(process)


# --------------------------------------------------------------------------- Tokenize


def test_tokenize_too_large_is_refused_before_tokenizing(
    server: tuple[ServerProcess, int], stub: pooling_pb2_grpc.PoolingServiceStub, record_property
) -> None:
    """16 legal texts of 262,144 characters: about 2 million tokens, 31 MB of answer."""
    texts = ["a " * 131072] * 16
    with watching(server[0]) as watch:
        watch.answer_s, result = timed(stub.Tokenize, pb.TokenizeRequest(texts=texts), timeout=30)
    error = refusal(result, INVALID)
    report(record_property, "attacks_output_tokenize", **watch.figures())
    assert error.reason == "OUTPUT_TOO_LARGE", error.message
    assert error.fields == ["texts"]
    assert error.info is not None and error.info.metadata["limit_bytes"] == str(16 << 20)
    assert int(error.info.metadata["estimated_bytes"]) > 16 << 20
    assert "--max-message-mb" in error.message
    assert watch.answer_s < 2.0, f"refused after {watch.answer_s:.2f}s"
    watch.assert_unharmed()
    # One long text's tokens fit, and are served.
    answer = stub.Tokenize(pb.TokenizeRequest(texts=[PARAGRAPH * 20]), timeout=30)
    assert len(answer.items[0].token_ids) > 1000


# --------------------------------------------------------------------------- token outputs


def test_grpc_token_embed_too_large_is_refused_before_the_forward_pass(
    server: tuple[ServerProcess, int], stub: pooling_pb2_grpc.PoolingServiceStub, record_property
) -> None:
    """1,024 paragraphs: about 390 MB of token vectors; refused once tokenized."""
    with watching(server[0]) as watch:
        watch.answer_s, result = timed(stub.Pool, _token_embed([PARAGRAPH] * 1024), timeout=60)
    error = refusal(result, INVALID)
    report(record_property, "attacks_output_grpc_token_embed", **watch.figures())
    assert error.reason == "OUTPUT_TOO_LARGE", error.message
    assert error.fields == ["token_embed.texts"]
    assert f"{16 << 20} bytes" in error.message  # the limit, beside the estimate
    assert watch.answer_s < 3.0, f"refused after {watch.answer_s:.2f}s"
    watch.assert_unharmed()
    small = _token_embed([PARAGRAPH] * 2)  # 0.6 MB of token vectors: served
    check_success(small, stub.Pool(small, timeout=30))


def test_http_token_embed_too_large_is_refused(
    server: tuple[ServerProcess, int], record_property
) -> None:
    """/pooling token_embed on 128 paragraphs (a 130 KB body): about 260 MB of JSON."""
    process, http_port = server
    body = {"task": "token_embed", "input": [PARAGRAPH] * 128}
    with watching(process) as watch:
        started = time.monotonic()
        status, raw = _post(http_port, "/pooling", body)
        watch.answer_s = time.monotonic() - started
    report(record_property, "attacks_output_http_token_embed", status=status, **watch.figures())
    assert status == 400, raw[:300]
    error = json.loads(raw)["error"]
    assert error["reason"] == "OUTPUT_TOO_LARGE"
    assert error["param"] == "token_embed.texts"
    assert f"{64 << 20} bytes" in error["message"]
    assert "--max-http-response-mb" in error["message"]
    assert watch.answer_s < 2.0, f"refused after {watch.answer_s:.2f}s"
    watch.assert_unharmed()


def test_large_answers_under_the_limits_are_served(
    server: tuple[ServerProcess, int], stub: pooling_pb2_grpc.PoolingServiceStub, record_property
) -> None:
    """Under the limits, and cheap to compute: Tokenize answering megabytes over gRPC, and
    /pooling embed answering megabytes of JSON (rendered off the event loop)."""
    process, http_port = server
    texts = [PARAGRAPH * 20] * 16  # 256,000 characters: about 66,000 tokens
    inputs = [f"short text {i}" for i in range(300)]  # 115,200 floats of JSON
    with watching(process) as watch:
        grpc_s, answer = timed(stub.Tokenize, pb.TokenizeRequest(texts=texts), timeout=60)
        started = time.monotonic()
        status, raw = _post(http_port, "/pooling", {"task": "embed", "input": inputs})
        http_s = time.monotonic() - started
        watch.answer_s = max(grpc_s, http_s)
    report(
        record_property,
        "attacks_output_large_served",
        grpc_s=grpc_s,
        grpc_mb=answer.ByteSize() / (1 << 20) if isinstance(answer, pb.TokenizeResponse) else 0.0,
        http_s=http_s,
        http_mb=len(raw) / (1 << 20),
        **watch.figures(),
    )
    assert not isinstance(answer, grpc.RpcError), answer
    assert len(answer.items) == 16 and answer.ByteSize() > 1 << 20
    assert status == 200, raw[:300]
    data = json.loads(raw)["data"]
    assert len(data) == 300 and len(data[0]["data"]) == 384
    assert len(raw) > 2 << 20
    watch.assert_unharmed()
