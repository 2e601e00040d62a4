"""A bge-m3 multi-output model (a tiny random-weight XLM-R in bge-m3's layout) through one
real server: gRPC Pool embed_outputs (any subset, compact encodings), score with
output_weights and Rerank, ListModels' outputs, PoolStream; vLLM's /pooling (task
embed_outputs), /score and /rerank with output_weights; TEI's /embed_sparse (the lexical
weights); a batch job; each against the model card's formulas on transformers' output;
the refusals of each door."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.requests.params import OutputWeights
from tests.bge_m3_reference import Reference, expected_score
from tests.conftest import DEFAULT_MODEL as MINILM_ID
from tests.fixture_models import BGE_M3_COLBERT_DIM, tiny_bge_m3
from tests.rpc_errors import decode_rpc_error
from tests.service.http_calls import (
    HttpServer,
    batch_line,
    http_stub,
    run_batch,
    serve_models,
)

ATOL = 1e-4
QUERY = "what is the capital of france?"
DOCUMENTS = ["Paris is the capital of France, the capital.", "b", "zebra crossings " * 5]
WEIGHTS = OutputWeights(0.4, 0.2, 0.4)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_bge_m3(tmp_path_factory.mktemp("served-bge-m3") / "bge-m3")


@pytest.fixture(scope="module")
def http(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    yield from serve_models(tmp_path_factory, "bge-m3", {"m3": folder, "minilm": MINILM_ID})


stub = http_stub


@pytest.fixture(scope="module")
def reference(folder: Path) -> Reference:
    return Reference(folder)


def expected_scores(reference: Reference, weights: OutputWeights | None) -> list[float]:
    query, *documents = reference.encode([QUERY, *DOCUMENTS])
    return [expected_score(query, document, weights) for document in documents]


def matrix(item: pb.MultiVectorMatrix) -> np.ndarray:
    dtype = {pb.EMBEDDING_ENCODING_FLOAT32: "<f4", pb.EMBEDDING_ENCODING_FLOAT16: "<f2"}
    return np.frombuffer(item.data, dtype=dtype[item.encoding]).reshape(item.rows, item.cols)


def dense_of(embedding: pb.Embedding) -> np.ndarray:
    if embedding.encoding == pb.EMBEDDING_ENCODING_FLOAT16:
        return np.frombuffer(embedding.data, dtype="<f2").astype(np.float32)
    return np.array(embedding.values)


def check_sparse(indices: list[int], values: list[float], expected: dict[int, float]) -> None:
    assert sorted(indices) == sorted(expected)
    for index, value in zip(indices, values, strict=True):
        assert value == pytest.approx(expected[index], abs=ATOL)


def test_list_models_shows_the_outputs(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    cards = {card.name: card for card in stub.ListModels(pb.ListModelsRequest()).models}
    card = cards["m3"]
    assert list(card.outputs) == ["dense", "sparse", "multi"]
    assert list(card.tasks) == [
        pb.POOLING_TASK_EMBED,
        pb.POOLING_TASK_EMBED_SPARSE,
        pb.POOLING_TASK_EMBED_MULTI,
        pb.POOLING_TASK_EMBED_OUTPUTS,
        pb.POOLING_TASK_SCORE,
    ]
    assert card.backend == "torch" and not cards["minilm"].outputs


@pytest.mark.parametrize(
    "encoding", [pb.EMBEDDING_ENCODING_UNSPECIFIED, pb.EMBEDDING_ENCODING_FLOAT16]
)
def test_grpc_embed_outputs(
    stub: pooling_pb2_grpc.PoolingServiceStub, reference: Reference, encoding: int
) -> None:
    tolerance = ATOL if encoding == pb.EMBEDDING_ENCODING_UNSPECIFIED else 2e-3
    request = pb.PoolRequest(
        model="m3",
        embed_outputs=pb.OutputsInput(texts=DOCUMENTS, dense=True, sparse=True, multi=True),
        encoding=encoding,  # type: ignore[arg-type]
    )
    response = stub.Pool(request, timeout=60)
    assert response.WhichOneof("output") == "embed_outputs"
    items = response.embed_outputs.items
    for item, want in zip(items, reference.encode(DOCUMENTS), strict=True):
        np.testing.assert_allclose(dense_of(item.dense), want["dense"], atol=tolerance)
        check_sparse(list(item.sparse.indices), list(item.sparse.values), want["sparse"])  # type: ignore[arg-type]
        assert item.multi.cols == BGE_M3_COLBERT_DIM
        np.testing.assert_allclose(matrix(item.multi), want["multi"], atol=tolerance)


def test_grpc_embed_outputs_sets_only_what_was_asked(
    stub: pooling_pb2_grpc.PoolingServiceStub, reference: Reference
) -> None:
    asked = pb.OutputsInput(texts=DOCUMENTS[:1], sparse=True, sparse_top_k=2, return_tokens=True)
    (item,) = stub.Pool(
        pb.PoolRequest(model="m3", embed_outputs=asked), timeout=60
    ).embed_outputs.items
    assert item.HasField("sparse") and not item.HasField("dense") and not item.HasField("multi")
    assert len(item.sparse.indices) == 2 and len(item.sparse.tokens) == 2
    want = reference.encode(DOCUMENTS[:1])[0]["sparse"]
    best = sorted(want.items(), key=lambda kv: -kv[1])[:2]  # type: ignore[union-attr]
    assert list(item.sparse.indices) == [index for index, _ in best]


def test_grpc_score_and_rerank(
    stub: pooling_pb2_grpc.PoolingServiceStub, reference: Reference
) -> None:
    for weights in (None, WEIGHTS):
        params = pb.PoolingParams()
        if weights is not None:
            params.output_weights.CopyFrom(pb.OutputWeights(dense=0.4, sparse=0.2, multi=0.4))
        want = expected_scores(reference, weights)
        score = pb.PoolRequest(
            model="m3", score=pb.ScoreInput(text_1=[QUERY], text_2=DOCUMENTS), params=params
        )
        np.testing.assert_allclose(stub.Pool(score, timeout=60).score.scores, want, atol=ATOL)
        ranked = stub.Rerank(
            pb.RerankRequest(model="m3", query=QUERY, documents=DOCUMENTS, params=params),
            timeout=60,
        )
        got = {r.index: r.relevance_score for r in ranked.results}
        np.testing.assert_allclose([got[i] for i in range(len(DOCUMENTS))], want, atol=ATOL)


def test_pool_stream_carries_embed_outputs(
    stub: pooling_pb2_grpc.PoolingServiceStub, reference: Reference
) -> None:
    messages = [
        pb.PoolStreamRequest(
            request=pb.PoolRequest(
                request_id=f"r{i}",
                model="m3",
                embed_outputs=pb.OutputsInput(texts=[text], dense=True, multi=True),
            )
        )
        for i, text in enumerate(DOCUMENTS)
    ]
    answers = {a.response.request_id: a.response for a in stub.PoolStream(iter(messages))}
    for i, want in enumerate(reference.encode(DOCUMENTS)):
        (item,) = answers[f"r{i}"].embed_outputs.items
        np.testing.assert_allclose(matrix(item.multi), want["multi"], atol=ATOL)
        np.testing.assert_allclose(dense_of(item.dense), want["dense"], atol=ATOL)


def test_http_pooling_score_and_rerank(http: HttpServer, reference: Reference) -> None:
    body = {"model": "m3", "task": "embed_outputs", "input": DOCUMENTS}
    status, _, answer = http.call("/pooling", {**body, "outputs": ["dense", "sparse", "multi"]})
    assert status == 200, answer
    for item, want in zip(answer["data"], reference.encode(DOCUMENTS), strict=True):
        np.testing.assert_allclose(item["dense"], want["dense"], atol=ATOL)
        check_sparse(item["sparse"]["indices"], item["sparse"]["values"], want["sparse"])  # type: ignore[arg-type]
        np.testing.assert_allclose(np.array(item["multi"]), want["multi"], atol=ATOL)
    status, _, answer = http.call(
        "/pooling", {**body, "outputs": ["multi"], "encoding_format": "base64"}
    )
    assert status == 200 and set(answer["data"][0]) >= {"multi", "multi_shape"}, answer
    assert "dense" not in answer["data"][0]
    weights = {"dense": 0.4, "sparse": 0.2, "multi": 0.4}
    want = expected_scores(reference, WEIGHTS)
    status, _, answer = http.call(
        "/score", {"model": "m3", "text_1": QUERY, "text_2": DOCUMENTS, "output_weights": weights}
    )
    assert status == 200, answer
    np.testing.assert_allclose([d["score"] for d in answer["data"]], want, atol=ATOL)
    for path in ("/rerank", "/v1/rerank"):
        status, _, answer = http.call(
            path, {"model": "m3", "query": QUERY, "documents": DOCUMENTS, "output_weights": weights}
        )
        assert status == 200, answer
        got = {r["index"]: r["relevance_score"] for r in answer["results"]}
        np.testing.assert_allclose([got[i] for i in range(len(DOCUMENTS))], want, atol=ATOL)


def test_tei_embed_sparse_gives_the_lexical_weights(http: HttpServer, reference: Reference) -> None:
    status, _, answer = http.call("/embed_sparse", {"model": "m3", "inputs": DOCUMENTS})
    assert status == 200, answer
    for got, want in zip(answer, reference.encode(DOCUMENTS), strict=True):
        check_sparse([e["index"] for e in got], [e["value"] for e in got], want["sparse"])  # type: ignore[arg-type]
    status, _, answer = http.call("/embed_all", {"model": "m3", "inputs": DOCUMENTS[:1]})
    assert status == 200, answer  # its ColBERT matrix (bge-m3 has no query/document modes)
    np.testing.assert_allclose(
        np.array(answer[0]), reference.encode(DOCUMENTS[:1])[0]["multi"], atol=ATOL
    )


def test_refusals(stub: pooling_pb2_grpc.PoolingServiceStub, http: HttpServer) -> None:
    none_asked = pb.PoolRequest(model="m3", embed_outputs=pb.OutputsInput(texts=["a"]))
    on_minilm = pb.PoolRequest(
        model="minilm", embed_outputs=pb.OutputsInput(texts=["a"], dense=True)
    )
    weighted = pb.PoolRequest(
        model="minilm",
        score=pb.ScoreInput(text_1=["a"], text_2=["b"]),
        params=pb.PoolingParams(output_weights=pb.OutputWeights(dense=1)),
    )
    zero = pb.PoolRequest(
        model="m3",
        score=pb.ScoreInput(text_1=["a"], text_2=["b"]),
        params=pb.PoolingParams(output_weights=pb.OutputWeights()),
    )
    cases = [
        (none_asked, grpc.StatusCode.INVALID_ARGUMENT, "OUTPUTS_NONE"),
        (on_minilm, grpc.StatusCode.FAILED_PRECONDITION, "TASK_NOT_SUPPORTED"),
        (weighted, grpc.StatusCode.FAILED_PRECONDITION, "OUTPUT_WEIGHTS_NOT_SUPPORTED"),
        (zero, grpc.StatusCode.INVALID_ARGUMENT, "OUTPUT_WEIGHTS_INVALID"),
    ]
    for request, code, reason in cases:
        with pytest.raises(grpc.RpcError) as caught:
            stub.Pool(request, timeout=60)
        assert caught.value.code() is code
        assert decode_rpc_error(caught.value).reason == reason
    with pytest.raises(grpc.RpcError) as caught:
        stub.Rerank(
            pb.RerankRequest(
                model="m3",
                query="a",
                documents=["b"],
                params=pb.PoolingParams(output_weights=pb.OutputWeights(dense=-1, sparse=1)),
            ),
            timeout=60,
        )
    assert decode_rpc_error(caught.value).reason == "OUTPUT_WEIGHTS_INVALID"
    body = {"model": "m3", "task": "embed_outputs", "input": ["a"]}
    status, _, answer = http.call("/pooling", {**body, "outputs": ["dense", "lexical"]})
    assert status == 400 and answer["error"]["reason"] == "OUTPUT_UNKNOWN", answer
    status, _, answer = http.call("/pooling", body)
    assert status == 400 and answer["error"]["reason"] == "OUTPUTS_NONE", answer
    status, _, answer = http.call(
        "/score", {"model": "minilm", "text_1": "a", "text_2": "b", "output_weights": {"dense": 1}}
    )
    assert status >= 400 and "output_weights" in json.dumps(answer), answer
    status, _, answer = http.call(
        "/score", {"model": "m3", "text_1": "a", "text_2": "b", "output_weights": {"lexical": 1}}
    )
    assert status == 422 and "output_weights" in json.dumps(answer), answer


def test_batch_job_follows_the_http_bodies(folder: Path, reference: Reference) -> None:
    pooling = {"model": "m", "task": "embed_outputs", "input": [QUERY], "outputs": ["sparse"]}
    weights = {"dense": 0.4, "sparse": 0.2, "multi": 0.4}
    rerank = {"model": "m", "query": QUERY, "documents": DOCUMENTS, "output_weights": weights}
    lines = [batch_line("p", "/pooling", pooling), batch_line("r", "/v1/rerank", rerank)]
    answers = run_batch(["--model", f"m={folder}", "--dtype", "float32"], lines)
    sparse = answers["p"]["body"]["data"][0]["sparse"]
    check_sparse(sparse["indices"], sparse["values"], reference.encode([QUERY])[0]["sparse"])  # type: ignore[arg-type]
    got = {r["index"]: r["relevance_score"] for r in answers["r"]["body"]["results"]}
    want = expected_scores(reference, WEIGHTS)
    np.testing.assert_allclose([got[i] for i in range(len(DOCUMENTS))], want, atol=ATOL)


def test_python_client_embed_outputs_and_weighted_rerank(
    http: HttpServer, reference: Reference
) -> None:
    """The Python client: per text dense (list), sparse (weights) and multi (a numpy
    matrix), float16 on the wire too; rerank and score with OutputWeights; the model's
    outputs in models()."""
    from pooling_client import OutputWeights as ClientWeights
    from pooling_client import PoolingClient, PoolingParams

    want = reference.encode(DOCUMENTS)
    with PoolingClient(http.process.address, timeout=60) as client:
        got = client.embed_outputs(DOCUMENTS, model="m3")
        half = client.embed_outputs(DOCUMENTS, model="m3", dense=False, encoding="float16")
        sparse = client.embed_outputs(
            DOCUMENTS[:1], model="m3", dense=False, multi=False, sparse_top_k=2
        )
        params = PoolingParams(output_weights=ClientWeights(0.4, 0.2, 0.4))
        ranked = client.rerank(QUERY, DOCUMENTS, model="m3", pooling_params=params)
        scored = client.score(QUERY, DOCUMENTS, model="m3", pooling_params=params)
        cards = {m.name: m for m in client.models()}
    assert cards["m3"].outputs == ["dense", "sparse", "multi"] and cards["minilm"].outputs == []
    for out, full, w in zip(got, half, want, strict=True):
        assert isinstance(out.outputs.multi, np.ndarray)
        np.testing.assert_allclose(out.outputs.dense, w["dense"], atol=ATOL)
        assert out.outputs.sparse is not None
        assert out.outputs.sparse.to_dict() == pytest.approx(w["sparse"], abs=ATOL)
        np.testing.assert_allclose(out.outputs.multi, w["multi"], atol=ATOL)
        assert full.outputs.dense is None and full.outputs.sparse is not None
        np.testing.assert_allclose(full.outputs.multi, w["multi"], atol=2e-3)
    only = sparse[0].outputs
    assert only.dense is None and only.multi is None and len(only.sparse.indices) == 2  # type: ignore[union-attr]
    expected = expected_scores(reference, WEIGHTS)
    got_ranked = {r.index: r.relevance_score for r in ranked.results}
    np.testing.assert_allclose([got_ranked[i] for i in range(len(DOCUMENTS))], expected, atol=ATOL)
    np.testing.assert_allclose([s.outputs.score for s in scored], expected, atol=ATOL)
    with pytest.raises(ValueError, match="at least one output"):
        PoolingClient(http.process.address).embed_outputs(
            ["a"], dense=False, sparse=False, multi=False
        )
    with pytest.raises(ValueError, match="output_weights"):
        PoolingParams(output_weights=ClientWeights(0, 0, 0)).verify("score")
    with pytest.raises(ValueError, match="output_weights"):
        PoolingParams(output_weights=ClientWeights(1, 0, 0)).verify("embed")
