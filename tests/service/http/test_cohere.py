"""Cohere's /v2/embed and /v2/rerank on a real server, through the official cohere SDK:
results equal the gRPC ones from the same server (input_type mapped onto the model's
prompts, float and compact embedding types), and Cohere's error shape."""

from __future__ import annotations

import base64

import cohere
import numpy as np
import pytest
from cohere.core.api_error import ApiError
from transformers import AutoTokenizer

from tests.fixture_models import MINILM
from tests.service.doors_server import KEY, DoorsServer

TEXTS = ["the cat sat on the mat", "a quick brown fox", "pooling over http"]
LONG = " ".join(f"word{i}" for i in range(400))


@pytest.fixture(scope="module")
def co(doors: DoorsServer) -> cohere.ClientV2:
    return cohere.ClientV2(api_key=KEY, base_url=doors.url())


def grpc_vectors(doors: DoorsServer, texts: list[str], **kwargs: object) -> np.ndarray:
    with doors.grpc() as client:
        results = client.embed(texts, model="embedder", **kwargs)
    return np.array([r.outputs.embedding for r in results])


def test_embed_float_and_int8_with_input_type_prompts(
    doors: DoorsServer, co: cohere.ClientV2
) -> None:
    response = co.embed(
        model="embedder",
        texts=TEXTS,
        input_type="search_query",
        embedding_types=["float", "int8"],
    )
    assert response.response_type == "embeddings_by_type" and response.texts == TEXTS
    assert response.meta.billed_units.input_tokens > 0
    np.testing.assert_array_equal(
        np.array(response.embeddings.float_, dtype=np.float32),
        grpc_vectors(doors, TEXTS, prompt_name="query").astype(np.float32),
    )
    np.testing.assert_array_equal(
        response.embeddings.int8, grpc_vectors(doors, TEXTS, prompt_name="query", encoding="int8")
    )
    # search_document takes the "document" prompt; classification finds none and uses no
    # prompt; clustering is mapped onto "document" by the server's flag.
    document = co.embed(model="embedder", texts=TEXTS, input_type="search_document")
    expected = grpc_vectors(doors, TEXTS, prompt_name="document").astype(np.float32)
    np.testing.assert_array_equal(np.array(document.embeddings.float_, np.float32), expected)
    clustering = co.embed(model="embedder", texts=TEXTS, input_type="clustering")
    np.testing.assert_array_equal(np.array(clustering.embeddings.float_, np.float32), expected)
    plain = co.embed(model="embedder", texts=TEXTS, input_type="classification")
    np.testing.assert_array_equal(
        np.array(plain.embeddings.float_, np.float32),
        grpc_vectors(doors, TEXTS).astype(np.float32),
    )
    assert not np.allclose(expected, np.array(plain.embeddings.float_))


def test_embed_other_types_truncation_and_inputs(doors: DoorsServer, co: cohere.ClientV2) -> None:
    response = co.embed(
        model="embedder",
        texts=TEXTS,
        input_type="search_query",
        embedding_types=["uint8", "binary", "ubinary", "base64"],
    )
    for name in ("uint8", "binary", "ubinary"):
        np.testing.assert_array_equal(
            getattr(response.embeddings, name),
            grpc_vectors(doors, TEXTS, prompt_name="query", encoding=name),
        )
    assert len(response.embeddings.binary[0]) == 4  # 32 dimensions, one bit each
    floats = np.array(
        [np.frombuffer(base64.b64decode(s), dtype="<f4") for s in response.embeddings.base64]
    )
    np.testing.assert_array_equal(floats, grpc_vectors(doors, TEXTS, prompt_name="query"))
    # Cohere truncates the end by default; START cuts the beginning; NONE refuses.
    end = co.embed(model="embedder", texts=[LONG], input_type="classification")
    start = co.embed(model="embedder", texts=[LONG], input_type="classification", truncate="START")
    np.testing.assert_array_equal(
        np.array(end.embeddings.float_, np.float32),
        grpc_vectors(doors, [LONG], truncate_prompt_tokens=-1).astype(np.float32),
    )
    assert not np.allclose(end.embeddings.float_, start.embeddings.float_)
    with pytest.raises(ApiError) as refused:
        co.embed(model="embedder", texts=[LONG], input_type="classification", truncate="NONE")
    assert refused.value.status_code == 400
    assert refused.value.body["reason"] == "INPUT_TOO_LONG"
    assert "texts[0]" in refused.value.body["message"]
    short = co.embed(model="embedder", texts=[LONG], input_type="classification", max_tokens=16)
    np.testing.assert_array_equal(
        np.array(short.embeddings.float_, np.float32),
        grpc_vectors(doors, [LONG], truncate_prompt_tokens=16).astype(np.float32),
    )
    # max_tokens is a ceiling: past the model's maximum it is the maximum.
    ceiling = co.embed(
        model="embedder", texts=[LONG], input_type="classification", max_tokens=10**6
    )
    assert ceiling.embeddings.float_ == end.embeddings.float_
    # truncate NONE with max_tokens refuses a longer input, and serves one that fits.
    with pytest.raises(ApiError) as over:
        co.embed(
            model="embedder",
            texts=["short", TEXTS[0]],
            input_type="classification",
            truncate="NONE",
            max_tokens=4,
        )
    assert over.value.status_code == 400 and "texts[1]" in over.value.body["message"]
    assert "max_tokens" in over.value.body["message"]
    fits = co.embed(
        model="embedder",
        texts=TEXTS[:1],
        input_type="classification",
        truncate="NONE",
        max_tokens=64,
    )
    np.testing.assert_array_equal(
        np.array(fits.embeddings.float_, np.float32),
        grpc_vectors(doors, TEXTS[:1]).astype(np.float32),
    )
    status, _, body = doors.call(
        "/v2/embed",
        {
            "model": "embedder",
            "input_type": "classification",
            "inputs": [{"content": [{"type": "text", "text": TEXTS[0]}]}],
        },
    )
    assert status == 200
    np.testing.assert_array_equal(
        np.array(body["embeddings"]["float"], np.float32),
        grpc_vectors(doors, TEXTS[:1]).astype(np.float32),
    )


def test_rerank_equals_grpc(doors: DoorsServer, co: cohere.ClientV2) -> None:
    documents = ["cats purr", "dogs bark", "the stock market fell", "birds sing"]
    response = co.rerank(model="cross", query="pets", documents=documents, top_n=2)
    with doors.grpc() as client:
        expected = client.rerank("pets", documents, model="cross", top_n=2)
    assert [r.index for r in response.results] == [r.index for r in expected.results]
    np.testing.assert_allclose(
        [r.relevance_score for r in response.results],
        [r.relevance_score for r in expected.results],
        rtol=1e-6,
    )
    assert response.id and response.meta.billed_units.search_units == 1
    # max_tokens_per_doc cuts each document after its first tokens; the query is not counted.
    capped = co.rerank(model="cross", query="pets", documents=[LONG], max_tokens_per_doc=16)
    ends = AutoTokenizer.from_pretrained(MINILM)(
        LONG, add_special_tokens=False, return_offsets_mapping=True
    )["offset_mapping"]
    with doors.grpc() as client:
        cut = client.rerank("pets", [LONG[: ends[15][1]]], model="cross")
        whole = client.rerank("pets", [LONG], model="cross", truncate_prompt_tokens=-1)
    assert capped.results[0].relevance_score == pytest.approx(
        cut.results[0].relevance_score, rel=1e-6
    )
    assert capped.results[0].relevance_score != pytest.approx(whole.results[0].relevance_score)
    query = "what is the capital city of france and germany, and which river runs through it"
    short = ["paris", "berlin", "rome"]
    uncapped = co.rerank(model="cross", query=query, documents=short)
    kept = co.rerank(model="cross", query=query, documents=short, max_tokens_per_doc=3)
    assert [(r.index, r.relevance_score) for r in kept.results] == [
        (r.index, r.relevance_score) for r in uncapped.results
    ]


@pytest.mark.parametrize(
    ("body", "status", "mentions"),
    [
        ({"model": "nope", "texts": ["x"], "input_type": "search_query"}, 404, "nope"),
        ({"model": "embedder", "input_type": "search_query"}, 400, "texts"),
        ({"model": "embedder", "texts": ["x"], "input_type": "poetry"}, 400, "input_type"),
        ({"model": "embedder", "texts": ["x"], "embedding_types": ["int4"]}, 400, "int4"),
        ({"model": "embedder", "texts": ["x"], "truncate": "MIDDLE"}, 400, "truncate"),
        ({"model": "embedder", "texts": ["x"], "output_dimension": 8}, 400, "output_dimension"),
        ({"model": "embedder", "texts": ["x"], "images": ["data:image/png;base64,AA"]}, 400, ""),
        ({"model": "embedder", "texts": "x" * 3, "max_tokens": "ten"}, 400, "max_tokens"),
        ({"model": "embedder", "texts": ["x"] * 17}, 400, "17"),  # as Cohere: over 96
        ({"model": "classifier", "texts": ["x"]}, 400, "embed"),
        ({"model": "embedder", "inputs": [{"content": []}]}, 400, "inputs[0].content"),
        (
            {
                "model": "embedder",
                "texts": ["x"],
                "inputs": [{"content": [{"type": "text", "text": "y"}]}],
            },
            400,
            "not both",
        ),
    ],
)
def test_embed_errors_in_cohere_shape(
    doors: DoorsServer, body: dict, status: int, mentions: str
) -> None:
    code, _, answer = doors.call("/v2/embed", body)
    assert code == status, answer
    assert {"id", "message"} <= set(answer) and mentions in answer["message"], answer


def test_rerank_errors_and_auth(doors: DoorsServer) -> None:
    code, _, answer = doors.call("/v2/rerank", {"model": "cross", "query": "q"})
    assert code == 400 and "documents" in answer["message"]
    code, _, answer = doors.call(
        "/v2/rerank", {"model": "cross", "query": "q", "documents": ["a"], "top_n": 0}
    )
    assert code == 400 and "top_n" in answer["message"]
    with pytest.raises(ApiError) as refused:
        cohere.ClientV2(api_key="wrong", base_url=doors.url()).rerank(
            model="cross", query="q", documents=["a"]
        )
    assert refused.value.status_code == 401
