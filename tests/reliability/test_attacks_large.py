"""Legal but large requests beside a bystander (issue 43, row 8): three concurrent MaxSim
reranks of 1,024 maximum-length documents on a ColBERT model held a small call 7.3 s, grew
the server by 625 MB and left 357 MB held.

The ColBERT here is narrow where the forward pass costs (one layer, one head of 32 wide) and
wide where the answer's memory lies (a 256-wide projection of 256-token documents: 256 MB
of matrices a request, as a real one's): the attack tests how the server holds large
requests beside small ones, not the CPU's speed. It must hold: the bystander (one small
Pool every 100 ms) never fails and never waits 1.5 s; the server tree grows less than
300 MB while it runs and is back under 100 MB of growth ten seconds after.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch
from safetensors.torch import save_file
from transformers import BertModel

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.fixture_models import MINILM, _bert_config, tiny_colbert
from tests.reliability.attack_kit import BYSTANDER, MB, watching
from tests.reliability.support import assert_alive, embed_request, report
from tests.server_process import ServerProcess, all_serving, spawn_server

pytestmark = pytest.mark.quiet  # times a bystander: `make test` runs it with nothing beside it

PEAK_LIMIT_MB = 300
SETTLED_LIMIT_MB = 100
SETTLE_S = 10.0
DOCUMENT_TOKENS = 256
WIDTH = 256  # the projection: each document a 256 x 256 float32 matrix, 256 KB
DOCUMENTS = 1024
RERANKS = 3
DOCUMENT = "word and more " * 100  # ~300 tokens: every document cut to the maximum


def wide_colbert(folder: Path) -> Path:
    """tiny_colbert's layout and tokenizer, with a body of 256 positions, one layer and one
    head, and a 32 -> 256 projection; documents of 256 tokens, queries of 32."""
    tiny_colbert(folder)
    torch.manual_seed(3)
    vocabulary = json.loads((folder / "config.json").read_text())["vocab_size"]
    config = _bert_config(
        vocab_size=vocabulary,
        num_hidden_layers=1,
        num_attention_heads=1,
        max_position_embeddings=DOCUMENT_TOKENS,
    )
    BertModel(config, add_pooling_layer=False).save_pretrained(folder)
    dense = folder / "1_Dense"
    settings = json.loads((dense / "config.json").read_text())
    (dense / "config.json").write_text(json.dumps({**settings, "out_features": WIDTH}))
    save_file({"linear.weight": torch.randn(WIDTH, 32) * 0.2}, str(dense / "model.safetensors"))
    (folder / "sentence_bert_config.json").write_text(
        json.dumps({"max_seq_length": DOCUMENT_TOKENS})
    )
    path = folder / "config_sentence_transformers.json"
    sentence = json.loads(path.read_text())
    sentence.update(query_length=32, document_length=DOCUMENT_TOKENS)
    path.write_text(json.dumps(sentence))
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    """MiniLM (the default: the bystander's) and the wide ColBERT, warmed up."""
    root = tmp_path_factory.mktemp("attacks-large")
    colbert = wide_colbert(root / "colbert")
    args = ["--model", f"minilm={MINILM}", "--model", f"colbert={colbert}"]
    process = spawn_server(args, root, "large")
    with all_serving([process], stop_timeout=20):
        with grpc.insecure_channel(process.address) as channel:
            stub = pooling_pb2_grpc.PoolingServiceStub(channel)
            for _ in range(5):
                stub.Pool(embed_request(["a bystander"]), timeout=60)
            stub.Rerank(_rerank(64), timeout=120)
        yield process


def _rerank(documents: int) -> pb.RerankRequest:
    return pb.RerankRequest(
        model="colbert", query="what about the word", documents=[DOCUMENT] * documents
    )


def test_three_maximum_maxsim_reranks_leave_a_bystander_unharmed(
    server: ServerProcess, record_property
) -> None:
    answers: dict[int, object] = {}

    def rerank(k: int) -> None:
        options = [("grpc.use_local_subchannel_pool", 1)]  # a connection of its own
        with grpc.insecure_channel(server.address, options=options) as channel:
            stub = pooling_pb2_grpc.PoolingServiceStub(channel)
            try:
                answers[k] = stub.Rerank(_rerank(DOCUMENTS), timeout=300)
            except grpc.RpcError as error:
                answers[k] = error

    with watching(server) as watch:
        started = time.monotonic()
        threads = [threading.Thread(target=rerank, args=(k,)) for k in range(RERANKS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        watch.answer_s = time.monotonic() - started
    rss = watch.rss
    deadline = time.monotonic() + SETTLE_S
    while (settled := (rss._total() - rss.baseline) / MB) >= SETTLED_LIMIT_MB:
        if time.monotonic() > deadline:
            break
        time.sleep(0.25)
    report(
        record_property,
        "attacks_large_maxsim_reranks",
        reranks=RERANKS,
        documents=DOCUMENTS,
        settled_mb=settled,
        **watch.figures(),
    )
    for k in range(RERANKS):
        answer = answers[k]
        assert isinstance(answer, pb.RerankResponse), f"rerank {k}: {answer}"
        assert sorted(r.index for r in answer.results) == list(range(DOCUMENTS))
        scores = [r.relevance_score for r in answer.results]
        assert scores == sorted(scores, reverse=True) and scores[0] > 0
    latencies = watch.bystander.latencies
    assert not watch.bystander.failures, f"bystander failures {dict(watch.bystander.failures)}"
    BYSTANDER.check(max(latencies), "a bystander call")
    assert rss.extra_mb < PEAK_LIMIT_MB, f"peak growth {rss.extra_mb:.0f} MB ({rss.growth_at_peak})"
    assert settled < SETTLED_LIMIT_MB, f"{settled:.0f} MB still held {SETTLE_S:.0f}s after"
    assert_alive(server)
