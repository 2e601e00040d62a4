"""A ColBERT model (a tiny random-weight BERT in PyLate's layout) through a real server:
gRPC Pool embed_multi (both modes, compact encodings), score and Rerank by MaxSim,
ListModels' mode settings, the Python client's numpy matrices, vLLM's /pooling, /score
and /rerank routes, and a batch job, each against sentence-transformers'
MultiVectorEncoder; embed_multi beside ordinary embed requests on another model at once;
the refusals of each door."""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import numpy as np
import pytest
from sentence_transformers import MultiVectorEncoder, SentenceTransformer

from pooling_client import PoolingClient
from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.conftest import DEFAULT_MODEL as MINILM_ID
from tests.fixture_models import COLBERT_DIM, MINILM, tiny_colbert
from tests.responses import in_document_order
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
DOCUMENTS = [
    "Paris is the capital of France.",
    "b!",
    "The sky is blue because of Rayleigh scattering, mostly. " * 4,
]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tiny_colbert(tmp_path_factory.mktemp("served-colbert") / "colbert")


@pytest.fixture(scope="module")
def http(folder: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HttpServer]:
    yield from serve_models(tmp_path_factory, "colbert", {"colbert": folder, "minilm": MINILM_ID})


stub = http_stub


@pytest.fixture(scope="module")
def reference(folder: Path) -> MultiVectorEncoder:
    return MultiVectorEncoder(str(folder), device="cpu")


@pytest.fixture(scope="module")
def expected(reference: MultiVectorEncoder) -> np.ndarray:
    q = reference.encode_query([QUERY], convert_to_numpy=True)
    d = reference.encode_document(DOCUMENTS, convert_to_numpy=True)
    return reference.similarity(q, d).numpy()[0]


def by_index(results: list[tuple[int, float]]) -> np.ndarray:
    return in_document_order(results, len(DOCUMENTS))


def matrix(item: pb.MultiVectorMatrix) -> np.ndarray:
    dtype = {pb.EMBEDDING_ENCODING_FLOAT32: "<f4", pb.EMBEDDING_ENCODING_FLOAT16: "<f2"}
    return np.frombuffer(item.data, dtype=dtype[item.encoding]).reshape(item.rows, item.cols)


def test_list_models_shows_the_modes(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    cards = {card.name: card for card in stub.ListModels(pb.ListModelsRequest()).models}
    card = cards["colbert"]
    assert list(card.tasks) == [pb.POOLING_TASK_EMBED_MULTI, pb.POOLING_TASK_SCORE]
    assert card.hidden_size == COLBERT_DIM
    settings = card.multi_vector
    assert (settings.query_prefix, settings.document_prefix) == ("[Q] ", "[D] ")
    assert (settings.query_length, settings.document_length) == (12, 20)
    assert settings.query_expansion and not settings.attend_to_expansion_tokens
    assert list(settings.skiplist_words) == list("!,.?;:")
    assert not cards["minilm"].HasField("multi_vector")


@pytest.mark.parametrize(
    "encoding", [pb.EMBEDDING_ENCODING_UNSPECIFIED, pb.EMBEDDING_ENCODING_FLOAT16]
)
def test_grpc_embed_multi_in_both_modes(
    stub: pooling_pb2_grpc.PoolingServiceStub, reference: MultiVectorEncoder, encoding: int
) -> None:
    tolerance = ATOL if encoding == pb.EMBEDDING_ENCODING_UNSPECIFIED else 2e-3
    for mode, texts, want in (
        ("query", [QUERY], reference.encode_query([QUERY], convert_to_numpy=True)),
        ("document", DOCUMENTS, reference.encode_document(DOCUMENTS, convert_to_numpy=True)),
    ):
        request = pb.PoolRequest(
            model="colbert",
            embed_multi=pb.TextInput(texts=texts),
            prompt_name=mode,
            encoding=encoding,  # type: ignore[arg-type]
        )
        items = stub.Pool(request, timeout=60).embed_multi.items
        for item, rows in zip(items, want, strict=True):
            np.testing.assert_allclose(matrix(item), np.asarray(rows), atol=tolerance)


def test_grpc_score_and_rerank_are_maxsim(
    stub: pooling_pb2_grpc.PoolingServiceStub, expected: np.ndarray
) -> None:
    score = pb.PoolRequest(model="colbert", score=pb.ScoreInput(text_1=[QUERY], text_2=DOCUMENTS))
    np.testing.assert_allclose(stub.Pool(score, timeout=60).score.scores, expected, atol=ATOL)
    ranked = stub.Rerank(
        pb.RerankRequest(model="colbert", query=QUERY, documents=DOCUMENTS), timeout=60
    )
    got = by_index([(r.index, r.relevance_score) for r in ranked.results])
    np.testing.assert_allclose(got, expected, atol=ATOL)


def test_python_client_returns_numpy_matrices(
    http: HttpServer, reference: MultiVectorEncoder
) -> None:
    with PoolingClient(http.process.address, timeout=60) as client:
        got = client.encode(
            [QUERY, "a"], pooling_task="embed_multi", prompt_name="query", output="numpy"
        )
        info = {m.name: m for m in client.models()}["colbert"]
    want = reference.encode_query([QUERY, "a"], convert_to_numpy=True)
    assert [g.shape for g in got] == [(12, COLBERT_DIM)] * 2
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, np.asarray(w), atol=ATOL)
    assert info.multi_vector["query_length"] == 12
    assert info.multi_vector["document_prefix"] == "[D] "


def test_embed_multi_beside_embed_on_another_model(
    stub: pooling_pb2_grpc.PoolingServiceStub, reference: MultiVectorEncoder
) -> None:
    """Requests of both models in flight at once each get their own model's answer."""
    dense = SentenceTransformer(str(MINILM), device="cpu")
    texts = [f"text number {i}, of several." for i in range(6)]

    def multi(i: int) -> np.ndarray:
        request = pb.PoolRequest(
            model="colbert", embed_multi=pb.TextInput(texts=[texts[i]]), prompt_name="document"
        )
        return matrix(stub.Pool(request, timeout=60).embed_multi.items[0])

    def embed(i: int) -> np.ndarray:
        request = pb.PoolRequest(model="minilm", embed=pb.TextInput(texts=[texts[i]]))
        return np.array(stub.Pool(request, timeout=60).embed.embeddings[0].values)

    with ThreadPoolExecutor(8) as pool:
        multis = list(pool.map(multi, range(6)))
        embeds = list(pool.map(embed, range(6)))
    want_multi = reference.encode_document(texts, convert_to_numpy=True)
    want_embed = dense.encode(texts, convert_to_numpy=True)
    for got, want in zip(multis, want_multi, strict=True):
        np.testing.assert_allclose(got, np.asarray(want), atol=ATOL)
    np.testing.assert_allclose(np.stack(embeds), want_embed, atol=ATOL)


def test_http_routes(http: HttpServer, reference: MultiVectorEncoder, expected: np.ndarray) -> None:
    body = {"model": "colbert", "task": "embed_multi", "input": DOCUMENTS[:2]}
    status, _, answer = http.call("/pooling", {**body, "prompt_name": "document"})
    assert status == 200, answer
    want = reference.encode_document(DOCUMENTS[:2], convert_to_numpy=True)
    for item, rows in zip(answer["data"], want, strict=True):
        np.testing.assert_allclose(np.array(item["data"]), np.asarray(rows), atol=ATOL)
    status, _, answer = http.call("/pooling", {**body, "prompt_name": "query"})
    assert status == 200 and len(answer["data"][0]["data"]) == 12
    status, _, answer = http.call(
        "/score", {"model": "colbert", "text_1": QUERY, "text_2": DOCUMENTS}
    )
    assert status == 200, answer
    np.testing.assert_allclose([d["score"] for d in answer["data"]], expected, atol=ATOL)
    for path in ("/rerank", "/v1/rerank"):
        status, _, answer = http.call(
            path, {"model": "colbert", "query": QUERY, "documents": DOCUMENTS}
        )
        assert status == 200, answer
        got = by_index([(r["index"], r["relevance_score"]) for r in answer["results"]])
        np.testing.assert_allclose(got, expected, atol=ATOL)


def test_refusals(stub: pooling_pb2_grpc.PoolingServiceStub, http: HttpServer) -> None:
    cases = [
        (pb.PoolRequest(model="minilm", embed_multi=pb.TextInput(texts=["a"])), "minilm"),
        (pb.PoolRequest(model="colbert", embed=pb.TextInput(texts=["a"])), "embed_multi"),
    ]
    for request, named in cases:
        with pytest.raises(grpc.RpcError) as caught:
            stub.Pool(request, timeout=60)
        assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert decode_rpc_error(caught.value).reason == "TASK_NOT_SUPPORTED"
        assert named in caught.value.details()
    status, _, answer = http.call(
        "/pooling", {"model": "minilm", "task": "embed_multi", "input": ["a"]}
    )
    assert status >= 400 and "multi-vector" in json.dumps(answer)
    status, _, answer = http.call("/v1/embeddings", {"model": "colbert", "input": ["a"]})
    assert status >= 400 and "embed_multi" in json.dumps(answer)


def test_batch_job_pools_and_ranks(folder: Path, expected: np.ndarray) -> None:
    pooling = {"model": "c", "task": "embed_multi", "input": [QUERY], "prompt_name": "query"}
    rerank = {"model": "c", "query": QUERY, "documents": DOCUMENTS}
    lines = [batch_line("p", "/pooling", pooling), batch_line("r", "/v1/rerank", rerank)]
    answers = run_batch(["--model", f"c={folder}", "--dtype", "float32"], lines)
    assert np.array(answers["p"]["body"]["data"][0]["data"]).shape == (12, COLBERT_DIM)
    ranked = answers["r"]["body"]["results"]
    got = by_index([(r["index"], r["relevance_score"]) for r in ranked])
    np.testing.assert_allclose(got, expected, atol=ATOL)


def test_tei_and_cohere_doors(http: HttpServer, expected: np.ndarray) -> None:
    """TEI's /rerank ranks by MaxSim (colbert is the default model); TEI's and Cohere's
    single-vector embedding routes have no multi-vector form and refuse, naming embed_multi
    (Cohere's also /pooling)."""
    status, _, answer = http.call("/rerank", {"query": QUERY, "texts": DOCUMENTS})
    assert status == 200, answer
    np.testing.assert_allclose(
        by_index([(r["index"], r["score"]) for r in answer]), expected, atol=ATOL
    )
    status, _, answer = http.call("/embed", {"inputs": ["a"]})
    assert status >= 400 and "embed_multi" in json.dumps(answer), answer
    body = {"model": "colbert", "texts": ["a"], "input_type": "search_query"}
    status, _, answer = http.call("/v2/embed", body)
    assert status == 400, answer
    assert answer["reason"] == "TASK_NOT_SUPPORTED", answer
    assert "embed_multi" in answer["message"] and "POST /pooling" in answer["message"]
    status, _, answer = http.call("/v2/embed", {**body, "model": "minilm"})
    assert status == 200, answer  # a single-vector model beside it is served as ever


def test_tei_embed_all_gives_the_colbert_matrices(
    http: HttpServer, reference: MultiVectorEncoder
) -> None:
    """TEI's /embed_all on a multi-vector model: each text's ColBERT matrix (a row per kept
    token), in document mode unless prompt_name asks for the query mode; token states on a
    single-vector model, as before."""
    status, _, answer = http.call("/embed_all", {"inputs": DOCUMENTS})
    assert status == 200, answer
    want = reference.encode_document(DOCUMENTS, convert_to_numpy=True)
    assert len(answer) == len(DOCUMENTS)
    for got, rows in zip(answer, want, strict=True):
        np.testing.assert_allclose(np.array(got), np.asarray(rows), atol=ATOL)
    status, _, answer = http.call("/embed_all", {"inputs": QUERY, "prompt_name": "query"})
    assert status == 200, answer
    want = reference.encode_query([QUERY], convert_to_numpy=True)
    np.testing.assert_allclose(np.array(answer[0]), np.asarray(want[0]), atol=ATOL)
    status, _, answer = http.call("/embed_all", {"inputs": ["a b"], "model": "minilm"})
    assert status == 200 and np.array(answer[0]).shape[1] == 384, answer
    status, _, answer = http.call("/embed_all", {"inputs": ["a"], "prompt_name": "passage"})
    assert status == 422 and "prompt_name" in answer["error"], answer
