"""Late chunking through a real (split: front end + engine process) server: gRPC Pool with
spans equal to the server's own token_embed averaged per chunk; the Python client's rule
chunks; a text past a 64-position BERT's maximum length equal to the in-process engine's
macro-windows; the vLLM /v1/embeddings and /pooling routes and a batch job equal to gRPC;
plain embed beside it at once; refusals at each door."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from pooling_client import ChunkedEmbeddingOutput, LateChunking, PoolingClient
from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.models.loader import load_model
from pooling_server.engine.models.model_spec import ModelSpec
from pooling_server.engine.requests.outputs import LateChunks
from pooling_server.engine.requests.params import Task
from pooling_server.engine.requests.plans import plan_request
from pooling_server.engine.requests.request import LateChunking as EngineChunking
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.requests.validation import validate_request
from tests.conftest import DEFAULT_MODEL as MINILM_ID
from tests.fixture_models import tiny_mean_bert
from tests.rpc_errors import decode_rpc_error
from tests.service.http_calls import (
    HttpServer,
    batch_line,
    http_stub,
    run_batch,
    serve_models,
)

TEXT = "Berlin is the capital of Germany. It has 3.8 million people!  The Spree runs through it."
SPANS = [(0, 33), (34, 60), (62, 88), (7, 9), (3, 5)]
LONG = " ".join(f"word{i % 7} sentence number {i}." for i in range(40))
LONG_SPANS = [(0, len(LONG)), (300, 420), (len(LONG) - 30, len(LONG))]


@pytest.fixture(scope="module")
def short(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_mean_bert(tmp_path_factory.mktemp("served-late") / "short")


@pytest.fixture(scope="module")
def http(short: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    yield from serve_models(tmp_path_factory, "late", {"minilm": MINILM_ID, "short": short})


stub = http_stub


def spans_request(text: str, spans: list[tuple[int, int]], model: str = "minilm") -> pb.PoolRequest:
    chunking = pb.LateChunking(spans=[pb.TokenSpan(start=a, end=b) for a, b in spans])
    return pb.PoolRequest(model=model, embed=pb.TextInput(texts=[text]), late_chunking=chunking)


def chunk_vectors(text: pb.ChunkedText) -> np.ndarray:
    return np.array([list(chunk.embedding.values) for chunk in text.chunks], dtype=np.float32)


def token_embed_means(
    stub: pooling_pb2_grpc.PoolingServiceStub, text: str, spans: list[tuple[int, int]]
) -> np.ndarray:
    """The reference from the server's own token_embed: unnormalised rows, averaged over
    the tokens each span overlaps (special tokens out), then normalised."""
    request = pb.PoolRequest(
        model="minilm",
        token_embed=pb.TextInput(texts=[text]),
        params=pb.PoolingParams(use_activation=False),
    )
    (matrix,) = stub.Pool(request, timeout=60).token_embed.items
    rows = np.array(matrix.values, dtype=np.float32).reshape(matrix.rows, matrix.cols)
    out = []
    for start, end in spans:
        hits = [
            i
            for i, span in enumerate(matrix.offsets)
            if not matrix.special_tokens_mask[i] and span.end > start and span.start < end
        ]
        mean = rows[hits[0] : hits[-1] + 1].mean(axis=0)
        out.append(mean / np.linalg.norm(mean))
    return np.stack(out)


def test_grpc_spans_equal_token_embed(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    response = stub.Pool(spans_request(TEXT, SPANS), timeout=60)
    assert not response.embed.embeddings
    (text,) = response.embed.chunked
    assert [(c.span.start, c.span.end) for c in text.chunks] == SPANS
    want = token_embed_means(stub, TEXT, SPANS)
    np.testing.assert_allclose(chunk_vectors(text), want, atol=1e-5)


def test_client_rules_and_plain_embed_at_once(
    http: HttpServer, stub: pooling_pb2_grpc.PoolingServiceStub
) -> None:
    sentences = LateChunking(rule="sentences")
    tokens = LateChunking(rule="tokens", window=6, overlap=2)
    with (
        PoolingClient(http.process.address, model="minilm") as client,
        ThreadPoolExecutor(4) as pool,
    ):
        plain = [pool.submit(client.embed, [TEXT, "hello"]) for _ in range(3)]
        late = client.embed([TEXT, "One. Two!"], late_chunking=sentences)
        windows = client.embed([TEXT], late_chunking=tokens)
        plain_outputs = [f.result() for f in plain]
    first = late[0].outputs
    assert isinstance(first, ChunkedEmbeddingOutput)
    assert first.spans == [(0, 33), (34, 60), (62, 88)]
    assert late[1].outputs.spans == [(0, 4), (5, 9)]  # type: ignore[union-attr]
    np.testing.assert_allclose(first.numpy(), token_embed_means(stub, TEXT, first.spans), atol=1e-5)
    chunked = windows[0].outputs
    assert isinstance(chunked, ChunkedEmbeddingOutput) and len(chunked.spans) > 3
    np.testing.assert_allclose(
        chunked.numpy(), token_embed_means(stub, TEXT, chunked.spans), atol=1e-5
    )
    reference = plain_outputs[0]
    for outputs in plain_outputs[1:]:
        for got, want in zip(outputs, reference, strict=True):
            np.testing.assert_allclose(got.outputs.embedding, want.outputs.embedding, atol=1e-5)


def test_macro_windows_equal_the_engine(
    short: Path, stub: pooling_pb2_grpc.PoolingServiceStub
) -> None:
    response = stub.Pool(spans_request(LONG, LONG_SPANS, "short"), timeout=60)
    got = chunk_vectors(response.embed.chunked[0])
    model = load_model(
        ModelSpec(str(short), name="short"), device=torch.device("cpu"), dtype=torch.float32
    )
    request = PoolRequest(
        Task.EMBED, texts=(LONG,), late_chunking=EngineChunking(spans=tuple(LONG_SPANS))
    )
    plan = plan_request(validate_request(request, model.info, Limits()), model)
    assert len(plan.work) > 2  # several macro-windows
    raws = model.runner.forward([s for s, _ in plan.work], [k for _, k in plan.work])
    (chunks,) = plan.finish(raws)
    assert isinstance(chunks, LateChunks)
    np.testing.assert_allclose(got, np.stack([e.values for e in chunks.embeddings]), atol=1e-5)


def test_http_routes_equal_grpc(
    http: HttpServer, stub: pooling_pb2_grpc.PoolingServiceStub
) -> None:
    want = chunk_vectors(stub.Pool(spans_request(TEXT, SPANS), timeout=60).embed.chunked[0])
    body = {"model": "minilm", "input": TEXT, "late_chunking": {"spans": SPANS}}
    status, _, answer = http.call("/v1/embeddings", body)
    assert status == 200, answer
    (item,) = answer["data"]
    assert [tuple(c["span"]) for c in item["chunks"]] == SPANS
    np.testing.assert_allclose([c["embedding"] for c in item["chunks"]], want, atol=1e-5)
    status, _, answer = http.call("/pooling", {**body, "task": "embed"})
    assert status == 200, answer
    np.testing.assert_allclose([c["data"] for c in answer["data"][0]["chunks"]], want, atol=1e-5)


def test_batch_job(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    want = chunk_vectors(stub.Pool(spans_request(TEXT, SPANS), timeout=60).embed.chunked[0])
    body = {"model": "m", "input": [TEXT], "late_chunking": {"spans": SPANS}}
    line = batch_line("c", "/v1/embeddings", body)
    answers = run_batch(["--model", f"m={MINILM_ID}", "--dtype", "float32"], [line])
    chunks = answers["c"]["body"]["data"][0]["chunks"]
    np.testing.assert_allclose([c["embedding"] for c in chunks], want, atol=1e-5)


def test_refusals(http: HttpServer, stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Pool(spans_request(TEXT, [(0, 5), (80, 200)]), timeout=60)
    error = decode_rpc_error(caught.value)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == "SPAN_OUT_OF_TEXT" and error.fields == ["late_chunking.spans[1]"]
    with pytest.raises(grpc.RpcError) as caught:
        stub.Pool(spans_request(TEXT, [(33, 34)]), timeout=60)
    assert decode_rpc_error(caught.value).reason == "LATE_CHUNK_NO_TOKENS"
    for body, reason in (
        ({"late_chunking": {"spans": [[4, 4]]}}, "SPAN_EMPTY"),
        ({"late_chunking": {"rule": "paragraphs"}}, "CHUNK_RULE_UNKNOWN"),
        ({"late_chunking": {"rule": "tokens", "window": 4, "overlap": 9}}, "LATE_CHUNKING_OVERLAP"),
        ({"late_chunking": {"spans": [[0, 4]]}, "task": "token_embed"}, "LATE_CHUNKING_TASK"),
        ({"late_chunking": [1, 2]}, "INVALID_BODY"),
    ):
        status, _, answer = http.call("/pooling", {"model": "minilm", "input": TEXT, **body})
        want = 422 if reason == "INVALID_BODY" else 400  # the body's shape, then its values
        assert status == want and answer["error"]["code"] == reason, answer
