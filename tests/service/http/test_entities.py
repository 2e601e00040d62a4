"""Hugging Face's token classification on TEI's root route (service/http/entities.py):
huggingface_hub's InferenceClient.token_classification against the shared doors server
equals transformers' token-classification pipeline on the same folder, for every
aggregation strategy, on a WordPiece tokenizer ("##" pieces) and a byte-level BPE (pieces
told by spaces); ignore_labels, lists of texts, and the refusals."""

from __future__ import annotations

from typing import Any

import pytest
from huggingface_hub import InferenceClient
from transformers import pipeline

from pooling_server.service.http.entities import AGGREGATIONS
from tests.service.doors_server import KEY, DoorsServer

TEXTS = [
    "Johnsonville Smithereens moved to Parisianopolis with Mary-Ann O'Neil in 1999.",
    "zebras and 🦜 parrots: Kraków, São Paulo, and the Rhine-Main area",
]
MODELS = ("ner", "ner-bpe")


def expected(doors: DoorsServer, model: str, text: str, **kwargs: Any) -> list[dict[str, Any]]:
    classify = pipeline("token-classification", model=str(doors.folders[model]), device="cpu")
    return classify(text, **kwargs)


def assert_same(got: list[Any], want: list[dict[str, Any]]) -> None:
    assert len(got) == len(want), (got, want)
    for ours, theirs in zip(got, want, strict=True):
        ours = {k: v for k, v in dict(ours).items() if v is not None}
        assert ours.keys() == theirs.keys(), (ours, theirs)
        for key, value in theirs.items():
            if key == "score":
                assert ours[key] == pytest.approx(float(value), abs=1e-5), (ours, theirs)
            else:
                assert ours[key] == value, (key, ours, theirs)


@pytest.mark.parametrize("model", MODELS)
def test_inference_client_equals_the_pipeline(doors: DoorsServer, model: str) -> None:
    client = InferenceClient(model=doors.url(f"/?model={model}"), token=KEY)
    for text in TEXTS:
        for aggregation in AGGREGATIONS:
            got = client.token_classification(text, aggregation_strategy=aggregation)  # type: ignore[arg-type]
            want = expected(doors, model, text, aggregation_strategy=aggregation)
            assert_same([vars(element) for element in got], want)
            assert want, "the random model tags nothing: the comparison would be empty"
        # Hugging Face's hosted default groups entities (simple); nothing ignored keeps "O".
        assert_same(
            [vars(e) for e in client.token_classification(text)],
            expected(doors, model, text, aggregation_strategy="simple"),
        )
        kept = client.token_classification(text, aggregation_strategy="none", ignore_labels=[])
        everything = expected(doors, model, text, aggregation_strategy="none", ignore_labels=[])
        assert_same([vars(e) for e in kept], everything)
        assert any(e["entity"] == "O" for e in everything)


def test_a_list_of_texts_gets_a_list_each(doors: DoorsServer) -> None:
    status, _, answer = doors.call("/", {"model": "ner", "inputs": TEXTS})
    assert status == 200, answer
    for text, found in zip(TEXTS, answer, strict=True):
        assert_same(found, expected(doors, "ner", text, aggregation_strategy="simple"))


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"inputs": TEXTS[0], "parameters": {"aggregation_strategy": "mean"}}, "aggregation"),
        ({"inputs": TEXTS[0], "parameters": {"stride": 16}}, "parameters.stride"),
        ({"inputs": [], "parameters": {}}, "inputs"),
        ({"inputs": TEXTS[0], "parameters": {"ignore_labels": "O"}}, "ignore_labels"),
        ({"inputs": " ".join(["word"] * 400)}, "inputs"),
    ],
)
def test_refusals_name_the_field(doors: DoorsServer, body: dict[str, Any], field: str) -> None:
    status, _, answer = doors.call("/", {"model": "ner", **body})
    assert 400 <= status < 500, answer
    assert set(answer) == {"error", "error_type"}, answer
    assert field in answer["error"], answer
