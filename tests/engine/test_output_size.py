"""The answer-size estimates (engine/requests/output_size.py) and the rules built on them: near the
real message size, and refusals with the estimate, the limit and the field path."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import numpy as np
import pytest

from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.engine.inputs.tokenization import Vocabulary
from pooling_server.engine.requests.character_rules import validate_tokenize
from pooling_server.engine.requests.output_size import (
    GRPC_BUDGET,
    ResponseBudget,
    fewest_tokens,
    pooled_bytes,
    token_rows_bytes,
    tokenize_bytes,
)
from pooling_server.engine.requests.outputs import Embedding, PoolResult, TokenRows
from pooling_server.engine.requests.params import OutputEncoding, PoolingParams, Task
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.requests.size_rules import check_token_output, check_tokenize_output
from pooling_server.engine.requests.validation import validate_request
from pooling_server.engine.scheduling.engine import Tokenized, TokenizedText
from pooling_server.service.grpc import convert
from pooling_server.service.http.token_json import tokenize_json
from tests.model_infos import embedder_info

info = partial(embedder_info, hidden_size=384, max_input_tokens=512)


def token_result(rows: list[int], width: int, text_chars: int) -> PoolResult:
    """token_embed outputs of `rows` tokens each, offsets spread over `text_chars`."""
    outputs = []
    for n in rows:
        step = max(text_chars // max(n, 1), 1)
        offsets = [(i * step, i * step + step) for i in range(n)]
        outputs.append(
            TokenRows(
                np.random.default_rng(0).standard_normal((n, width), dtype=np.float32),
                [1000 + i % 20000 for i in range(n)],
                offsets,
                [False] * n,
            )
        )
    return PoolResult("r", "m", Task.TOKEN_EMBED, sum(rows), outputs)


@pytest.mark.parametrize(("rows", "width"), [([5] * 64, 384), ([510] * 4, 384), ([40] * 8, 32)])
def test_token_estimate_is_near_the_message_size(rows: list[int], width: int) -> None:
    real = convert.response_to_proto(token_result(rows, width, 2000)).ByteSize()
    estimate = token_rows_bytes(
        Task.TOKEN_EMBED, rows, info(hidden_size=width), None, OutputEncoding.FLOAT, GRPC_BUDGET
    )
    assert 0.9 * real <= estimate <= 1.1 * real, (estimate, real)


def test_embed_estimate_is_near_the_message_size() -> None:
    vectors = [Embedding(np.ones(384, dtype=np.float32)) for _ in range(100)]
    real = convert.response_to_proto(PoolResult("r", "m", Task.EMBED, 100, vectors)).ByteSize()
    estimate = pooled_bytes(Task.EMBED, 100, info(), None, OutputEncoding.FLOAT, GRPC_BUDGET)
    assert 0.95 * real <= estimate <= 1.05 * real, (estimate, real)


def test_tokenize_estimate_is_near_the_message_size() -> None:
    """Short English-like tokens over a long text: the estimate is not above the real size."""
    items = [
        TokenizedText(
            2000 + np.arange(n) % 5000,
            np.stack([5 * np.arange(n), 5 * np.arange(n) + 4], axis=1),
            np.zeros(n, dtype=bool),
        )
        for n in (100, 5000, 60000)
    ]
    vocabulary = Vocabulary.of(["word"] * 8000)
    tokenized = Tokenized(info(), ["x"] * len(items), items, vocabulary)
    real = len(convert.tokenize_response(tokenized, GRPC_BUDGET))
    estimate = tokenize_bytes([(len(item.token_ids), 5 * len(item.token_ids)) for item in items])
    assert 0.7 * real <= estimate <= real, (estimate, real)


def test_compact_encodings_count_their_own_width() -> None:
    floats = pooled_bytes(Task.EMBED, 10, info(), None, OutputEncoding.FLOAT, GRPC_BUDGET)
    binary = pooled_bytes(Task.EMBED, 10, info(), None, OutputEncoding.UBINARY, GRPC_BUDGET)
    assert binary < floats / 10
    json = ResponseBudget(float_bytes=21, encodings=False)  # JSON has floats only
    assert pooled_bytes(Task.EMBED, 10, info(), 64, OutputEncoding.UBINARY, json) > 10 * 64 * 21


def test_pooled_refusal_names_estimate_limit_and_path() -> None:
    small = Limits(response=ResponseBudget(max_bytes=100_000))
    request = PoolRequest(task=Task.EMBED, texts=("a",) * 100)  # 100 x 384 floats: 154 KB
    with pytest.raises(PoolingError) as caught:
        validate_request(request, info(), small)
    error = caught.value
    assert error.kind is ErrorKind.INVALID_ARGUMENT and error.reason == "OUTPUT_TOO_LARGE"
    assert [v.field for v in error.violations] == ["embed.texts"]
    assert "100000 bytes" in error.message and "--max-message-mb" in error.message
    # Fewer dimensions fit.
    dims = PoolRequest(task=Task.EMBED, texts=("a",) * 100, params=PoolingParams(dimensions=64))
    validate_request(dims, info(is_matryoshka=True), small)


def test_request_budget_overrides_the_engines() -> None:
    http = ResponseBudget(max_bytes=1000, setting="--max-http-response-mb", float_bytes=21)
    request = PoolRequest(task=Task.EMBED, texts=("a",), response_budget=http)
    with pytest.raises(PoolingError, match="max-http-response-mb"):
        validate_request(request, info(), Limits())
    validate_request(PoolRequest(task=Task.EMBED, texts=("a",)), info(), Limits())


def test_token_outputs_are_checked_on_their_token_counts() -> None:
    """Before tokenizing only the special tokens are certain; the counts decide after."""
    limits = Limits(response=ResponseBudget(max_bytes=1_000_000))
    request = PoolRequest(task=Task.TOKEN_EMBED, texts=("some text",) * 100)
    validate_request(request, info(), limits)  # 100 x 3 rows: fits
    check_token_output(request, info(), limits, [100] * 6)
    with pytest.raises(PoolingError) as caught:
        check_token_output(request, info(), limits, [100] * 100)  # 10,000 rows x 1.5 KB
    assert caught.value.reason == "OUTPUT_TOO_LARGE"
    assert caught.value.metadata["limit_bytes"] == "1000000"
    assert int(caught.value.metadata["estimated_bytes"]) > 15_000_000


def test_tokenize_is_refused_on_its_characters_before_tokenizing() -> None:
    """16 texts of 262,144 characters: legal, but their tokens cannot fit in 16 MiB."""
    texts = ["a " * 131072] * 16
    with pytest.raises(PoolingError) as caught:
        validate_tokenize(texts, info(), Limits())
    assert caught.value.reason == "OUTPUT_TOO_LARGE"
    assert [v.field for v in caught.value.violations] == ["texts"]
    validate_tokenize(["a " * 131072], info(), Limits())  # one of them fits
    with pytest.raises(PoolingError):
        check_tokenize_output([(2_000_000, 4_000_000)], Limits())


def test_fewest_tokens_counts_words_and_specials_up_to_the_cap() -> None:
    assert fewest_tokens(["two words", "", "a b c d e"], 2, None) == [4, 2, 7]
    assert fewest_tokens(["a b c d e"], 2, 5) == [5]


def test_token_outputs_are_refused_on_their_words_before_tokenizing() -> None:
    """1,024 texts of 150 words: at least 150 rows of 384 floats each, 240 MB."""
    request = PoolRequest(task=Task.TOKEN_EMBED, texts=(" ".join(["word"] * 150),) * 1024)
    with pytest.raises(PoolingError) as caught:
        validate_request(request, info(), Limits())
    assert caught.value.reason == "OUTPUT_TOO_LARGE"
    assert [v.field for v in caught.value.violations] == ["token_embed.texts"]
    # Truncated to 8 tokens each, they fit.
    truncated = PoolRequest(
        task=Task.TOKEN_EMBED,
        texts=request.texts,
        params=PoolingParams(truncate_prompt_tokens=8),
    )
    validate_request(truncated, info(), Limits())
    # One long word per text: its tokens are unknown until tokenized, so it is not refused.
    validate_request(
        PoolRequest(task=Task.TOKEN_EMBED, texts=("x" * 900,) * 1024), info(), Limits()
    )


def test_tokenize_json_estimate_is_not_above_the_answer() -> None:
    """TEI's /tokenize answer: the per-token floor (JSON_TOKEN_BYTES) stays under the real
    size, which the door counts exactly (and refuses on) before building it."""
    n = 5000
    items = [
        TokenizedText(
            np.arange(n) % 10, np.stack([np.zeros(n, int), np.ones(n, int)], 1), np.zeros(n, bool)
        )
    ]
    vocabulary = Vocabulary.of(["a"] * 10)
    json_budget = ResponseBudget(max_bytes=64 << 20, encodings=False)
    answer = tokenize_json(Tokenized(info(), ["a"], items, vocabulary), json_budget)
    estimate = tokenize_bytes([(n, 1)], json_budget)
    assert estimate <= len(answer) <= 1.1 * estimate, (estimate, len(answer))
    with pytest.raises(PoolingError) as refused:
        tokenize_json(
            Tokenized(info(), ["a"], items, vocabulary), replace(json_budget, max_bytes=1000)
        )
    assert refused.value.reason == "OUTPUT_TOO_LARGE"
