"""An LLM reranker (a tiny random-weight Qwen3 with Qwen3-Reranker's template) through a
real server: gRPC Rerank, Pool's score and ListModels, and the HTTP doors that rank (vLLM's
/rerank and /score, TEI's /rerank, Cohere's /v2/rerank), each against the model card's
computation done here with transformers; a decoder LM without a template refused."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.conftest import DEFAULT_MODEL as MINILM_ID
from tests.engine.families.test_llm_reranker import CARD_TASK, card_format, card_inputs, card_scores
from tests.fixture_models import QWEN3_RERANKER_TEMPLATE, tiny_qwen3_reranker
from tests.responses import in_document_order
from tests.rpc_errors import decode_rpc_error
from tests.service.http_calls import (
    HttpServer,
    batch_line,
    http_stub,
    run_batch,
    serve_models,
)

ATOL = 1e-5
QUERY = "What is the capital of China?"
DOCUMENTS = [
    "Gravity is a force that attracts two bodies towards each other.",
    "The capital of China is Beijing.",
    "",
    "Beijing. " * 30,
    "yes",
]
INSTRUCTION = "Judge whether the passage names a city"


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("served-llm-rerankers")
    template = root / "qwen3-reranker.txt"
    template.write_text(QWEN3_RERANKER_TEMPLATE)
    with_instruction = root / "qwen3-reranker.json"
    with_instruction.write_text(
        json.dumps({"template": QWEN3_RERANKER_TEMPLATE, "default_instruction": CARD_TASK})
    )
    return {
        "template_json": with_instruction,
        "reranker": tiny_qwen3_reranker(root / "qwen3-reranker"),
        "bare": tiny_qwen3_reranker(root / "qwen3-bare", template_file=False),
        "template": template,
    }


@pytest.fixture(scope="module")
def http(
    folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[HttpServer]:
    """`rr` (the folder's score_template.json, the default model), `rr-flags` (the same
    weights without a file, given --score-template and --score-tokens), `bare` (no
    template) and `minilm` (an embedding model)."""
    bare = folders["bare"]
    models = {"rr": folders["reranker"], "rr-flags": bare, "bare": bare, "minilm": MINILM_ID}
    flags = ["--score-template", "", "--score-template", str(folders["template"])]
    flags += ["--score-template", "", "--score-template", ""]
    flags += ["--score-tokens", "", "--score-tokens", "yes,no"]
    flags += ["--score-tokens", "", "--score-tokens", ""]
    yield from serve_models(tmp_path_factory, "llm-reranker", models, *flags)


stub = http_stub


@pytest.fixture(scope="module")
def expected(folders: dict[str, Path]) -> dict[str | None, np.ndarray]:
    """The model card's scores of DOCUMENTS, by instruction (None: the card's default)."""
    folder = folders["reranker"]
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(folder)
    return {
        instruction: card_scores(
            model,
            tokenizer,
            card_inputs(tokenizer, [card_format(instruction, QUERY, d) for d in DOCUMENTS], 512),
        )
        for instruction in (None, INSTRUCTION)
    }


def by_index(results: list[tuple[int, float]]) -> np.ndarray:
    return in_document_order(results, len(DOCUMENTS))


def test_list_models_shows_scorers_and_their_templates(
    stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    cards = {card.name: card for card in stub.ListModels(pb.ListModelsRequest()).models}
    assert list(cards["rr"].tasks) == [pb.POOLING_TASK_SCORE]
    assert cards["rr"].score_template_source == "score_template.json"
    assert cards["rr-flags"].score_template_source == "--score-template"
    assert cards["rr"].architecture == "Qwen3ForCausalLM"
    assert cards["bare"].score_template_source == ""
    assert pb.POOLING_TASK_SCORE not in cards["bare"].tasks  # it embeds; score is refused


@pytest.mark.parametrize("model", ["rr", "rr-flags"])
@pytest.mark.parametrize("instruction", [None, INSTRUCTION])
def test_grpc_rerank(
    stub: pooling_pb2_grpc.PoolingServiceStub,
    expected: dict[str | None, np.ndarray],
    model: str,
    instruction: str | None,
) -> None:
    request = pb.RerankRequest(model=model, query=QUERY, documents=DOCUMENTS)
    if instruction is not None:
        request.instruction = instruction
    elif model == "rr-flags":
        request.instruction = ""  # its template file has no default instruction
    response = stub.Rerank(request, timeout=60)
    got = by_index([(r.index, r.relevance_score) for r in response.results])
    if model == "rr-flags" and instruction is None:
        assert np.all(np.isfinite(got))  # "" is an instruction of its own: no reference
        return
    np.testing.assert_allclose(got, expected[instruction], atol=ATOL)
    assert response.usage.prompt_tokens > 100 * len(DOCUMENTS)


def test_grpc_score_takes_the_instruction_as_prompt(
    stub: pooling_pb2_grpc.PoolingServiceStub, expected: dict[str | None, np.ndarray]
) -> None:
    request = pb.PoolRequest(
        model="rr", score=pb.ScoreInput(text_1=[QUERY], text_2=DOCUMENTS), prompt=INSTRUCTION
    )
    scores = np.array(stub.Pool(request, timeout=60).score.scores)
    np.testing.assert_allclose(scores, expected[INSTRUCTION], atol=ATOL)


def test_http_doors_rank_as_grpc(http: HttpServer, expected: dict[str | None, np.ndarray]) -> None:
    reference = expected[None]
    for path in ("/rerank", "/v1/rerank"):
        status, _, body = http.call(path, {"model": "rr", "query": QUERY, "documents": DOCUMENTS})
        assert status == 200, body
        got = by_index([(r["index"], r["relevance_score"]) for r in body["results"]])
        np.testing.assert_allclose(got, reference, atol=ATOL)
    status, _, body = http.call("/score", {"model": "rr", "text_1": QUERY, "text_2": DOCUMENTS})
    assert status == 200, body
    np.testing.assert_allclose([d["score"] for d in body["data"]], reference, atol=ATOL)
    status, _, body = http.call("/rerank", {"query": QUERY, "texts": DOCUMENTS})  # TEI's
    assert status == 200, body
    np.testing.assert_allclose(
        by_index([(r["index"], r["score"]) for r in body]), reference, atol=ATOL
    )
    status, _, body = http.call(
        "/v2/rerank", {"model": "rr", "query": QUERY, "documents": DOCUMENTS}
    )  # Cohere's
    assert status == 200, body
    got = by_index([(r["index"], r["relevance_score"]) for r in body["results"]])
    np.testing.assert_allclose(got, reference, atol=ATOL)


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/rerank", {"query": QUERY, "documents": DOCUMENTS}),
        ("/v1/rerank", {"query": QUERY, "documents": DOCUMENTS}),
        ("/v2/rerank", {"query": QUERY, "documents": DOCUMENTS}),  # Cohere's
        ("/rerank", {"query": QUERY, "texts": DOCUMENTS}),  # TEI's
        ("/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
        ("/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS}),
    ],
)
def test_http_doors_take_the_instruction(
    http: HttpServer, expected: dict[str | None, np.ndarray], path: str, body: dict[str, object]
) -> None:
    """`instruction` on every door that ranks or scores, as gRPC's RerankRequest.instruction."""
    status, _, answer = http.call(path, {**body, "model": "rr", "instruction": INSTRUCTION})
    assert status == 200, answer
    if "text_1" in body:
        got = np.array([d["score"] for d in answer["data"]])
    else:
        ranked = answer if isinstance(answer, list) else answer["results"]
        key = "score" if "texts" in body else "relevance_score"
        got = by_index([(r["index"], r[key]) for r in ranked])
    np.testing.assert_allclose(got, expected[INSTRUCTION], atol=ATOL)
    assert not np.allclose(got, expected[None], atol=ATOL)  # the instruction was used


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/rerank", {"query": QUERY, "documents": ["a"]}),
        ("/v2/rerank", {"query": QUERY, "documents": ["a"]}),
        ("/rerank", {"query": QUERY, "texts": ["a"]}),
        ("/score", {"text_1": QUERY, "text_2": ["a"]}),
    ],
)
def test_an_http_instruction_on_another_model_is_refused(
    stub: pooling_pb2_grpc.PoolingServiceStub, http: HttpServer, path: str, body: dict[str, object]
) -> None:
    """Refused as gRPC's Rerank refuses it: the same reason and words, the field named
    `instruction` on every door."""
    with pytest.raises(grpc.RpcError) as caught:
        stub.Rerank(
            pb.RerankRequest(model="minilm", query=QUERY, documents=["a"], instruction="x"),
            timeout=60,
        )
    grpc_error = decode_rpc_error(caught.value)
    assert grpc_error.fields == ["instruction"]
    description = grpc_error.description("instruction")
    assert "LLM reranker" in description
    status, _, answer = http.call(path, {**body, "model": "minilm", "instruction": "x"})
    assert status == (422 if "texts" in body else 400), answer  # TEI's validation status
    error = answer.get("error", answer)  # TEI's and Cohere's: flat
    message = error["message"] if isinstance(error, dict) else error
    assert message.endswith(f"instruction: {description}")  # Cohere: "invalid request: ..."
    status, _, answer = http.call(path, {**body, "model": "rr", "instruction": 3})
    assert status in (400, 422) and "instruction" in json.dumps(answer), answer


def test_a_decoder_lm_without_a_template_refuses_score(
    stub: pooling_pb2_grpc.PoolingServiceStub, http: HttpServer
) -> None:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Rerank(pb.RerankRequest(model="bare", query=QUERY, documents=DOCUMENTS), timeout=60)
    assert caught.value.code() is grpc.StatusCode.FAILED_PRECONDITION
    error = decode_rpc_error(caught.value)
    assert error.reason == "SCORE_TEMPLATE_MISSING"
    assert "--score-template" in caught.value.details()
    status, _, body = http.call("/rerank", {"model": "bare", "query": QUERY, "documents": ["a"]})
    assert status >= 400 and "score_template.json" in str(body)
    embedded = stub.Pool(pb.PoolRequest(model="bare", embed=pb.TextInput(texts=["a"])), timeout=60)
    assert len(embedded.embed.embeddings[0].values) == 64  # it still embeds


def test_an_instruction_on_another_model_is_refused(
    stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    request = pb.RerankRequest(model="minilm", query=QUERY, documents=["a"], instruction="x")
    with pytest.raises(grpc.RpcError) as caught:
        stub.Rerank(request, timeout=60)
    assert caught.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "instruction" in caught.value.details()


def test_batch_job_ranks_and_scores(
    folders: dict[str, Path], expected: dict[str | None, np.ndarray]
) -> None:
    """`pooling-server batch` lines through /v1/rerank and /v1/score, the template given
    by the flags this time."""
    body = {"model": "rr", "query": QUERY, "documents": DOCUMENTS}
    pairs = {"model": "rr", "text_1": QUERY, "text_2": DOCUMENTS}
    lines = [batch_line("r", "/v1/rerank", body), batch_line("s", "/v1/score", pairs)]
    for custom_id, url, given in (("ri", "/v1/rerank", body), ("si", "/v1/score", pairs)):
        # No "method": a line without one is a POST.
        lines.append(
            {"custom_id": custom_id, "url": url, "body": {**given, "instruction": INSTRUCTION}}
        )
    args = ["--model", f"rr={folders['bare']}", "--score-template", str(folders["template_json"])]
    answers = run_batch([*args, "--backend", "torch", "--dtype", "float32"], lines)
    ranked = answers["r"]["body"]["results"]
    scored = [d["score"] for d in answers["s"]["body"]["data"]]
    got = by_index([(r["index"], r["relevance_score"]) for r in ranked])
    np.testing.assert_allclose(got, expected[None], atol=ATOL)
    np.testing.assert_allclose(scored, expected[None], atol=ATOL)
    assert answers["r"]["status_code"] == answers["s"]["status_code"] == 200
    ranked = answers["ri"]["body"]["results"]
    got = by_index([(r["index"], r["relevance_score"]) for r in ranked])
    np.testing.assert_allclose(got, expected[INSTRUCTION], atol=ATOL)
    scored = [d["score"] for d in answers["si"]["body"]["data"]]
    np.testing.assert_allclose(scored, expected[INSTRUCTION], atol=ATOL)
