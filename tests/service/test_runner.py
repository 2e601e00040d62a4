"""Every operation through the request runner, seen from HTTP (the doors' real server).

TEI's /tokenize and /decode and OpenAI's /v1/models are counted in /metrics under their
operation with the status the client got, like Pool; a /tokenize answer past
--max-http-response-mb (4 MB on this server) is refused 413, naming that cap, once its
tokens are counted exactly, and one under it is the tokenizer's ids.
"""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from tests.fixture_models import MINILM
from tests.metrics_endpoint import metric_growth, scrape
from tests.service.doors_server import DoorsServer

pytestmark = pytest.mark.timeout(300)


def test_tokenize_decode_and_models_are_counted_with_their_status(doors: DoorsServer) -> None:
    before = scrape(doors.metrics_port)
    assert doors.call("/tokenize", {"inputs": ["one", "two"]})[0] == 200
    assert doors.call("/decode", {"ids": [101, 7592, 102]})[0] == 200
    assert doors.call("/decode", {"ids": [10**9]})[0] == 422
    assert doors.call("/v1/models")[0] == 200
    after = scrape(doors.metrics_port)

    delta = metric_growth(before, after, "pooling_requests_total")
    http = {"protocol": "http"}
    assert delta(rpc="Tokenize", code="200", model="embedder", task="tokenize", **http) == 1
    assert delta(rpc="Decode", code="200", model="embedder", task="decode", **http) == 1
    assert delta(rpc="Decode", code="422", model="embedder", **http) == 1
    assert delta(rpc="ListModels", code="200", model="none", **http) == 1


def test_tokenize_past_the_response_cap_is_refused_naming_it(doors: DoorsServer) -> None:
    """Two texts of 65,538 CJK characters: one word each, which the word-count floor lets
    through, but a token per character: about 9 MB of JSON over the 4 MB cap."""
    texts = ["東京大" * 21846] * 2
    status, _, body = doors.call("/tokenize", {"inputs": texts})
    assert status == 413, body
    assert body["error_type"] == "Validation"
    assert "--max-http-response-mb" in body["error"]
    # A twentieth of one is served, each token as the tokenizer has it.
    short = texts[0][:3000]
    status, _, [tokens] = doors.call("/tokenize", {"inputs": short})
    assert status == 200
    reference = AutoTokenizer.from_pretrained(MINILM)
    assert [token["id"] for token in tokens] == reference(short)["input_ids"]
    assert "".join(token["text"] for token in tokens if not token["special"]) == short


def test_tokenize_answer_is_the_tokenizers_spans_as_tei_writes_them(doors: DoorsServer) -> None:
    """Laid out byte by byte (service/http/token_json.py), the answer reads as TEI's: each
    token's id, its span of the text (escapes, non-ASCII and all), or, for a special token,
    the token itself and null offsets."""
    texts = ['say "hi" \\ there\n\ttab \x01 東京 😀 é', "", "plain words"]
    status, _, answer = doors.call("/tokenize", {"inputs": texts})
    assert status == 200
    reference = AutoTokenizer.from_pretrained(MINILM)
    for text, tokens in zip(texts, answer, strict=True):
        encoded = reference(text, return_offsets_mapping=True, return_special_tokens_mask=True)
        names = reference.convert_ids_to_tokens(encoded["input_ids"])
        expected = [
            {
                "id": token_id,
                "text": name if special else text[start:stop],
                "special": bool(special),
                "start": None if special else start,
                "stop": None if special else stop,
            }
            for token_id, name, special, (start, stop) in zip(
                encoded["input_ids"],
                names,
                encoded["special_tokens_mask"],
                encoded["offset_mapping"],
                strict=True,
            )
        ]
        assert tokens == expected
