"""Late chunking (engine/requests/late_chunking.py): each chunk's vector equals the mean of the
chunk's token_embed rows over the same text, and plain transformers' on MiniLM; macro-
windows on a text past a tiny BERT's 64 positions; mixed batches; every refusal."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModel, AutoTokenizer

from pooling_server.engine.errors import PoolingError
from pooling_server.engine.models.loader import LoadedModel
from pooling_server.engine.requests.late_chunking import (
    macro_windows,
    owned,
    sentence_spans,
    token_window_spans,
)
from pooling_server.engine.requests.outputs import Embedding, ItemOutput, LateChunks, TokenRows
from pooling_server.engine.requests.params import PoolingParams, Task
from pooling_server.engine.requests.plans import plan_request
from pooling_server.engine.requests.request import ChunkRule, LateChunking, PoolRequest
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.requests.validation import validate_request
from tests.engine.planned import load, run_all
from tests.fixture_models import MINILM, tiny_mean_bert

TEXT = "Berlin is the capital of Germany. It has 3.8 million people!  The Spree runs through it."


@pytest.fixture(scope="module")
def minilm() -> LoadedModel:
    return load(MINILM)


@pytest.fixture(scope="module")
def short(tmp_path_factory: pytest.TempPathFactory) -> LoadedModel:
    return load(tiny_mean_bert(tmp_path_factory.mktemp("late") / "short-bert"))


def late(texts: Sequence[str], **chunking: object) -> PoolRequest:
    return PoolRequest(Task.EMBED, texts=tuple(texts), late_chunking=LateChunking(**chunking))


def by_rows(rows: TokenRows, spans: Sequence[tuple[int, int]]) -> np.ndarray:
    """The reference: each span's mean of token_embed rows (unnormalised) whose offsets
    overlap it, special tokens left out, then L2-normalised."""
    vectors = []
    for start, end in spans:
        keep = [
            i
            for i, (a, b) in enumerate(rows.offsets)
            if not rows.special_tokens_mask[i] and b > start and a < end
        ]
        vectors.append(rows.values[keep[0] : keep[-1] + 1].mean(axis=0))
    stacked = np.stack(vectors)
    return stacked / np.linalg.norm(stacked, axis=1, keepdims=True)


def token_rows(model: LoadedModel, text: str) -> TokenRows:
    request = PoolRequest(
        Task.TOKEN_EMBED, params=PoolingParams(use_activation=False), texts=(text,)
    )
    (rows,) = run_all(model, [request])[0]
    assert isinstance(rows, TokenRows)
    return rows


def vectors(output: ItemOutput) -> np.ndarray:
    assert isinstance(output, LateChunks)
    return np.stack([e.values for e in output.embeddings])


SPANS = [(0, 33), (34, 60), (62, 88), (0, 88), (7, 9), (3, 5)]  # edges, overlap, in a token


def test_spans_equal_token_embed_means(minilm: LoadedModel) -> None:
    (out,) = run_all(minilm, [late([TEXT], spans=tuple(SPANS))])[0]
    assert isinstance(out, LateChunks) and out.spans == SPANS
    np.testing.assert_allclose(vectors(out), by_rows(token_rows(minilm, TEXT), SPANS), atol=1e-5)


def test_whole_text_pass_equals_transformers(minilm: LoadedModel) -> None:
    """Plain transformers: one pass, mean of the chunk's hidden states, normalised."""
    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    model = AutoModel.from_pretrained(MINILM).eval()
    encoded = tokenizer(TEXT, return_offsets_mapping=True, return_tensors="pt")
    offsets = encoded.pop("offset_mapping")[0].tolist()
    with torch.no_grad():
        states = model(**encoded).last_hidden_state[0].numpy()
    expected = []
    for start, end in SPANS:
        hits = [i for i, (a, b) in enumerate(offsets) if b > a and b > start and a < end]
        mean = states[hits[0] : hits[-1] + 1].mean(axis=0)
        expected.append(mean / np.linalg.norm(mean))
    (out,) = run_all(minilm, [late([TEXT], spans=tuple(SPANS))])[0]
    np.testing.assert_allclose(vectors(out), np.stack(expected), atol=1e-5)


def test_rules(minilm: LoadedModel) -> None:
    assert sentence_spans(TEXT) == [(0, 33), (34, 60), (62, 88)]
    sentences, windows = run_all(
        minilm,
        [
            late([TEXT], rule=ChunkRule.SENTENCES),
            late([TEXT], rule=ChunkRule.TOKENS, window=5, overlap=2),
        ],
    )
    assert isinstance(sentences[0], LateChunks) and sentences[0].spans == sentence_spans(TEXT)
    rows = token_rows(minilm, TEXT)
    content = [o for o, s in zip(rows.offsets, rows.special_tokens_mask, strict=True) if not s]
    spans = token_window_spans(content, 5, 2)
    assert isinstance(windows[0], LateChunks) and windows[0].spans == spans
    np.testing.assert_allclose(vectors(windows[0]), by_rows(rows, spans), atol=1e-5)


def test_macro_windows_past_the_maximum_length(short: LoadedModel) -> None:
    """A text of ~250 tokens on a model of 64 positions: each chunk equals the mean of rows
    taken, per token, from the macro-window that owns it, computed here from token_embed
    of each window's own text."""
    text = " ".join(f"word{i % 7} sentence number {i}." for i in range(40))
    sequence = short.tokenizer.tokenize([text])[0]
    assert len(sequence) > 64
    spans = ((0, len(text)), (5, 40), (300, 420), (len(text) - 30, len(text)))
    (out,) = run_all(short, [late([text], spans=spans)])[0]
    # The reference: token states of each window, computed as a token sequence alone.
    windows = macro_windows(len(sequence), 1, 1, 64)
    assert len(windows) > 2 and all(len(w) == 62 for w in windows)
    states = np.zeros((len(sequence), short.info.hidden_size), dtype=np.float32)
    for window, own in zip(windows, owned(windows), strict=True):
        positions = [0, *window, len(sequence) - 1]
        raw = short.runner.forward([sequence.window(positions)], [True])[0]
        states[own.start : own.stop] = raw[
            1 + own.start - window.start : 1 + own.stop - window.start
        ]
    expected = []
    for start, end in spans:
        hits = [
            i
            for i in range(1, len(sequence) - 1)
            if sequence.offsets[i][1] > start and sequence.offsets[i][0] < end
        ]
        mean = states[hits[0] : hits[-1] + 1].mean(axis=0)
        expected.append(mean / np.linalg.norm(mean))
    np.testing.assert_allclose(vectors(out), np.stack(expected), atol=1e-5)
    # Owned runs tile the content exactly once.
    owns = owned(windows)
    assert owns[0].start == 1 and owns[-1].stop == len(sequence) - 1
    assert all(a.stop == b.start for a, b in itertools.pairwise(owns))


def test_mixed_batch_with_plain_embed(minilm: LoadedModel) -> None:
    plain = PoolRequest(Task.EMBED, texts=("hello there", TEXT))
    alone = run_all(minilm, [plain])[0]
    mixed = run_all(minilm, [plain, late([TEXT], spans=tuple(SPANS)), plain])
    for outputs in (mixed[0], mixed[2]):
        for got, want in zip(outputs, alone, strict=True):
            assert isinstance(got, Embedding) and isinstance(want, Embedding)
            np.testing.assert_allclose(got.values, want.values, atol=1e-5)
    np.testing.assert_allclose(
        vectors(mixed[1][0]), by_rows(token_rows(minilm, TEXT), SPANS), atol=1e-5
    )


def refusal(model: LoadedModel, request: PoolRequest) -> tuple[str, str]:
    limits = Limits()
    with pytest.raises(PoolingError) as caught:
        plan_request(validate_request(request, model.info, limits), model, limits)
    (violation,) = caught.value.violations
    return violation.field, violation.reason


@pytest.mark.parametrize(
    ("chunking", "field", "reason"),
    [
        ({"spans": ((0, 5), (80, 89))}, "late_chunking.spans[1]", "SPAN_OUT_OF_TEXT"),
        ({"spans": ((-1, 5),)}, "late_chunking.spans[0]", "SPAN_OUT_OF_TEXT"),
        ({"spans": ((4, 4),)}, "late_chunking.spans[0]", "SPAN_EMPTY"),
        ({"spans": ((9, 4),)}, "late_chunking.spans[0]", "SPAN_REVERSED"),
        ({"spans": ((33, 34),)}, "late_chunking.spans[0]", "LATE_CHUNK_NO_TOKENS"),
        ({}, "late_chunking", "LATE_CHUNKING_SHAPE"),
        ({"spans": ((0, 4),), "rule": ChunkRule.SENTENCES}, "late_chunking", "LATE_CHUNKING_SHAPE"),
        ({"rule": ChunkRule.TOKENS}, "late_chunking.window", "LATE_CHUNKING_WINDOW"),
        (
            {"rule": ChunkRule.TOKENS, "window": 4, "overlap": 4},
            "late_chunking.overlap",
            "LATE_CHUNKING_OVERLAP",
        ),
        (
            {"rule": ChunkRule.SENTENCES, "window": 4},
            "late_chunking.window",
            "LATE_CHUNKING_WINDOW",
        ),
    ],
)
def test_refusals(minilm: LoadedModel, chunking: dict, field: str, reason: str) -> None:
    assert refusal(minilm, late([TEXT], **chunking)) == (field, reason)


def test_text_without_chunks_refused(minilm: LoadedModel) -> None:
    for rule in (ChunkRule.SENTENCES, ChunkRule.TOKENS):
        request = late([TEXT, "  \n "], rule=rule, window=4 if rule is ChunkRule.TOKENS else 0)
        assert refusal(minilm, request) == ("embed.texts[1]", "LATE_CHUNKS_NONE")


def test_answer_too_large_refused_before_the_forward_pass(minilm: LoadedModel) -> None:
    """One vector per token of a long text, over a small response budget."""
    import dataclasses

    from pooling_server.engine.requests.output_size import ResponseBudget

    request = dataclasses.replace(
        late([TEXT * 4], rule=ChunkRule.TOKENS, window=1),
        response_budget=ResponseBudget(max_bytes=64 * 1024),
    )
    assert refusal(minilm, request) == ("embed.texts", "OUTPUT_TOO_LARGE")


def test_refusals_of_task_texts_and_truncation(minilm: LoadedModel) -> None:
    spans = LateChunking(spans=((0, 4),))
    token = PoolRequest(Task.TOKEN_EMBED, texts=(TEXT,), late_chunking=spans)
    assert refusal(minilm, token) == ("late_chunking", "LATE_CHUNKING_TASK")
    two = late([TEXT, TEXT], spans=((0, 4),))
    assert refusal(minilm, two) == ("late_chunking.spans", "LATE_CHUNKING_SPANS_TEXTS")
    cut = PoolRequest(
        Task.EMBED, PoolingParams(truncate_prompt_tokens=8), texts=(TEXT,), late_chunking=spans
    )
    assert refusal(minilm, cut) == ("params.truncate_prompt_tokens", "LATE_CHUNKING_TRUNCATE")


def test_refused_without_mean_pooling(tmp_path: Path, minilm: LoadedModel) -> None:
    import dataclasses

    from pooling_server.engine.models.model_info import PoolingType

    cls = dataclasses.replace(minilm.info, pooling_type=PoolingType.CLS)
    limits = Limits()
    with pytest.raises(PoolingError) as caught:
        validate_request(late([TEXT], spans=((0, 4),)), cls, limits)
    assert caught.value.violations[0].reason == "LATE_CHUNKING_POOLING"
    assert caught.value.kind.name == "FAILED_PRECONDITION"


@pytest.fixture(scope="module")
def projected(tmp_path_factory: pytest.TempPathFactory) -> tuple[LoadedModel, Path]:
    """The 64-position BERT with a tanh Dense module and Normalize, as distiluse is."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import (
        Dense,
        Normalize,
        Pooling,
        Transformer,
    )

    root = tmp_path_factory.mktemp("late-dense")
    base = tiny_mean_bert(root / "base")
    torch.manual_seed(5)
    transformer = Transformer(str(base))
    width = transformer.get_embedding_dimension()
    modules = [transformer, Pooling(width, pooling_mode="mean"), Dense(width, 16), Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(root / "dense"))
    return load(root / "dense"), root / "dense"


def test_dense_projects_each_chunk_mean(projected: tuple[LoadedModel, Path]) -> None:
    """As sentence-transformers would embed a chunk from the text's token embeddings: the
    chunk's mean, then its Dense module, then Normalize."""
    from sentence_transformers import SentenceTransformer

    model, folder = projected
    reference = SentenceTransformer(str(folder), device="cpu")
    tokens = reference.encode(TEXT, output_value="token_embeddings", convert_to_numpy=False)
    rows = token_rows(model, TEXT)
    spans = SPANS[:3]
    expected = []
    for start, end in spans:
        hits = [
            i
            for i, (a, b) in enumerate(rows.offsets)
            if not rows.special_tokens_mask[i] and b > start and a < end
        ]
        mean = tokens[hits[0] : hits[-1] + 1].mean(dim=0, keepdim=True)
        with torch.no_grad():
            vector = reference[2]({"sentence_embedding": mean})["sentence_embedding"][0]
        expected.append((vector / vector.norm()).numpy())
    (out,) = run_all(model, [late([TEXT], spans=tuple(spans))])[0]
    assert vectors(out).shape == (3, 16)
    np.testing.assert_allclose(vectors(out), np.stack(expected), atol=1e-5)


def test_dense_refuses_a_chunk_across_windows(projected: tuple[LoadedModel, Path]) -> None:
    model, _ = projected
    text = " ".join(f"word{i % 7} sentence number {i}." for i in range(40))
    assert refusal(model, late([text], spans=((0, len(text)),))) == (
        "embed.texts[0]",
        "LATE_CHUNK_ACROSS_WINDOWS",
    )
    (out,) = run_all(model, [late([text], spans=((0, 20), (len(text) - 20, len(text))))])[0]
    assert vectors(out).shape == (2, 16)
