"""The HTTP API on a real server: the official openai client, vLLM's and Cohere's shapes,
the same results and error reasons as gRPC, auth, health and metrics by protocol."""

from __future__ import annotations

import base64
import gzip
import json
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import openai
import pytest

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.metrics_endpoint import metric_sum, scrape
from tests.server_process import free_port, start_server
from tests.service.http_calls import HttpServer as BaseHttpServer

KEY = "http-test-key"
TEXTS = ["the cat sat on the mat", "a quick brown fox", "pooling over http"]


@dataclass
class HttpServer(BaseHttpServer):
    def stub(self) -> pooling_pb2_grpc.PoolingServiceStub:
        channel = grpc.insecure_channel(self.process.address)
        return pooling_pb2_grpc.PoolingServiceStub(channel)


@pytest.fixture(scope="module")
def http(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HttpServer]:
    http_port, metrics_port = free_port(), free_port()
    args = [
        "--model",
        f"tiny-bert={model_folders['tiny-bert']}",
        "--model",
        f"classifier={model_folders['tiny-classifier']}",
        "--model",
        f"cross={model_folders['tiny-cross-encoder']}",
        "--model",
        f"ner={model_folders['tiny-ner']}",
        "--hf-overrides",
        '{"is_matryoshka": true}',
        "--hf-overrides",
        "{}",
        "--hf-overrides",
        "{}",
        "--hf-overrides",
        "{}",
        "--dtype",
        "float32",
        "--http-port",
        str(http_port),
        "--metrics-port",
        str(metrics_port),
        "--api-key",
        KEY,
    ]
    process = start_server(args, tmp_path_factory.mktemp("http"), "http")
    try:
        yield HttpServer(process, http_port, metrics_port, KEY)
    finally:
        process.stop(signal.SIGTERM)


def grpc_embed(http: HttpServer, texts: list[str], **params: Any) -> np.ndarray:
    request = pb.PoolRequest(
        model="tiny-bert", embed=pb.TextInput(texts=texts), params=pb.PoolingParams(**params)
    )
    response = http.stub().Pool(request, timeout=60, metadata=(("authorization", f"Bearer {KEY}"),))
    return np.array([list(e.values) for e in response.embed.embeddings], dtype=np.float32)


def test_openai_client_embeddings_equal_grpc(http: HttpServer) -> None:
    client = openai.OpenAI(base_url=http.url("/v1"), api_key=KEY, max_retries=0)
    expected = grpc_embed(http, TEXTS)
    floats = client.embeddings.create(model="tiny-bert", input=TEXTS, encoding_format="float")
    assert [d.index for d in floats.data] == [0, 1, 2]
    assert floats.model == "tiny-bert"
    assert floats.usage.prompt_tokens == floats.usage.total_tokens > 0
    np.testing.assert_allclose([d.embedding for d in floats.data], expected, rtol=1e-6, atol=1e-7)
    # The SDK asks for base64 by default and decodes it itself.
    packed = client.embeddings.create(model="tiny-bert", input=TEXTS)
    np.testing.assert_array_equal(
        np.array([d.embedding for d in packed.data], dtype=np.float32), expected
    )
    one = client.embeddings.create(model="tiny-bert", input=TEXTS[0], dimensions=8)
    assert len(one.data) == 1
    np.testing.assert_allclose(one.data[0].embedding, grpc_embed(http, TEXTS[:1], dimensions=8)[0])


def test_embeddings_take_vllms_pooling_fields(http: HttpServer) -> None:
    """vLLM's /v1/embeddings reads truncate_prompt_tokens and normalize (use_activation):
    so does ours, as the official client sends them (extra_body), never ignoring them."""
    client = openai.OpenAI(base_url=http.url("/v1"), api_key=KEY, max_retries=0)
    whole = client.embeddings.create(model="tiny-bert", input=TEXTS[0], encoding_format="float")
    cut = client.embeddings.create(
        model="tiny-bert",
        input=TEXTS[0],
        encoding_format="float",
        extra_body={"truncate_prompt_tokens": 3},
    )
    assert cut.usage.prompt_tokens == 3 < whole.usage.prompt_tokens
    np.testing.assert_allclose(
        cut.data[0].embedding, grpc_embed(http, TEXTS[:1], truncate_prompt_tokens=3)[0], rtol=1e-6
    )
    raw = client.embeddings.create(
        model="tiny-bert", input=TEXTS[0], encoding_format="float", extra_body={"normalize": False}
    )
    expected = grpc_embed(http, TEXTS[:1], use_activation=False)[0]
    assert abs(np.linalg.norm(expected) - 1) > 1e-3  # the raw pooled vector, not unit length
    np.testing.assert_allclose(raw.data[0].embedding, expected, rtol=1e-6)
    for bad in (-1.5, "3", 10**12):
        status, _, body = http.call(
            "/v1/embeddings", {"input": "x", "model": "tiny-bert", "truncate_prompt_tokens": bad}
        )
        assert status in (400, 422), (bad, status, body)
        assert body["error"]["param"] == "truncate_prompt_tokens", body


def test_base64_is_little_endian_float32(http: HttpServer) -> None:
    status, _, body = http.call(
        "/v1/embeddings", {"input": TEXTS[1], "model": "tiny-bert", "encoding_format": "base64"}
    )
    assert status == 200
    vector = np.frombuffer(base64.b64decode(body["data"][0]["embedding"]), dtype="<f4")
    np.testing.assert_array_equal(vector, grpc_embed(http, TEXTS[1:2])[0])


def test_openai_client_sees_the_error_reason_and_field(http: HttpServer) -> None:
    client = openai.OpenAI(base_url=http.url("/v1"), api_key=KEY, max_retries=0)
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="tiny-bert", input=["ok", "fine", "x" * 10**6])
    error = caught.value.body
    assert isinstance(error, dict)
    assert error["reason"] == error["code"] == "INPUT_TOO_LONG"
    assert error["param"] == "embed.texts[2]"
    with pytest.raises(openai.NotFoundError) as missing:
        client.embeddings.create(model="no-such-model", input="x")
    assert missing.value.body["reason"] == "MODEL_NOT_FOUND"  # type: ignore[index]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=http.url("/v1"), api_key="wrong", max_retries=0).embeddings.create(
            model="tiny-bert", input="x"
        )


def test_bytes_that_are_not_utf8_are_named_so(http: HttpServer) -> None:
    for raw, field in (
        (b'{"input": "ab\xc3(", "model": "tiny-bert"}', "input"),
        (b'{"input": ["ok", "\xff"], "model": "tiny-bert"}', "input"),
        (b'{"input": "ok", "model": "tiny\xc3("}', "model"),
    ):
        status, _, body = http.call("/v1/embeddings", raw=raw)
        assert status == 422 and body["error"]["param"] == field, body
        assert "not valid UTF-8" in body["error"]["message"], body


def test_errors_carry_grpc_reasons_and_statuses(http: HttpServer) -> None:
    status, _, body = http.call("/v1/embeddings", {"input": "x", "dimensions": 99999})
    assert status == 400
    assert body["error"]["reason"] == "DIMENSIONS_OUT_OF_RANGE"
    assert body["error"]["field_violations"][0]["field"] == "params.dimensions"
    status, _, body = http.call("/v1/embeddings", {"input": [1, 2, 3], "model": "tiny-bert"})
    assert (status, body["error"]["reason"]) == (400, "TOKEN_INPUT_NOT_SUPPORTED")
    status, _, body = http.call("/v1/embeddings", {"input": 5})
    assert (status, body["error"]["reason"], body["error"]["param"]) == (
        422,
        "INVALID_BODY",
        "input",
    )
    status, _, body = http.call("/v1/embeddings", raw=b"{not json")
    assert (status, body["error"]["reason"]) == (400, "MALFORMED_REQUEST")
    status, _, body = http.call("/classify", {"input": "x", "model": "tiny-bert"})
    assert (status, body["error"]["reason"]) == (412, "TASK_NOT_SUPPORTED")
    status, _, body = http.call("/v1/embeddings", {"input": "x"}, key=None)
    assert (status, body["error"]["reason"]) == (401, "UNAUTHENTICATED")


def test_score_classify_and_pooling_equal_grpc(http: HttpServer) -> None:
    stub, auth = http.stub(), (("authorization", f"Bearer {KEY}"),)
    status, _, body = http.call("/v1/score", {"model": "cross", "text_1": "query", "text_2": TEXTS})
    assert status == 200
    expected = stub.Pool(
        pb.PoolRequest(model="cross", score=pb.ScoreInput(text_1=["query"], text_2=TEXTS)),
        timeout=60,
        metadata=auth,
    )
    assert [d["score"] for d in body["data"]] == pytest.approx(list(expected.score.scores))
    assert body["usage"]["prompt_tokens"] == expected.usage.prompt_tokens

    status, _, body = http.call("/classify", {"model": "classifier", "input": TEXTS})
    assert status == 200
    expected = stub.Pool(
        pb.PoolRequest(model="classifier", classify=pb.TextInput(texts=TEXTS)),
        timeout=60,
        metadata=auth,
    )
    for got, want in zip(body["data"], expected.classify.classifications, strict=True):
        assert got["label"] == want.label and got["num_classes"] == 3
        assert got["probs"] == pytest.approx(list(want.probs))

    status, _, body = http.call(
        "/pooling", {"model": "ner", "input": TEXTS[:1], "task": "token_classify"}
    )
    assert status == 200
    matrix = stub.Pool(
        pb.PoolRequest(model="ner", token_classify=pb.TextInput(texts=TEXTS[:1])),
        timeout=60,
        metadata=auth,
    ).token_classify.items[0]
    rows = np.array(body["data"][0]["data"], dtype=np.float32)
    assert rows.shape == (matrix.rows, matrix.cols)
    np.testing.assert_allclose(rows.reshape(-1), list(matrix.values), rtol=1e-6)
    status, _, body = http.call("/pooling", {"model": "tiny-bert", "input": TEXTS})
    np.testing.assert_allclose(
        [d["data"] for d in body["data"]], grpc_embed(http, TEXTS), rtol=1e-6, atol=1e-7
    )
    # vLLM's encoding_format on /pooling: each item's float32 bytes, rows one after another.
    status, _, packed = http.call(
        "/pooling",
        {"model": "ner", "input": TEXTS[:1], "task": "token_classify", "encoding_format": "base64"},
    )
    assert status == 200
    values = np.frombuffer(base64.b64decode(packed["data"][0]["data"]), dtype="<f4")
    np.testing.assert_array_equal(values, rows.reshape(-1))
    status, _, refused = http.call(
        "/pooling", {"model": "tiny-bert", "input": "x", "encoding_format": "bogus"}
    )
    assert status == 400 and refused["error"]["param"] == "encoding_format", refused


def test_error_types_are_openais(http: HttpServer) -> None:
    """Each status's `type` is one of OpenAI's, whatever the route's error."""
    cases = [
        (("/v1/embeddings", {"input": "x", "model": "tiny-bert", "dimensions": 1.5}), 422),
        (("/classify", {"input": "x", "model": "tiny-bert"}), 412),
        (("/v1/embeddings", {"input": "x", "model": "nope"}), 404),
        (("/v1/embeddings", {"input": []}), 400),
    ]
    expected = {400: "invalid_request_error", 404: "not_found_error"}
    for (path, body), status in cases:
        got, _, answer = http.call(path, body)
        assert got == status, answer
        assert answer["error"]["type"] == expected.get(status, "invalid_request_error"), answer
    got, _, answer = http.call("/v1/embeddings", {"input": "x"}, key="wrong")
    assert (got, answer["error"]["type"]) == (401, "authentication_error")


def test_add_special_tokens_false_is_refused_not_ignored(http: HttpServer) -> None:
    for path, body in (
        ("/v1/embeddings", {"model": "tiny-bert", "input": "x"}),
        ("/pooling", {"model": "tiny-bert", "input": "x"}),
        ("/classify", {"model": "classifier", "input": "x"}),
    ):
        status, _, answer = http.call(path, {**body, "add_special_tokens": False})
        assert status == 400, (path, answer)
        assert answer["error"]["param"] == "add_special_tokens", answer
        assert http.call(path, {**body, "add_special_tokens": True})[0] == 200


def test_models_health_and_metrics_by_protocol(http: HttpServer) -> None:
    status, _, body = http.call("/v1/models")
    assert status == 200
    assert [m["id"] for m in body["data"]] == ["tiny-bert", "classifier", "cross", "ner"]
    assert body["data"][0]["object"] == "model"
    status, _, body = http.call("/health", key=None)  # open to probes
    assert (status, body["status"]) == (200, "SERVING")
    before = scrape(http.metrics_port)
    for _ in range(3):
        assert http.call("/v1/embeddings", {"input": "count me", "model": "tiny-bert"})[0] == 200
    grpc_embed(http, ["and me"])
    after = scrape(http.metrics_port)

    def delta(**labels: str) -> float:
        name = "pooling_requests_total"
        return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)

    # Each protocol's own status: HTTP's 200, gRPC's OK.
    assert delta(protocol="http", code="200") == 3
    assert delta(protocol="http", code="OK") == 0
    assert delta(protocol="grpc", code="OK") == 1


def test_rerank_in_cohere_shape_equals_the_grpc_rerank(http: HttpServer) -> None:
    documents = ["a cat on a mat", "stock prices fell", "the cat sat", "rain in spain"]
    expected = http.stub().Rerank(
        pb.RerankRequest(model="cross", query="where did the cat sit", documents=documents),
        timeout=60,
        metadata=(("authorization", f"Bearer {KEY}"),),
    )
    for path in ("/v1/rerank", "/rerank"):
        status, _, body = http.call(
            path,
            {
                "model": "cross",
                "query": "where did the cat sit",
                "documents": [documents[0], {"text": documents[1]}, *documents[2:]],
                "top_n": 2,
                "return_documents": True,
            },
        )
        assert status == 200, body
        assert [r["index"] for r in body["results"]] == [r.index for r in expected.results[:2]]
        for got, want in zip(body["results"], expected.results, strict=False):
            assert got["relevance_score"] == pytest.approx(want.relevance_score)
            assert got["document"] == {"text": documents[got["index"]]}
        assert body["usage"]["total_tokens"] == expected.usage.prompt_tokens
    status, _, body = http.call("/rerank", {"model": "cross", "query": "q", "documents": ["d"]})
    assert status == 200 and "document" not in body["results"][0]
    status, _, body = http.call("/rerank", {"model": "cross", "query": "q", "documents": []})
    assert (status, body["error"]["reason"], body["error"]["param"]) == (
        400,
        "EMPTY_INPUT",
        "documents",
    )
    status, _, body = http.call("/rerank", {"model": "tiny-bert", "query": "q", "documents": [1]})
    assert (status, body["error"]["param"]) == (422, "documents[0]")


def test_status_mapping_of_overload_and_unavailability() -> None:
    """QUEUE_FULL is 429 and NOT_READY 503, each with Retry-After from the RetryInfo delay."""
    from pooling_server.engine.errors import ErrorKind, PoolingError
    from pooling_server.service.http.app import _pooling_error

    full = _pooling_error(
        PoolingError(ErrorKind.RESOURCE_EXHAUSTED, "QUEUE_FULL", "full", retry_after_s=1.0)
    )
    assert (full.status, full.headers["Retry-After"]) == (429, "1")
    assert json.loads(full.body)["error"]["reason"] == "QUEUE_FULL"  # type: ignore[arg-type]
    loading = _pooling_error(
        PoolingError(ErrorKind.UNAVAILABLE, "NOT_READY", "loading", retry_after_s=2.0)
    )
    assert (loading.status, loading.headers["Retry-After"]) == (503, "2")
    dead = _pooling_error(PoolingError(ErrorKind.FAILED_PRECONDITION, "TASK_NOT_SUPPORTED", "x"))
    assert dead.status == 412 and "Retry-After" not in dead.headers
    late = _pooling_error(PoolingError(ErrorKind.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED", "late"))
    assert late.status == 504
    broken = _pooling_error(PoolingError(ErrorKind.INTERNAL, "INTERNAL_ERROR", "internal"))
    body = json.loads(broken.body)  # type: ignore[arg-type]
    assert (broken.status, body["error"]["type"]) == (500, "server_error")


# ------------------------------------------------------------ bodies the client broke


def _raw(http: HttpServer, request: bytes, then: bytes = b"", wait_s: float = 0.3) -> bytes:
    """What the server sends back within a few seconds of `request` (then `then`)."""
    with socket.create_connection(("127.0.0.1", http.http_port), timeout=5) as sock:
        sock.sendall(request)
        if then:
            time.sleep(wait_s)
            sock.sendall(then)
        received = b""
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and b"\r\n\r\n" not in received:
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
        return received


def _head(path: str, length: int, *headers: str, key: str | None = KEY) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: x", "Content-Type: application/json"]
    lines += [f"Authorization: Bearer {key}"] if key else []
    lines += [f"Content-Length: {length}", *headers]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def test_a_body_its_content_encoding_does_not_decode_is_the_clients_error(
    http: HttpServer,
) -> None:
    """gzip or deflate named over plain JSON: 400 MALFORMED_REQUEST in each door's shape,
    not 500, and no traceback in the log."""
    offset = len(http.process.log())
    body = json.dumps({"input": "hi", "model": "tiny-bert"}).encode()
    for path, status, field in (
        ("/v1/embeddings", 400, "reason"),
        ("/embed", 422, "error_type"),
        ("/v2/embed", 400, "message"),
    ):
        for encoding in ("gzip", "deflate"):
            answer = _raw(http, _head(path, len(body), f"Content-Encoding: {encoding}") + body)
            head, _, payload = answer.partition(b"\r\n\r\n")
            assert head.startswith(f"HTTP/1.1 {status}".encode()), (path, encoding, answer[:300])
            assert b"could not be read" in payload or b"MALFORMED" in payload, payload[:300]
            assert field.encode() in payload
    # A body that does decode by its encoding is served.
    packed = gzip.compress(body)
    answer = _raw(http, _head("/v1/embeddings", len(packed), "Content-Encoding: gzip") + packed)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
    _no_traceback_since(http, offset)


def _no_traceback_since(http: HttpServer, offset: int) -> None:
    time.sleep(0.5)  # aiohttp logs after the answer
    log = http.process.log()[offset:]
    assert "Traceback" not in log and "ERROR" not in log, log[-3000:]


def test_broken_requests_leave_one_warning_not_a_traceback_each(http: HttpServer) -> None:
    """Requests aiohttp cannot parse, and clients gone mid-body, are answered (400, or a
    closed socket) and counted in one rate-limited warning: a client cannot fill the log."""
    offset = len(http.process.log())
    broken = [
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: 5\r\n"
        b"Content-Length: 6\r\n\r\n",
        b"GET /health HTTP/1.1\r\nHost: x\r\nX-Long: " + b"a" * 9000 + b"\r\n\r\n",
        b"POST /v1/embeddings HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    ]
    for request in broken * 5:
        assert b" 400 " in _raw(http, request).partition(b"\r\n")[0]
    for _ in range(5):  # a body cut short by the client going away
        with socket.create_connection(("127.0.0.1", http.http_port), timeout=5) as sock:
            sock.sendall(_head("/v1/embeddings", 30) + b'{"input":')
            time.sleep(0.2)
    _no_traceback_since(http, offset)
    status, _, _ = http.call("/v1/embeddings", {"input": "still fine", "model": "tiny-bert"})
    assert status == 200


def test_expect_100_continue_only_for_a_body_the_server_will_read(http: HttpServer) -> None:
    """curl sends Expect: 100-continue before large bodies: a keyless or oversized one hears
    its refusal before sending; a good one hears 100 Continue and is served."""
    body = json.dumps({"input": "hi", "model": "tiny-bert"}).encode()
    expect = "Expect: 100-continue"
    assert _raw(http, _head("/v1/embeddings", len(body), expect, key=None)).startswith(
        b"HTTP/1.1 401"
    )
    assert _raw(http, _head("/embed", 10**10, expect)).startswith(b"HTTP/1.1 413")
    with socket.create_connection(("127.0.0.1", http.http_port), timeout=5) as sock:
        sock.sendall(_head("/v1/embeddings", len(body), expect))
        assert sock.recv(100) == b"HTTP/1.1 100 Continue\r\n\r\n"
        sock.sendall(body)
        assert sock.recv(100).startswith(b"HTTP/1.1 200")


def test_embed_dtype_and_endianness_shape_the_base64_bytes(http: HttpServer) -> None:
    """vLLM's embed_dtype and endianness on /v1/embeddings (through the openai client) and
    /pooling: the bytes of the same vectors in float16, bfloat16 and fp8, either order."""
    expected = grpc_embed(http, TEXTS)
    client = openai.OpenAI(base_url=http.url("/v1"), api_key=KEY, max_retries=0)
    half = client.embeddings.create(
        model="tiny-bert",
        input=TEXTS,
        encoding_format="base64",
        extra_body={"embed_dtype": "float16", "endianness": "big"},
    )
    for row, vector in zip(half.data, expected, strict=True):
        got = np.frombuffer(base64.b64decode(row.embedding), dtype=">f2")  # type: ignore[arg-type]
        np.testing.assert_array_equal(got, vector.astype(np.float16))
    body = {"model": "tiny-bert", "input": TEXTS, "encoding_format": "base64"}
    status, _, answer = http.call("/pooling", {**body, "embed_dtype": "bfloat16"})
    assert status == 200, answer
    for row, vector in zip(answer["data"], expected, strict=True):
        bits = np.frombuffer(base64.b64decode(row["data"]), dtype="<u2").astype(np.uint32) << 16
        np.testing.assert_allclose(bits.view(np.float32), vector, rtol=2**-8)
    status, _, answer = http.call("/v1/embeddings", {**body, "embed_dtype": "fp8_e4m3"})
    assert status == 200, answer
    assert [len(base64.b64decode(row["embedding"])) for row in answer["data"]] == [32] * 3
    status, _, answer = http.call("/v1/embeddings", {**body, "embed_dtype": "float64"})
    assert status == 400 and answer["error"]["param"] == "embed_dtype", answer


def test_bytes_answers_are_the_arrays_with_their_layout(http: HttpServer) -> None:
    """vLLM's encoding_format bytes: the body is each vector's bytes in turn, and the
    `metadata` header says where each lies and its shape; bytes_only has no header; a
    token task's rows come as one matrix an input; late chunking is refused."""
    expected = grpc_embed(http, TEXTS)
    body = {"model": "tiny-bert", "input": TEXTS, "encoding_format": "bytes"}
    status, headers, content = http.fetch("/v1/embeddings", {**body, "embed_dtype": "float16"})
    assert status == 200, content
    assert headers["Content-Type"] == "application/octet-stream"
    metadata = json.loads(headers["metadata"])
    assert metadata["model"] == "tiny-bert" and metadata["usage"]["prompt_tokens"] > 0
    for item, vector in zip(metadata["data"], expected, strict=True):
        assert item["embed_dtype"] == "float16" and item["shape"] == [len(vector)]
        got = np.frombuffer(content[item["start"] : item["end"]], dtype="<f2")
        np.testing.assert_array_equal(got, vector.astype(np.float16))
    status, headers, content = http.fetch(
        "/v1/embeddings", {**body, "encoding_format": "bytes_only"}
    )
    assert status == 200 and "metadata" not in headers
    np.testing.assert_array_equal(np.frombuffer(content, "<f4").reshape(3, -1), expected)
    status, headers, content = http.fetch("/pooling", {**body, "task": "token_embed"})
    assert status == 200, content
    [first, *_] = json.loads(headers["metadata"])["data"]
    tokens, width = first["shape"]
    assert first["end"] - first["start"] == tokens * width * 4
    chunked = {**body, "input": TEXTS[0], "late_chunking": {"rule": "sentences"}}
    status, _, answer = http.call("/v1/embeddings", chunked)
    assert status == 400, answer
    assert answer["error"]["reason"] == "ENCODING_NOT_SUPPORTED_FOR_TASK"
