"""Attacks by multiplication: inputs a request reads many times, and answers that grow with
tokens or chunks (issue 43, rows 1-3 and the token-classification half of row 8).

- An LLM reranker's instruction is read with every document: a long one with many
  documents (gRPC Rerank, Pool score's prompt, /rerank, /score, Cohere's /v2/rerank, TEI's
  /rerank) is refused by the input bounds before any pair is built.
- Late chunking by tokens with a window of 1, or by sentences over "a. a. a.", on 16 texts
  of 262,144 characters: refused OUTPUT_TOO_LARGE from the texts, before tokenizing.
- ColBERT's embed_multi, bge-m3's embed_outputs, /pooling embed_multi and TEI's /embed_all
  on texts at their maximum length: refused from the token counts before the forward pass.
- TEI's root token classification with aggregation none on 1,024 long texts: counted as
  entities, refused before the forward pass.

Each runs beside a bystander (attack_kit.watching: one small embed every 100 ms, the
server tree's RSS sampled every 10 ms) and prints one RELIABILITY line. The models are
small random-weight ones beside all-MiniLM-L6-v2 (the bystander's), so the answer caps are
6 MB here (--max-message-mb, --max-http-response-mb): the same rules as at 16 and 64 MB.
The ColBERT model reads documents of its 128 positions, as a real one reads its 512.
"""

from __future__ import annotations

import http.client
import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from transformers import BertForTokenClassification

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.fixture_models import (
    MAX_POSITIONS,
    MINILM,
    NER_LABELS,
    _bert_config,
    _labels,
    _save,
    tiny_bge_m3,
    tiny_colbert,
    tiny_qwen3_reranker,
)
from tests.reliability.attack_kit import INVALID, REFUSAL, refusal, timed, watching
from tests.reliability.support import assert_alive, embed_request, report
from tests.server_process import ServerProcess, free_port, start_server

pytestmark = pytest.mark.quiet  # times a bystander: `make test` runs it with nothing beside it

CAP_MB = 6  # a gRPC request of 16 texts of 262,144 characters (4.2 MB) still arrives
# attack_kit's REFUSAL (measured 0.02-0.3 s) and BYSTANDER (a quiet machine answers in
# 0.01-0.1 s) are the bounds, as targets.
LONG = "a " * 131072  # 262,144 characters: MiniLM's limit for a text that may run long
SENTENCES = "a. " * 87381  # 262,143 characters, 87,381 sentences
# About 150 tokens of MiniLM's vocabulary: past the tiny models' 128 positions.
PARAGRAPH = " ".join(f"word{i % 97} and more" for i in range(50))


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerProcess, int]]:
    root = tmp_path_factory.mktemp("attacks-counted")
    folders = {
        "minilm": MINILM,
        "reranker": tiny_qwen3_reranker(root / "reranker"),
        "colbert": _long_documents(tiny_colbert(root / "colbert")),
        "bge": tiny_bge_m3(root / "bge"),
        "ner": _save(BertForTokenClassification(_bert_config(**_labels(NER_LABELS))), root / "ner"),
    }
    http_port = free_port()
    args = ["--dtype", "float32", "--http-port", str(http_port)]
    args += ["--max-message-mb", str(CAP_MB), "--max-http-response-mb", str(CAP_MB)]
    for name, folder in folders.items():
        args += ["--model", f"{name}={folder}"]
    process = start_server(args, root, "counted")
    try:
        _warm_up(process, http_port)
        yield process, http_port
    finally:
        process.stop(signal.SIGTERM, timeout=10)


def _long_documents(folder: Path) -> Path:
    """The fixture ColBERT reading documents of its every position (128), not 20."""
    for name, key, value in (
        ("sentence_bert_config.json", "max_seq_length", MAX_POSITIONS),
        ("config_sentence_transformers.json", "document_length", MAX_POSITIONS),
    ):
        settings = json.loads((folder / name).read_text())
        settings[key] = value
        (folder / name).write_text(json.dumps(settings))
    return folder


def _warm_up(process: ServerProcess, http_port: int) -> None:
    """A fresh server's first batches of each model run slower: made here, so that no
    attack's bystander pays for them; then wait until a small call is quick."""
    with grpc.insecure_channel(process.address) as channel:
        warm = pooling_pb2_grpc.PoolingServiceStub(channel)
        warm.Pool(
            pb.PoolRequest(model="colbert", embed_multi=pb.TextInput(texts=["a"])), timeout=60
        )
        outputs = pb.OutputsInput(texts=["a"], dense=True, sparse=True, multi=True)
        warm.Pool(pb.PoolRequest(model="bge", embed_outputs=outputs), timeout=60)
        warm.Rerank(pb.RerankRequest(model="reranker", query="q", documents=["d"]), timeout=60)
        warm.Pool(_late(["One. Two."], rule=pb.CHUNK_RULE_SENTENCES), timeout=60)
        _post(http_port, "/?model=ner", {"inputs": "a warm up"})
        for _ in range(50):
            started = time.monotonic()
            warm.Pool(embed_request(["a bystander"]), timeout=30)
            if time.monotonic() - started < 0.3:
                break


@pytest.fixture(scope="module")
def stub(server: tuple[ServerProcess, int]) -> Iterator[pooling_pb2_grpc.PoolingServiceStub]:
    with grpc.insecure_channel(
        server[0].address, options=[("grpc.max_send_message_length", 64 << 20)]
    ) as channel:
        yield pooling_pb2_grpc.PoolingServiceStub(channel)


def _post(port: int, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        connection.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read() or b"{}")
    finally:
        connection.close()


def _http_refusal(answer: dict[str, Any]) -> tuple[str, str]:
    """(reason or TEI's error type, message) of any family's envelope."""
    error = answer.get("error", answer)
    if isinstance(error, str):  # TEI's {"error", "error_type"}
        return answer.get("error_type", ""), error
    return error.get("reason", ""), error.get("message", "")


def _watched(process: ServerProcess, call: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
    with watching(process) as watch:
        watch.answer_s, result = timed(call, *args, **kwargs)
    return watch, result


def _check(watch: Any, record_property: Any, name: str, **figures: Any) -> None:
    """The issue's bounds: refused within 1 s, the bystander never failing nor waiting
    1.5 s (targets: twice each fails), the server tree within 100 MB of where it was (the
    issue allows 300 MB at the peak; a refusal made before any work needs a few)."""
    report(record_property, name, **figures, **watch.figures())
    REFUSAL.check(watch.answer_s, "the refusal")
    watch.assert_unharmed()


# ------------------------------------------------------------------ row 1: instruction x documents

INSTRUCTION = "judge it " * 55_000  # 495,000 characters: within the per-text limit (524,288)


def test_grpc_rerank_instruction_times_documents_is_refused(
    server: tuple[ServerProcess, int], stub: pooling_pb2_grpc.PoolingServiceStub, record_property
) -> None:
    """A 495 KB instruction with 64 documents: 32 MB of pairs (before: copied into every
    pair and tokenized, 78.7 s and +3.3 GB with a 1 MB one). A 1 MB instruction is over the
    per-text limit by its own name."""
    documents = [f"document {i}" for i in range(64)]
    request = pb.RerankRequest(
        model="reranker", query="which one?", documents=documents, instruction=INSTRUCTION
    )
    watch, result = _watched(server[0], stub.Rerank, request, timeout=60)
    error = refusal(result, INVALID)
    _check(watch, record_property, "attacks_counted_rerank_instruction")
    assert (error.reason, error.fields) == ("REQUEST_TOO_LARGE", ["documents"]), error.message
    assert "the instruction and the template" in error.message
    request.instruction = "x" * (1 << 20)
    watch, result = _watched(server[0], stub.Rerank, request, timeout=60)
    error = refusal(result, INVALID)
    _check(watch, record_property, "attacks_counted_rerank_instruction_1mb")
    assert (error.reason, error.fields[0]) == ("INPUT_TOO_LONG", "instruction"), error.message


def test_pool_score_prompt_times_documents_is_refused(
    server: tuple[ServerProcess, int], stub: pooling_pb2_grpc.PoolingServiceStub, record_property
) -> None:
    score = pb.ScoreInput(text_1=["which one?"], text_2=[f"document {i}" for i in range(16)])
    request = pb.PoolRequest(model="reranker", score=score, prompt=INSTRUCTION)
    watch, result = _watched(server[0], stub.Pool, request, timeout=60)
    error = refusal(result, INVALID)
    _check(watch, record_property, "attacks_counted_pool_score_prompt")
    assert (error.reason, error.fields) == ("REQUEST_TOO_LARGE", ["score"]), error.message


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/rerank", {"query": "which one?", "documents": []}),
        ("/v1/score", {"text_1": "which one?", "text_2": []}),
        ("/v2/rerank", {"query": "which one?", "documents": []}),
        ("/rerank", {"query": "which one?", "texts": []}),  # TEI's
    ],
    ids=["vllm-rerank", "vllm-score", "cohere-rerank", "tei-rerank"],
)
def test_http_instruction_times_documents_is_refused(
    server: tuple[ServerProcess, int], record_property, path: str, body: dict[str, Any]
) -> None:
    process, port = server
    documents = [f"document {i}" for i in range(16)]
    sent = {**body, "model": "reranker", "instruction": INSTRUCTION}
    for key in ("documents", "text_2", "texts"):
        if key in sent:
            sent[key] = documents
    watch, (status, answer) = _watched(process, _post, port, path, sent)
    reason, message = _http_refusal(answer)
    _check(watch, record_property, f"attacks_counted_http_instruction{path}", status=status)
    assert status in (400, 413), answer
    assert "REQUEST_TOO_LARGE" in (reason, message) or "--max-request-chars" in message, answer


# ------------------------------------------------------------------ row 2: late chunks


def _late(texts: list[str], **chunking: Any) -> pb.PoolRequest:
    return pb.PoolRequest(
        model="minilm",
        embed=pb.TextInput(texts=texts),
        late_chunking=pb.LateChunking(**chunking),
    )


@pytest.mark.parametrize(
    ("text", "chunking"),
    [
        (LONG, {"rule": pb.CHUNK_RULE_TOKENS, "window_tokens": 1}),
        (SENTENCES, {"rule": pb.CHUNK_RULE_SENTENCES}),
    ],
    ids=["tokens", "sentences"],
)
def test_grpc_late_chunks_too_many_are_refused_from_the_texts(
    server: tuple[ServerProcess, int],
    stub: pooling_pb2_grpc.PoolingServiceStub,
    record_property,
    text: str,
    chunking: dict[str, Any],
) -> None:
    """16 texts of 262,144 characters: 1.4-2 million chunks (before: every chunk built,
    then OUTPUT_TOO_LARGE after 17.6-19.9 s and +922-1,210 MB)."""
    request = _late([text] * 16, **chunking)
    watch, result = _watched(server[0], stub.Pool, request, timeout=60)
    error = refusal(result, INVALID)
    rule = "tokens" if "window_tokens" in chunking else "sentences"
    _check(watch, record_property, f"attacks_counted_late_chunks_{rule}")
    assert (error.reason, error.fields) == ("OUTPUT_TOO_LARGE", ["embed.texts"]), error.message


def test_http_late_chunks_too_many_are_refused(
    server: tuple[ServerProcess, int], record_property
) -> None:
    process, port = server
    body = {
        "model": "minilm",
        "input": [LONG] * 16,
        "late_chunking": {"rule": "tokens", "window": 1},
    }
    watch, (status, answer) = _watched(process, _post, port, "/v1/embeddings", body)
    reason, message = _http_refusal(answer)
    _check(watch, record_property, "attacks_counted_http_late_chunks", status=status)
    assert (status, reason) == (400, "OUTPUT_TOO_LARGE"), answer
    assert "--max-http-response-mb" in message


# ------------------------------------------------------------------ row 3: token matrices


def test_grpc_embed_multi_at_maximum_length_is_refused_before_the_forward_pass(
    server: tuple[ServerProcess, int], stub: pooling_pb2_grpc.PoolingServiceStub, record_property
) -> None:
    """1,024 ColBERT documents at their length: counted a row per token (before: one value
    per text, then 8.1 s and +1.5 GB to a refusal at send)."""
    request = pb.PoolRequest(model="colbert", embed_multi=pb.TextInput(texts=[PARAGRAPH] * 1024))
    watch, result = _watched(server[0], stub.Pool, request, timeout=60)
    error = refusal(result, INVALID)
    _check(watch, record_property, "attacks_counted_embed_multi")
    assert (error.reason, error.fields) == ("OUTPUT_TOO_LARGE", ["embed_multi.texts"])


def test_grpc_embed_outputs_at_maximum_length_is_refused_before_the_forward_pass(
    server: tuple[ServerProcess, int], stub: pooling_pb2_grpc.PoolingServiceStub, record_property
) -> None:
    outputs = pb.OutputsInput(texts=[PARAGRAPH] * 1024, dense=True, sparse=True, multi=True)
    request = pb.PoolRequest(model="bge", embed_outputs=outputs)
    watch, result = _watched(server[0], stub.Pool, request, timeout=60)
    error = refusal(result, INVALID)
    _check(watch, record_property, "attacks_counted_embed_outputs")
    assert (error.reason, error.fields) == ("OUTPUT_TOO_LARGE", ["embed_outputs.texts"])


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/pooling", {"model": "colbert", "task": "embed_multi", "input": [PARAGRAPH] * 512}),
        ("/embed_all?model=colbert", {"inputs": [PARAGRAPH] * 512}),
        ("/embed_all?model=bge", {"inputs": [PARAGRAPH] * 512}),
    ],
    ids=["pooling-embed-multi", "tei-embed-all-colbert", "tei-embed-all-bge"],
)
def test_http_token_matrices_are_refused_before_the_forward_pass(
    server: tuple[ServerProcess, int], record_property, path: str, body: dict[str, Any]
) -> None:
    process, port = server
    watch, (status, answer) = _watched(process, _post, port, path, body)
    reason, message = _http_refusal(answer)
    _check(watch, record_property, f"attacks_counted_http_matrices{path}", status=status)
    assert status in (400, 413), answer
    assert "OUTPUT_TOO_LARGE" in (reason, message) or "--max-http-response-mb" in message, answer


# ------------------------------------------------------------------ row 8: entities


def test_tei_token_classification_entities_are_counted_before_the_forward_pass(
    server: tuple[ServerProcess, int], record_property
) -> None:
    """1,024 texts at the NER model's length, aggregation none: about 130,000 entities,
    counted as entities (about 100 bytes each) and refused; 64 such texts are served."""
    process, port = server
    body: dict[str, Any] = {
        "inputs": [PARAGRAPH] * 1024,
        "parameters": {"aggregation_strategy": "none", "ignore_labels": []},
        "truncate": True,
    }
    watch, (status, answer) = _watched(process, _post, port, "/?model=ner", body)
    _, message = _http_refusal(answer)
    _check(watch, record_property, "attacks_counted_tei_entities", status=status)
    assert status == 413, answer
    assert "--max-http-response-mb" in message, answer
    body["inputs"] = [PARAGRAPH] * 16
    started = time.monotonic()
    status, served = _post(port, "/?model=ner", body)
    assert status == 200, served
    assert len(served) == 16 and len(served[0]) > 100, time.monotonic() - started
    assert_alive(process)
