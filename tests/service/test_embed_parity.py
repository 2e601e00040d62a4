"""Embeddings from the running server equal sentence-transformers on the same folder."""

from __future__ import annotations

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer

from pooling_client import PoolingClient, PoolingParams
from pooling_client.v1 import pooling_pb2, pooling_pb2_grpc
from tests.fixture_models import MINILM

SENTENCES = [
    "Hello world",
    "How are you?",
    "",
    " ",
    "The quick brown fox jumps over the lazy dog.",
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The girl is carrying a baby.",
    "A man is riding a horse.",
    "A woman is playing violin.",
    "Two men pushed carts through the woods.",
    "A man is riding a white horse on an enclosed ground.",
    "A monkey is playing drums.",
    "Someone in a gorilla costume is playing a set of drums.",
    "Zürich, Genève und Köln sind Städte.",
    "東京は日本の首都です。",
    "Привет, как дела?",
    "مرحبا بالعالم",
    "emoji 🙂🚀✨ in text",
    "naïve café résumé coöperate",
    "1234567890 3.14159 2.71828",
    "!!!???...,,,;;;:::",
    "tab\tseparated\tvalues\nand a newline",
    "UPPER CASE AND lower case",
    "a",
    "word " * 60,
    "Embeddings map text to vectors so that similar meanings land close together. " * 4,
    "The capital of France is Paris.",
    "What is the capital of France?",
    "Pooling turns token states into one vector per text.",
    "gRPC uses HTTP/2 and protocol buffers.",
    "x" * 300,
]


@pytest.fixture(scope="module")
def reference() -> SentenceTransformer:
    return SentenceTransformer(str(MINILM), device="cpu")


def _assert_close(got: np.ndarray, want: np.ndarray) -> None:
    assert got.shape == want.shape
    assert np.abs(got - want).max() < 1e-4
    cos = (got * want).sum(1) / (np.linalg.norm(got, axis=1) * np.linalg.norm(want, axis=1))
    assert cos.min() > 0.9999


def test_embeddings_match_sentence_transformers(
    client: PoolingClient, reference: SentenceTransformer
) -> None:
    outputs = client.embed(SENTENCES)
    got = np.array([o.outputs.embedding for o in outputs], dtype=np.float32)
    _assert_close(got, reference.encode(SENTENCES, convert_to_numpy=True))


def test_use_activation_false_returns_unnormalised_pooling(
    client: PoolingClient, reference: SentenceTransformer
) -> None:
    outputs = client.embed(SENTENCES, pooling_params=PoolingParams(use_activation=False))
    got = np.array([o.outputs.embedding for o in outputs], dtype=np.float32)
    # The model without its Normalize module: Transformer + Pooling only.
    raw = SentenceTransformer(modules=[reference[0], reference[1]], device="cpu")
    _assert_close(got, raw.encode(SENTENCES, convert_to_numpy=True))
    assert not np.allclose(np.linalg.norm(got, axis=1), 1.0)


@pytest.mark.parametrize(("model", "dimensions"), [("minilm-matryoshka", 64), ("minilm-dims", 128)])
def test_matryoshka_dimensions_truncate_then_renormalise(
    client: PoolingClient, reference: SentenceTransformer, model: str, dimensions: int
) -> None:
    outputs = client.embed(
        SENTENCES, model=model, pooling_params=PoolingParams(dimensions=dimensions)
    )
    got = np.array([o.outputs.embedding for o in outputs], dtype=np.float32)
    full = reference.encode(SENTENCES, convert_to_numpy=True)[:, :dimensions]
    want = full / np.linalg.norm(full, axis=1, keepdims=True)
    _assert_close(got, want)


def test_response_reports_model_and_usage(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    response = stub.Pool(
        pooling_pb2.PoolRequest(
            request_id="req-1", embed=pooling_pb2.TextInput(texts=["Hello world", "a"])
        )
    )
    assert response.request_id == "req-1"
    assert response.model == "sentence-transformers/all-MiniLM-L6-v2"
    # [CLS] hello world [SEP] + [CLS] a [SEP]
    assert response.usage.prompt_tokens == 7
    assert len(response.embed.embeddings) == 2
