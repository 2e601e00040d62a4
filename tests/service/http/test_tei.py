"""TEI's routes on a real server: huggingface_hub's InferenceClient against it, each route
in TEI's documented shapes (docs/openapi.json of text-embeddings-inference), results equal
to the gRPC ones from the same server, and TEI's error shape and statuses."""

from __future__ import annotations

import numpy as np
import pytest
from huggingface_hub import InferenceClient

from pooling_client import PoolingParams
from tests.fixture_models import MINILM
from tests.metrics_endpoint import metric_sum, scrape
from tests.service.doors_server import KEY, MAX_CLIENT_BATCH_SIZE, DoorsServer

TEXTS = ["the cat sat on the mat", "a quick brown fox", "pooling over http"]
LONG = " ".join(f"word{i}" for i in range(400))  # far over the tiny models' 128 tokens


def grpc_embed(doors: DoorsServer, texts: list[str], **kwargs: object) -> np.ndarray:
    with doors.grpc() as client:
        return client.embed(texts, model="embedder", output="numpy", **kwargs)  # type: ignore[return-value]


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (b @ a) / (np.linalg.norm(b, axis=1) * np.linalg.norm(a))


def assert_tei_error(answer: tuple[int, dict, object], status: int, error_type: str) -> str:
    code, _, body = answer
    assert code == status, body
    assert isinstance(body, dict) and set(body) == {"error", "error_type"}, body
    assert body["error_type"] == error_type, body
    return body["error"]


def test_inference_client_equals_grpc(doors: DoorsServer) -> None:
    client = InferenceClient(model=doors.url(), token=KEY)
    normalized = grpc_embed(doors, TEXTS, pooling_params=PoolingParams(use_activation=True))
    vectors = client.feature_extraction(TEXTS)
    assert vectors.shape == (3, 32)
    np.testing.assert_allclose(vectors, normalized, rtol=1e-6, atol=1e-7)
    prompted = client.feature_extraction(TEXTS[0], prompt_name="query", normalize=False)
    expected = grpc_embed(
        doors, [TEXTS[0]], prompt_name="query", pooling_params=PoolingParams(use_activation=False)
    )
    np.testing.assert_allclose(prompted, expected, rtol=1e-6, atol=1e-7)
    similarities = client.sentence_similarity(TEXTS[0], TEXTS[1:])
    raw = grpc_embed(doors, TEXTS, pooling_params=PoolingParams(use_activation=False))
    np.testing.assert_allclose(similarities, cosine(raw[0], raw[1:]), rtol=1e-5, atol=1e-6)


def test_embed_and_its_options(doors: DoorsServer) -> None:
    status, headers, one = doors.call("/embed", {"inputs": TEXTS[0]})
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    assert len(one) == 1 and len(one[0]) == 32
    _, _, raw = doors.call("/embed", {"inputs": TEXTS, "normalize": False})
    expected = grpc_embed(doors, TEXTS, pooling_params=PoolingParams(use_activation=False))
    np.testing.assert_array_equal(np.array(raw, dtype=np.float32), expected)
    _, _, prompted = doors.call("/embed", {"inputs": TEXTS, "prompt_name": "document"})
    np.testing.assert_array_equal(
        np.array(prompted, dtype=np.float32),
        grpc_embed(doors, TEXTS, prompt_name="document", pooling_params=PoolingParams(True)),
    )
    # Over-long input: refused unless truncate; truncation_direction picks the end cut.
    message = assert_tei_error(doors.call("/embed", {"inputs": [LONG]}), 422, "Tokenizer")
    assert "inputs[0]" in message
    _, _, right = doors.call("/embed", {"inputs": LONG, "truncate": True})
    _, _, left = doors.call(
        "/embed", {"inputs": LONG, "truncate": True, "truncation_direction": "Left"}
    )
    np.testing.assert_array_equal(
        np.array(right, dtype=np.float32),
        grpc_embed(doors, [LONG], truncate_prompt_tokens=-1, pooling_params=PoolingParams(True)),
    )
    assert not np.allclose(right, left)


def test_embed_all_and_embed_sparse(doors: DoorsServer) -> None:
    status, _, rows = doors.call("/embed_all", {"inputs": ["hello world", "a b c d"]})
    assert status == 200
    assert [len(r) for r in rows] == [4, 6]  # [CLS] hello world [SEP]; [CLS] a b c d [SEP]
    assert all(len(token) == 32 for r in rows for token in r)
    # The embedder is not SPLADE: TEI's 424 for a model that cannot do the task.
    assert_tei_error(doors.call("/embed_sparse", {"inputs": "hello"}), 424, "Backend")
    # Random weights keep most of the 30,522 entries: two texts' answer is about 2 MB.
    status, _, sparse = doors.call("/embed_sparse", {"inputs": TEXTS[:2], "model": "splade"})
    assert status == 200 and len(sparse) == 2
    with doors.grpc() as client:
        expected = client.embed_sparse(TEXTS[:2], model="splade")
    for weights, grpc in zip(sparse, expected, strict=True):
        indices = [w["index"] for w in weights]
        assert indices == sorted(indices) and weights and all(w["value"] > 0 for w in weights)
        assert {w["index"]: w["value"] for w in weights} == pytest.approx(grpc.outputs.to_dict())
    _, _, routed = doors.call("/", {"inputs": TEXTS[0], "model": "splade"})
    assert routed == sparse[:1]
    # The engine's token_embed.texts[1], named as TEI names it.
    long = doors.call("/embed_all", {"inputs": ["ok", "x " * 1000]})
    assert assert_tei_error(long, 422, "Tokenizer").startswith("inputs[1]: has ")


def test_answers_over_the_http_response_cap_are_refused(doors: DoorsServer) -> None:
    """Sparse weights of 16 texts take about 18 MB of JSON, over the server's 4 MB: a size
    the engine cannot estimate before the work, so the rendered body is measured (built off
    the event loop, being large) and refused."""
    body = {"inputs": TEXTS[:1] * MAX_CLIENT_BATCH_SIZE, "model": "splade"}
    message = assert_tei_error(doors.call("/embed_sparse", body), 413, "Validation")
    assert "max-http-response-mb" in message
    status, _, _ = doors.call("/embed", {"inputs": "still serving"})
    assert status == 200


def test_predict_single_batch_pairs_and_raw_scores(doors: DoorsServer) -> None:
    status, _, single = doors.call("/predict", {"inputs": TEXTS[0], "model": "classifier"})
    assert status == 200
    assert {p["label"] for p in single} == {"negative", "neutral", "positive"}
    assert [p["score"] for p in single] == sorted((p["score"] for p in single), reverse=True)
    with doors.grpc() as client:
        [grpc] = client.classify([TEXTS[0]], model="classifier")
        logits = client.classify(
            [TEXTS[0]], model="classifier", pooling_params=PoolingParams(False)
        )
        pair_scores = client.score(["a query", "b query"], ["a doc", "b doc"], model="cross")
    labels = ["negative", "neutral", "positive"]
    by_label = {p["label"]: p["score"] for p in single}
    np.testing.assert_allclose([by_label[x] for x in labels], grpc.outputs.probs, rtol=1e-6)
    _, _, batch = doors.call(
        "/predict", {"inputs": [[TEXTS[0]], [TEXTS[1]]], "model": "classifier"}
    )
    assert len(batch) == 2 and batch[0] == single
    _, _, raw = doors.call(
        "/predict", {"inputs": TEXTS[0], "model": "classifier", "raw_scores": True}
    )
    raw_by_label = {p["label"]: p["score"] for p in raw}
    np.testing.assert_allclose(
        [raw_by_label[x] for x in labels], logits[0].outputs.probs, rtol=1e-6
    )
    _, _, pairs = doors.call(
        "/predict", {"inputs": [["a query", "a doc"], ["b query", "b doc"]], "model": "cross"}
    )
    assert [p[0]["label"] for p in pairs] == ["relevance", "relevance"]
    np.testing.assert_allclose(
        [p[0]["score"] for p in pairs], [s.outputs.score for s in pair_scores], rtol=1e-6
    )
    message = assert_tei_error(
        doors.call("/predict", {"inputs": ["a", "b", "c"], "model": "classifier"}),
        422,
        "Validation",
    )
    assert "pair" in message


def test_inference_client_text_classification_with_its_parameters(doors: DoorsServer) -> None:
    """huggingface_hub's text_classification, pointed at a model by ?model= in the URL:
    every label, best first; top_k and function_to_apply as the Inference API has them."""
    client = InferenceClient(model=doors.url("/?model=classifier"), token=KEY)
    with doors.grpc() as grpc_client:
        [probs] = grpc_client.classify([TEXTS[0]], model="classifier")
        [raw] = grpc_client.classify(
            [TEXTS[0]], model="classifier", pooling_params=PoolingParams(False)
        )
    labels = ["negative", "neutral", "positive"]

    def by_label(elements: list) -> list[float]:
        scores = {e.label: e.score for e in elements}
        assert set(scores) <= set(labels)
        return [scores[x] for x in labels if x in scores]

    every = client.text_classification(TEXTS[0])
    assert len(every) == 3 and [e.score for e in every] == sorted(
        (e.score for e in every), reverse=True
    )
    np.testing.assert_allclose(by_label(every), probs.outputs.probs, rtol=1e-6)
    [best] = client.text_classification(TEXTS[0], top_k=1)
    assert (best.label, best.score) == (every[0].label, every[0].score)
    logits = np.asarray(raw.outputs.probs, dtype=np.float64)
    none = client.text_classification(TEXTS[0], function_to_apply="none")
    np.testing.assert_allclose(by_label(none), logits, rtol=1e-6)
    sigmoid = client.text_classification(TEXTS[0], function_to_apply="sigmoid")
    np.testing.assert_allclose(by_label(sigmoid), 1 / (1 + np.exp(-logits)), rtol=1e-6)
    # TEI's own shape without the Inference API's parameters: the flat list.
    _, _, flat = doors.call("/predict?model=classifier", {"inputs": TEXTS[0]})
    assert [p["label"] for p in flat] == [e.label for e in every]
    refused = doors.call(
        "/predict", {"inputs": "x", "model": "classifier", "parameters": {"top_k": 0}}
    )
    assert "top_k" in assert_tei_error(refused, 422, "Validation")


def test_rerank_tei_shape_and_the_cohere_shape_on_one_path(doors: DoorsServer) -> None:
    documents = ["cats purr", "dogs bark", "the stock market fell"]
    body = {"query": "pets", "texts": documents, "return_text": True, "model": "cross"}
    status, _, ranks = doors.call("/rerank", body)
    assert status == 200
    with doors.grpc() as client:
        expected = client.rerank("pets", documents, model="cross")
    assert [r["index"] for r in ranks] == [r.index for r in expected.results]
    np.testing.assert_allclose(
        [r["score"] for r in ranks], [r.relevance_score for r in expected.results], rtol=1e-6
    )
    assert [r["text"] for r in ranks] == [documents[r["index"]] for r in ranks]
    _, _, plain = doors.call("/rerank", {"query": "pets", "texts": documents, "model": "cross"})
    assert all(set(r) == {"index", "score"} for r in plain)
    # The Cohere/Jina body (documents) on the same path keeps its own shape.
    status, _, cohere = doors.call(
        "/rerank", {"query": "pets", "documents": documents, "model": "cross"}
    )
    assert status == 200 and [r["index"] for r in cohere["results"]] == [r["index"] for r in ranks]
    assert_tei_error(
        doors.call("/rerank", {"query": "q", "texts": [], "model": "cross"}), 400, "Empty"
    )


def test_tokenize_and_decode(doors: DoorsServer) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    status, _, [tokens] = doors.call("/tokenize", {"inputs": "Hello world"})
    assert status == 200
    assert [t["id"] for t in tokens] == tokenizer("Hello world")["input_ids"]
    assert tokens[0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
    assert tokens[1] == {"id": 7592, "text": "Hello", "special": False, "start": 0, "stop": 5}
    _, _, [prompted] = doors.call("/tokenize", {"inputs": ["Hello"], "prompt_name": "query"})
    assert [t["text"] for t in prompted[1:3]] == ["query", ":"]
    _, _, [bare] = doors.call("/tokenize", {"inputs": "Hello", "add_special_tokens": False})
    assert [t["special"] for t in bare] == [False]
    ids = [t["id"] for t in tokens]
    status, _, texts = doors.call("/decode", {"ids": ids})
    assert status == 200 and texts == ["hello world"]
    _, _, both = doors.call("/decode", {"ids": [ids, ids], "skip_special_tokens": False})
    assert both == ["[CLS] hello world [SEP]"] * 2
    assert "ids[0]" in assert_tei_error(doors.call("/decode", {"ids": [10**9]}), 422, "Tokenizer")
    assert_tei_error(doors.call("/decode", {"ids": []}), 400, "Empty")
    assert_tei_error(
        doors.call("/tokenize", {"inputs": "x", "prompt_name": "nope"}), 422, "Validation"
    )


def test_info(doors: DoorsServer) -> None:
    status, _, info = doors.call("/info")
    assert status == 200
    required = {
        "model_id",
        "model_dtype",
        "served_model_name",
        "model_type",
        "max_concurrent_requests",
        "max_input_length",
        "max_batch_tokens",
        "max_client_batch_size",
        "auto_truncate",
        "tokenization_workers",
        "version",
    }
    assert required <= set(info)
    assert info["model_id"] == "embedder" and info["model_type"] == {
        "embedding": {"pooling": "mean"}
    }
    assert (
        info["max_input_length"] == 128 and info["max_client_batch_size"] == MAX_CLIENT_BATCH_SIZE
    )
    assert info["model_dtype"] == "float32" and info["auto_truncate"] is False
    _, _, classifier = doors.call("/info?model=classifier")
    labels = classifier["model_type"]["classifier"]
    assert labels["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
    _, _, cross = doors.call("/info?model=cross")
    assert cross["model_type"]["reranker"]["label2id"] == {"relevance": 0}


def test_root_routes_by_model_kind(doors: DoorsServer) -> None:
    _, _, embedded = doors.call("/", {"inputs": TEXTS})
    assert np.array(embedded).shape == (3, 32)
    _, _, predicted = doors.call("/", {"inputs": TEXTS[0], "model": "classifier"})
    assert {"score", "label"} == set(predicted[0])
    _, _, ranked = doors.call("/", {"query": "q", "texts": ["a", "b"], "model": "cross"})
    assert sorted(r["index"] for r in ranked) == [0, 1]
    _, _, similar = doors.call("/", {"inputs": {"source_sentence": "a", "sentences": ["a", "b"]}})
    assert len(similar) == 2 and similar[0] == pytest.approx(1.0, abs=1e-5)


@pytest.mark.parametrize(
    ("path", "body", "status", "error_type", "mentions"),
    [
        ("/embed", {"inputs": []}, 400, "Empty", "inputs"),
        ("/embed", {"inputs": ["x"] * (MAX_CLIENT_BATCH_SIZE + 1)}, 413, "Validation", "17"),
        ("/embed", {"inputs": "x", "normalize": "yes"}, 422, "Validation", "normalize"),
        ("/embed", {"inputs": [1, 2, 3]}, 422, "Validation", "token-id"),
        ("/embed", {"inputs": "x", "dimensions": 8}, 422, "Validation", "dimensions"),
        ("/embed", {"inputs": "x", "truncation_direction": "up"}, 422, "Validation", "Left"),
        ("/embed", {"inputs": "x", "prompt_name": "nope"}, 422, "Validation", "nope"),
        ("/embed", {"inputs": "x", "model": "nope"}, 422, "Validation", "nope"),
        ("/embed", {"text": "x"}, 422, "Validation", "inputs"),
        ("/embed", [1], 422, "Validation", "body"),
        ("/predict", {"inputs": "x"}, 424, "Backend", "classify"),
        (
            "/predict",
            {"model": "classifier", "inputs": [["a", 1]]},
            422,
            "Validation",
            "inputs[0][1]",
        ),
        ("/decode", {"ids": [1.5]}, 422, "Validation", "ids[0]"),
        # With TEI's advice: its truncate is a boolean.
        ("/embed_all", {"inputs": ["x " * 1000]}, 422, "Tokenizer", "set truncate to true"),
        ("/rerank", {"query": 3, "texts": ["a"]}, 422, "Validation", "query"),
        ("/similarity", {"inputs": {"source_sentence": "a", "sentences": []}}, 400, "Empty", ""),
        ("/tokenize", {"inputs": []}, 400, "Empty", "inputs"),
    ],
)
def test_errors_in_tei_shape(
    doors: DoorsServer, path: str, body: object, status: int, error_type: str, mentions: str
) -> None:
    message = assert_tei_error(doors.call(path, body), status, error_type)
    assert mentions in message


def test_malformed_json_and_auth(doors: DoorsServer) -> None:
    assert_tei_error(doors.call("/embed", raw=b"{not json"), 422, "Validation")
    # Bytes that are not UTF-8 inside a string: the client's 422, on every route.
    for path in ("/embed", "/predict", "/tokenize"):
        raw = b'{"model": "classifier", "inputs": "\xc3("}'
        message = assert_tei_error(doors.call(path, raw=raw), 422, "Validation")
        assert "UTF-8" in message or "string" in message, (path, message)
    status, _, _ = doors.call("/embed", {"inputs": "x"}, key=None)
    assert status == 401
    status, _, _ = doors.call("/info", key="wrong")
    assert status == 401


def test_metrics_count_the_status_tei_answered(doors: DoorsServer) -> None:
    """The runner labels a TEI call with TEI's status (422 for an over-long input, 424 for a
    task the model lacks), not the generic HTTP one (400, 412) of service/errors.py."""

    def count(code: str) -> float:
        samples = scrape(doors.metrics_port)
        return metric_sum(samples, "pooling_requests_total", protocol="http", code=code)

    before = {code: count(code) for code in ("422", "424", "400", "412")}
    assert_tei_error(doors.call("/embed", {"inputs": [LONG]}), 422, "Tokenizer")
    assert_tei_error(doors.call("/embed_sparse", {"inputs": "x"}), 424, "Backend")
    after = {code: count(code) for code in before}
    assert after["422"] - before["422"] == 1
    assert after["424"] - before["424"] == 1
    assert after["400"] == before["400"] and after["412"] == before["412"]


def test_door_refusals_are_counted_with_their_status(doors: DoorsServer) -> None:
    """A refusal the door makes before the engine sees the request (a body that is not
    JSON, a bad field, no key) is a PoolingError like any other: counted with the status
    the family answered, the route's operation, task "none" and model "unknown"."""

    def count(code: str) -> float:
        samples = scrape(doors.metrics_port)
        return metric_sum(
            samples, "pooling_requests_total", protocol="http", task="none", rpc="Pool", code=code
        )

    before = {code: count(code) for code in ("400", "401", "422")}
    status, _, body = doors.call("/v1/embeddings", raw=b"{not json")
    assert (status, body["error"]["reason"]) == (400, "MALFORMED_REQUEST")
    assert_tei_error(doors.call("/embed", raw=b"{not json"), 422, "Validation")
    status, _, body = doors.call("/v2/embed", {"texts": ["x"], "truncate": "MIDDLE"})
    assert status == 400 and body["message"].startswith("invalid request: truncate"), body
    status, _, body = doors.call("/embed", {"inputs": "x"}, key=None)
    assert status == 401 and body["error_type"] == "Validation", body
    after = {code: count(code) for code in before}
    assert after["400"] - before["400"] == 2
    assert after["422"] - before["422"] == 1
    assert after["401"] - before["401"] == 1
