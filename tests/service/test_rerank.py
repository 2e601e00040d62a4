"""The Rerank RPC over the real server: rankings against scores computed in the test
(sentence-transformers CrossEncoder, cosine of sentence-transformers embeddings, and the
Score RPC), top_n, documents, usage, and every rule with its reason and field path."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from sentence_transformers import CrossEncoder, SentenceTransformer

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.conftest import DEFAULT_MODEL, MAX_CLIENT_BATCH_SIZE, Served
from tests.fixture_models import MINILM
from tests.metrics_endpoint import metric_sum, scrape
from tests.rpc_errors import DecodedError, decode_rpc_error
from tests.server_process import ServerProcess, free_port, running_server

ATOL = 5e-7  # the tiny cross-encoder's scores lie near 0.5, the closest two 1.2e-6 apart
INVALID = grpc.StatusCode.INVALID_ARGUMENT
QUERY = "how do cells make energy"
DOCUMENTS = [
    "Paris is the capital of France.",
    "The mitochondria is the powerhouse of the cell.",
    "",
    "cells make energy from glucose",
    "A completely unrelated sentence about cooking pasta al dente.",
    "Ünïcödé façade 東京 🙂",
    "Energy in cells comes from ATP, made in the mitochondria.",
    "?!...",
]
CROSS_ENCODER = "tiny-cross-encoder"
EMBEDDERS = ["tiny-st-mean", DEFAULT_MODEL]

Stub = pooling_pb2_grpc.PoolingServiceStub


def folder(served: dict[str, Served], name: str) -> str:
    path = served[name].folder
    return str(MINILM) if path == DEFAULT_MODEL else path


def reference_scores(served: dict[str, Served], model: str) -> np.ndarray:
    """Each document's score, computed here: a sentence-transformers CrossEncoder for the
    cross-encoder, the cosine of sentence-transformers embeddings for an embedder."""
    if model == CROSS_ENCODER:
        cross = CrossEncoder(folder(served, model), device="cpu")
        return cross.predict([(QUERY, d) for d in DOCUMENTS], convert_to_numpy=True)
    st = SentenceTransformer(folder(served, model), device="cpu")
    query, *documents = st.encode([QUERY, *DOCUMENTS], normalize_embeddings=True)
    return np.asarray(documents) @ query


def rerank(stub: Stub, model: str, **fields: object) -> pb.RerankResponse:
    fields.setdefault("query", QUERY)
    fields.setdefault("documents", DOCUMENTS)
    return stub.Rerank(pb.RerankRequest(model=model, **fields), timeout=60)


def check_ranking(results: list[pb.RerankResult], expected: np.ndarray, count: int) -> None:
    """`count` results, sorted by their scores (ties in document order), each score the
    document's expected score, and no document left out that ranks above one kept."""
    assert len(results) == count
    keys = [(-r.relevance_score, r.index) for r in results]
    assert keys == sorted(keys)
    got = np.array([r.relevance_score for r in results])
    np.testing.assert_allclose(got, expected[[r.index for r in results]], rtol=0, atol=ATOL)
    left_out = set(range(len(expected))) - {r.index for r in results}
    if left_out:
        assert max(expected[i] for i in left_out) <= got.min() + ATOL


@pytest.fixture(scope="module", params=[CROSS_ENCODER, *EMBEDDERS])
def ranked(request: pytest.FixtureRequest, served: dict[str, Served]) -> tuple[str, np.ndarray]:
    return request.param, reference_scores(served, request.param)


@pytest.mark.parametrize("top_n", [0, 1, 3, len(DOCUMENTS), len(DOCUMENTS) + 5])
def test_ranking_and_top_n_against_scores_computed_here(
    stub: Stub, ranked: tuple[str, np.ndarray], top_n: int
) -> None:
    model, expected = ranked
    response = rerank(stub, model, top_n=top_n, request_id=f"rank-{top_n}")
    assert (response.request_id, response.model) == (f"rank-{top_n}", model)
    count = min(top_n, len(DOCUMENTS)) if top_n else len(DOCUMENTS)
    check_ranking(list(response.results), expected, count)
    assert not any(r.HasField("document") for r in response.results)


@pytest.mark.parametrize("model", [CROSS_ENCODER, *EMBEDDERS])
def test_same_scores_and_usage_as_the_score_rpc(stub: Stub, model: str) -> None:
    response = rerank(stub, model)
    scored = stub.Pool(
        pb.PoolRequest(model=model, score=pb.ScoreInput(text_1=[QUERY], text_2=DOCUMENTS)),
        timeout=60,
    )
    check_ranking(list(response.results), np.array(scored.score.scores), len(DOCUMENTS))
    assert response.usage.prompt_tokens == scored.usage.prompt_tokens > 0
    assert response.usage.total_tokens == response.usage.prompt_tokens


@pytest.mark.parametrize("model", [CROSS_ENCODER, "tiny-st-mean"])
def test_return_documents(stub: Stub, model: str) -> None:
    response = rerank(stub, model, return_documents=True, top_n=4)
    assert [r.document for r in response.results] == [DOCUMENTS[r.index] for r in response.results]
    assert all(r.HasField("document") for r in response.results)  # "" included


def test_params_apply_as_for_score(stub: Stub) -> None:
    """use_activation=False gives the cross-encoder's raw logits; truncation is accepted."""
    logits = rerank(stub, CROSS_ENCODER, params=pb.PoolingParams(use_activation=False))
    probs = rerank(stub, CROSS_ENCODER, params=pb.PoolingParams(truncate_prompt_tokens=-1))
    by_index = {r.index: r.relevance_score for r in probs.results}
    assert len(logits.results) == len(by_index) == len(DOCUMENTS)
    for r in logits.results:
        assert by_index[r.index] == pytest.approx(1 / (1 + np.exp(-r.relevance_score)), abs=2e-7)


def test_the_default_model_when_none_is_named(stub: Stub) -> None:
    response = rerank(stub, "", documents=["a", "b"])
    assert response.model == DEFAULT_MODEL and len(response.results) == 2


def test_trailers_carry_the_prompt_tokens(stub: Stub) -> None:
    response, call = stub.Rerank.with_call(
        pb.RerankRequest(model=CROSS_ENCODER, query=QUERY, documents=DOCUMENTS), timeout=60
    )
    trailers = dict(call.trailing_metadata())
    assert int(trailers["x-prompt-tokens"]) == response.usage.prompt_tokens
    assert float(trailers["x-total-time-ms"]) > 0


def test_a_deadline_shorter_than_the_work(stub: Stub) -> None:
    documents = ["hello " * 120] * MAX_CLIENT_BATCH_SIZE
    with pytest.raises(grpc.RpcError) as caught:
        stub.Rerank(pb.RerankRequest(query=QUERY, documents=documents), timeout=0.005)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED  # type: ignore[attr-defined]
    assert len(rerank(stub, CROSS_ENCODER).results) == len(DOCUMENTS)


# ---------------------------------------------------------------------------------------------
# Rules: the same as Pool's, with paths named as RerankRequest names its fields
# ---------------------------------------------------------------------------------------------


def expect(
    stub: Stub, request: pb.RerankRequest, code: grpc.StatusCode, reason: str, field: str
) -> DecodedError:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Rerank(request, timeout=30)
    error = decode_rpc_error(caught.value)
    assert error.info is not None and error.info.domain == "pooling.v1"
    assert (error.code, error.reason) == (code, reason), error.message
    assert field in error.fields, error.fields
    assert "score." not in error.message
    return error


def request(model: str = CROSS_ENCODER, **fields: object) -> pb.RerankRequest:
    fields.setdefault("query", QUERY)
    fields.setdefault("documents", ["a document"])
    return pb.RerankRequest(model=model, **fields)


def test_empty_documents(stub: Stub) -> None:
    expect(stub, request(documents=[]), INVALID, "EMPTY_INPUT", "documents")


def test_too_many_documents(stub: Stub) -> None:
    many = request(documents=["d"] * (MAX_CLIENT_BATCH_SIZE + 1))
    error = expect(stub, many, INVALID, "TOO_MANY_INPUTS", "documents")
    assert str(MAX_CLIENT_BATCH_SIZE) in error.description("documents")


def test_negative_top_n(stub: Stub) -> None:
    expect(stub, request(top_n=-1), INVALID, "TOP_N_INVALID", "top_n")


def test_texts_over_the_character_bound(stub: Stub) -> None:
    long = "x" * (64 * 128 + 1)  # the tiny models' bound: 64 characters per token, 128 tokens
    expect(stub, request(query=long), INVALID, "INPUT_TOO_LONG", "query")
    error = expect(stub, request(documents=["ok", long]), INVALID, "INPUT_TOO_LONG", "documents[1]")
    assert error.fields == ["documents[1]"]


def test_pairs_over_the_token_limit(stub: Stub) -> None:
    """A cross-encoder sees query and document together: the document's pair is too long."""
    documents = ["short", "hello " * 100]  # with the query: over 128 tokens
    error = expect(
        stub,
        request(query="hello " * 40, documents=documents),
        INVALID,
        "INPUT_TOO_LONG",
        "documents[1]",
    )
    assert error.fields == ["documents[1]"]
    assert "128" in error.description("documents[1]")


def test_a_query_over_the_token_limit_on_an_embedder(stub: Stub) -> None:
    long_query = request("tiny-st-mean", query="hello " * 200)
    error = expect(stub, long_query, INVALID, "INPUT_TOO_LONG", "query")
    assert error.fields == ["query"]


def test_truncation_lets_long_pairs_through(stub: Stub) -> None:
    documents = ["short", "hello " * 200]
    params = pb.PoolingParams(truncate_prompt_tokens=-1)
    response = stub.Rerank(request(documents=documents, params=params), timeout=60)
    assert len(response.results) == 2


def test_unknown_model(stub: Stub) -> None:
    error = expect(
        stub, request("no-such-model"), grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND", "model"
    )
    assert DEFAULT_MODEL in error.message


@pytest.mark.parametrize("model", ["tiny-classifier", "tiny-ner"])
def test_a_model_without_score(stub: Stub, model: str) -> None:
    error = expect(
        stub,
        request(model),
        grpc.StatusCode.FAILED_PRECONDITION,
        "TASK_NOT_SUPPORTED",
        "model",
    )
    assert "score" in error.description("model")


@pytest.mark.parametrize("model", [CROSS_ENCODER, "minilm-matryoshka"])
def test_dimensions_are_refused(stub: Stub, model: str) -> None:
    dims = request(model, params=pb.PoolingParams(dimensions=8))
    error = expect(stub, dims, INVALID, "PARAM_NOT_SUPPORTED_FOR_TASK", "params.dimensions")
    assert "use_activation" in error.description("params.dimensions")


def test_truncate_prompt_tokens_out_of_range(stub: Stub) -> None:
    bad = request(params=pb.PoolingParams(truncate_prompt_tokens=0))
    expect(stub, bad, INVALID, "TRUNCATE_PROMPT_TOKENS_INVALID", "params.truncate_prompt_tokens")


def test_a_declared_task_other_than_score(stub: Stub) -> None:
    embed = request(params=pb.PoolingParams(task=pb.POOLING_TASK_EMBED))
    expect(stub, embed, INVALID, "TASK_MISMATCH", "params.task")
    score = request(params=pb.PoolingParams(task=pb.POOLING_TASK_SCORE))
    assert len(stub.Rerank(score, timeout=30).results) == 1


def test_request_id_bound(stub: Stub) -> None:
    expect(stub, request(request_id="r" * 257), INVALID, "REQUEST_ID_TOO_LONG", "request_id")


def test_several_violations_are_reported_together(stub: Stub) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Rerank(request(documents=[], top_n=-3), timeout=30)
    assert set(decode_rpc_error(caught.value).fields) == {"documents", "top_n"}


# ---------------------------------------------------------------------------------------------
# Metrics and the request log count a rerank under rpc="Rerank"
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def observed(
    model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[ServerProcess, int]]:
    metrics_port = free_port()
    args = ["--model", f"{CROSS_ENCODER}={model_folders[CROSS_ENCODER]}", "--dtype", "float32"]
    args += ["--metrics-port", str(metrics_port), "--log-format", "json"]
    args += ["--log-requests", "--log-inputs"]
    for process in running_server(args, tmp_path_factory.mktemp("rerank-logs"), "rerank"):
        yield process, metrics_port


def test_metrics_and_request_log(observed: tuple[ServerProcess, int]) -> None:
    server, metrics_port = observed
    with grpc.insecure_channel(server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        response = rerank(stub, "", request_id="logged", top_n=2)
        expect(
            stub, request(documents=[], request_id="refused"), INVALID, "EMPTY_INPUT", "documents"
        )
    samples = scrape(metrics_port)
    ok = {"rpc": "Rerank", "task": "score", "model": CROSS_ENCODER, "code": "OK"}
    assert metric_sum(samples, "pooling_requests_total", **ok) == 1
    refused = {**ok, "code": "INVALID_ARGUMENT"}
    assert metric_sum(samples, "pooling_requests_total", **refused) == 1
    assert metric_sum(samples, "pooling_requests_total", rpc="Pool") == 0
    tokens = metric_sum(samples, "pooling_prompt_tokens_total", model=CROSS_ENCODER, task="score")
    assert tokens == response.usage.prompt_tokens
    [line] = server.request_log("logged")
    assert (line["rpc"], line["task"], line["code"]) == ("Rerank", "score", "OK")
    assert line["items"] == len(DOCUMENTS)
    assert line["prompt_tokens"] == response.usage.prompt_tokens
    assert (line["query"], line["documents"]) == (QUERY, DOCUMENTS)
    [failed] = server.request_log("refused")
    assert (failed["rpc"], failed["code"], failed["reason"]) == (
        "Rerank",
        "INVALID_ARGUMENT",
        "EMPTY_INPUT",
    )
