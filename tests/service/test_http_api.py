"""The HTTP API on a real server: the official openai client, vLLM's and Cohere's shapes,
the same results and error reasons as gRPC, auth, health and metrics by protocol."""

from __future__ import annotations

import base64
import json
import signal
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
    from engine.errors import ErrorKind, PoolingError
    from service.http_api import _pooling_error

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
