"""Task parity: every server output equals a direct transformers / sentence-transformers run.

Each test sends one request through the real server (the session ``client``) and recomputes
the expected result locally from the same model folder, in float32, one text at a time and
without padding, so batching on the server cannot hide a pooling or masking mistake.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer, util
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    AutoTokenizer,
)

from pooling_client import PoolingClient, PoolingError, PoolingParams
from tests.conftest import DEFAULT_MODEL, Served
from tests.fixture_models import MINILM

ATOL = 1e-4
MINILM_NAME = DEFAULT_MODEL
TINY_MAX = 128  # max_position_embeddings of every tiny fixture model

# Varied texts, all within every model's maximum length.
TEXTS = [
    "Hello world",
    "",
    "The quick brown fox jumps over the lazy dog.",
    "Ünïcödé façade: naïve café, Straße, 東京タワー and an emoji 🙂",
    "?!... ,;:'\"()[]{} --- ***",
    "a",
    " ".join(["the powerhouse of the cell is the mitochondria"] * 8),  # 90 tokens
    "Numbers 12345 and 67.89, MixedCASE words, e-mail: someone@example.com",
    "  leading spaces, trailing spaces \t tabs and\nnew lines  ",
    "Привет, мир! Γειά σου Κόσμε. مرحبا بالعالم",
]
QUERIES = ["what is the capital of france?", "", "Ünïcödé query 🙂", "how do cells make energy"]
DOCUMENTS = [
    "Paris is the capital of France.",
    "The mitochondria is the powerhouse of the cell.",
    "?!...",
    "",
    "Berlin is a city in Germany; Zürich is in Switzerland.",
    "A completely unrelated sentence about cooking pasta al dente.",
    "Ünïcödé façade 東京",
    "cells make energy from glucose",
]
# Over 128 tokens: 272 tokens with specials.
LONG_TEXT = " ".join(f"Sentence {i} mentions topic {i * 7 % 13}, and Zürich." for i in range(30))
# "hello" is one token: these are exactly 128 (the maximum) and 129 tokens with specials.
AT_MAX_TEXT = "hello " * (TINY_MAX - 2)
ONE_OVER_TEXT = "hello " * (TINY_MAX - 1)
TWO_WINDOWS_TEXT = "hello " * (2 * (TINY_MAX - 2))  # two full chunks, no partial third
VERY_LONG_TEXT = " ".join(["Ünïcödé façade, naïve café; the quick brown fox!"] * 40)

# Embedding models and how the reference pools them (the server must agree).
POOLING = {
    "tiny-bert": "cls",
    "tiny-bert-mean": "mean",
    "tiny-bert-left": "cls",
    "tiny-bert-chunk": "mean",
    "tiny-st-mean": "mean",
    "tiny-decoder": "last",
    MINILM_NAME: "mean",
    "minilm-matryoshka": "mean",
    "minilm-dims": "mean",
}
# Classifiers and their activation for classify.
ACTIVATION = {
    "tiny-classifier": "softmax",
    "tiny-multilabel": "sigmoid",
    "tiny-regression": "identity",
    "tiny-cross-encoder": "sigmoid",
}


# ---------------------------------------------------------------------------------------------
# Numeric helpers
# ---------------------------------------------------------------------------------------------


def assert_close(got: Any, expected: Any, atol: float = ATOL) -> None:
    got_array = np.asarray(got, dtype=np.float64)
    expected_array = np.asarray(expected, dtype=np.float64)
    assert got_array.shape == expected_array.shape, (got_array.shape, expected_array.shape)
    np.testing.assert_allclose(got_array, expected_array, rtol=0, atol=atol)


def l2_normalize(values: np.ndarray) -> np.ndarray:
    norms = np.linalg.norm(values, axis=-1, keepdims=True)
    return values / np.maximum(norms, 1e-12)


def softmax(logits: np.ndarray) -> np.ndarray:
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    return shifted / shifted.sum(axis=-1, keepdims=True)


def sigmoid(logits: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-logits))


def activate(logits: np.ndarray, activation: str) -> np.ndarray:
    if activation == "softmax":
        return softmax(logits)
    if activation == "sigmoid":
        return sigmoid(logits)
    return logits


def pool_rows(rows: np.ndarray, method: str) -> np.ndarray:
    """Pool the unpadded token states of one sequence."""
    if method == "mean":
        return rows.mean(axis=0)
    if method == "cls":
        return rows[0]
    if method == "last":
        return rows[-1]
    raise ValueError(method)


def params(**kwargs: Any) -> PoolingParams:
    return PoolingParams(**{k: v for k, v in kwargs.items() if v is not None})


# ---------------------------------------------------------------------------------------------
# Reference computations (direct transformers / sentence-transformers, cached per module)
# ---------------------------------------------------------------------------------------------


class Reference:
    """Loads each reference model once and computes outputs one text at a time, unpadded."""

    def __init__(self, served: dict[str, Served]) -> None:
        self.served = served
        self._models: dict[tuple[str, str], torch.nn.Module] = {}
        self._tokenizers: dict[tuple[str, str], Any] = {}
        self._st: dict[tuple[str, bool], SentenceTransformer] = {}
        self._cross: dict[str, CrossEncoder] = {}

    def folder(self, name: str) -> str:
        folder = self.served[name].folder
        return str(MINILM) if folder == DEFAULT_MODEL else folder

    def config(self, name: str) -> Any:
        return AutoConfig.from_pretrained(self.folder(name))

    def tokenizer(self, name: str, side: str | None = None) -> Any:
        side = side or self.served[name].truncation_side
        key = (self.folder(name), side)
        if key not in self._tokenizers:
            self._tokenizers[key] = AutoTokenizer.from_pretrained(key[0], truncation_side=side)
        return self._tokenizers[key]

    def model(self, name: str, head: str = "hidden") -> torch.nn.Module:
        key = (self.folder(name), head)
        if key not in self._models:
            cls = {
                "hidden": AutoModel,
                "sequence": AutoModelForSequenceClassification,
                "token": AutoModelForTokenClassification,
            }[head]
            self._models[key] = cls.from_pretrained(key[0], dtype=torch.float32).eval()
        return self._models[key]

    def sentence_transformer(self, name: str, normalize: bool = True) -> SentenceTransformer:
        """The ST pipeline of the folder; normalize=False drops its Normalize module."""
        key = (self.folder(name), normalize)
        if key not in self._st:
            full = self._st.get((key[0], True)) or SentenceTransformer(key[0], device="cpu")
            self._st[(key[0], True)] = full
            if not normalize:
                modules = [m for m in full if type(m).__name__ != "Normalize"]
                self._st[key] = SentenceTransformer(modules=modules, device="cpu")
        return self._st[key]

    def cross_encoder(self, name: str) -> CrossEncoder:
        folder = self.folder(name)
        if folder not in self._cross:
            self._cross[folder] = CrossEncoder(folder, device="cpu")
        return self._cross[folder]

    def tokenize(
        self,
        name: str,
        text: str,
        pair: str | None = None,
        max_length: int | None = None,
        side: str | None = None,
    ) -> dict[str, Any]:
        """HF tokenization with offsets and the special mask (plain lists, one sequence)."""
        return self.tokenizer(name, side)(
            text,
            pair,
            truncation=max_length is not None,
            max_length=max_length,
            return_offsets_mapping=True,
            return_special_tokens_mask=True,
        )

    def _forward(self, name: str, head: str, ids: Sequence[int], types: Sequence[int] | None):
        model = self.model(name, head)
        inputs = {
            "input_ids": torch.tensor([list(ids)]),
            "attention_mask": torch.ones((1, len(ids)), dtype=torch.long),
        }
        if types is not None and "bert" in model.config.model_type:
            inputs["token_type_ids"] = torch.tensor([list(types)])
        with torch.inference_mode():
            return model(**inputs)

    def hidden_rows(self, name: str, ids: Sequence[int]) -> np.ndarray:
        """Last hidden states (tokens x hidden) of one token sequence."""
        output = self._forward(name, "hidden", ids, [0] * len(ids))
        return output.last_hidden_state[0].float().numpy()

    def text_rows(self, name: str, text: str, **kwargs: Any) -> np.ndarray:
        return self.hidden_rows(name, self.tokenize(name, text, **kwargs)["input_ids"])

    def sequence_logits(self, name: str, text: str, pair: str | None = None, **kwargs: Any):
        enc = self.tokenize(name, text, pair, **kwargs)
        output = self._forward(name, "sequence", enc["input_ids"], enc["token_type_ids"])
        return output.logits[0].float().numpy()

    def token_logits(self, name: str, ids: Sequence[int]) -> np.ndarray:
        return self._forward(name, "token", ids, [0] * len(ids)).logits[0].float().numpy()

    def embedding(
        self,
        name: str,
        text: str,
        use_activation: bool | None = None,
        dimensions: int | None = None,
        **kwargs: Any,
    ) -> np.ndarray:
        vector = pool_rows(self.text_rows(name, text, **kwargs), POOLING[name])
        if dimensions is not None:
            vector = vector[:dimensions]
        return l2_normalize(vector) if use_activation in (None, True) else vector

    def chunks(self, name: str, text: str) -> list[list[int]]:
        """The hand-made chunking: content windows of (max - specials), each wrapped."""
        ids = self.tokenize(name, text)["input_ids"]
        if len(ids) <= TINY_MAX:
            return [ids]
        cls_id, content, sep_id = ids[0], ids[1:-1], ids[-1]
        window = TINY_MAX - 2
        return [
            [cls_id, *content[start : start + window], sep_id]
            for start in range(0, len(content), window)
        ]

    def chunked_embedding(self, name: str, text: str, use_activation: bool | None = None):
        chunks = self.chunks(name, text)
        vectors = np.stack([self.hidden_rows(name, c).mean(axis=0) for c in chunks])
        weights = np.array([len(c) for c in chunks], dtype=np.float64)
        vector = (vectors * weights[:, None]).sum(axis=0) / weights.sum()
        return l2_normalize(vector) if use_activation in (None, True) else vector

    def chunked_rows(self, name: str, text: str, rows_of: Callable[[list[int]], np.ndarray]):
        """Rows of each chunk joined back: leading specials, every content, trailing specials."""
        per_chunk = [rows_of(c) for c in self.chunks(name, text)]
        parts = [per_chunk[0][:1], *(rows[1:-1] for rows in per_chunk), per_chunk[-1][-1:]]
        return np.concatenate(parts)


@pytest.fixture(scope="module")
def ref(served: dict[str, Served]) -> Reference:
    return Reference(served)


def check_token_metadata(output: Any, enc: dict[str, Any]) -> None:
    """token_ids, offsets and special mask of a token output equal the HF tokenizer's."""
    assert output.token_ids == list(enc["input_ids"])
    assert output.offsets == [tuple(span) for span in enc["offset_mapping"]]
    assert output.special_tokens_mask == [bool(flag) for flag in enc["special_tokens_mask"]]
    assert len(output.data) == len(enc["input_ids"])


def test_fixture_texts_have_the_intended_lengths(ref: Reference) -> None:
    def count(text: str) -> int:
        return len(ref.tokenize("tiny-bert", text)["input_ids"])

    assert all(count(text) <= TINY_MAX for text in TEXTS + QUERIES + DOCUMENTS)
    assert count(" ".join(["the powerhouse of the cell is the mitochondria"] * 8)) == 90
    assert count(AT_MAX_TEXT) == TINY_MAX
    assert count(ONE_OVER_TEXT) == TINY_MAX + 1
    assert count(LONG_TEXT) > 2 * TINY_MAX
    assert count(TWO_WINDOWS_TEXT) == 2 * (TINY_MAX - 2) + 2
    assert count(VERY_LONG_TEXT) > 3 * TINY_MAX  # four chunks, the last partial


# ---------------------------------------------------------------------------------------------
# embed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_activation", [None, True, False])
@pytest.mark.parametrize("name", ["tiny-bert", "tiny-bert-mean", "tiny-decoder", "tiny-bert-chunk"])
def test_embed_matches_manual_pooling(
    client: PoolingClient, ref: Reference, name: str, use_activation: bool | None
) -> None:
    """CLS (tiny-bert), MEAN override, LAST on the decoder (last token of each unpadded text)."""
    outputs = client.embed(TEXTS, pooling_params=params(use_activation=use_activation), model=name)
    assert len(outputs) == len(TEXTS)
    for text, output in zip(TEXTS, outputs, strict=True):
        assert_close(output.outputs.embedding, ref.embedding(name, text, use_activation))


@pytest.mark.parametrize("use_activation", [None, True, False])
@pytest.mark.parametrize("name", ["tiny-st-mean", MINILM_NAME])
def test_embed_matches_sentence_transformers(
    client: PoolingClient, ref: Reference, name: str, use_activation: bool | None
) -> None:
    """With Normalize in the ST pipeline the default normalises; False is the raw mean."""
    outputs = client.embed(TEXTS, pooling_params=params(use_activation=use_activation), model=name)
    st = ref.sentence_transformer(name, normalize=use_activation is not False)
    expected = st.encode(TEXTS, convert_to_numpy=True)
    assert_close([o.outputs.embedding for o in outputs], expected)
    # The manual pooling agrees with ST, so both references describe the same thing.
    manual = [ref.embedding(name, text, use_activation) for text in TEXTS]
    assert_close(manual, expected)


def test_embed_default_model_when_model_unset(client: PoolingClient, ref: Reference) -> None:
    outputs = client.embed(TEXTS[:3])
    expected = ref.sentence_transformer(MINILM_NAME).encode(TEXTS[:3], convert_to_numpy=True)
    assert_close([o.outputs.embedding for o in outputs], expected)


@pytest.mark.parametrize("use_activation", [None, False])
@pytest.mark.parametrize(
    ("name", "dimensions"),
    [
        ("minilm-matryoshka", 1),
        ("minilm-matryoshka", 32),
        ("minilm-matryoshka", 100),
        ("minilm-matryoshka", 384),
        ("minilm-dims", 128),
        ("minilm-dims", 256),
    ],
)
def test_embed_matryoshka_dimensions(
    client: PoolingClient,
    ref: Reference,
    name: str,
    dimensions: int,
    use_activation: bool | None,
) -> None:
    """Truncate the pooled vector, then renormalise (or leave it raw with use_activation off)."""
    request = params(use_activation=use_activation, dimensions=dimensions)
    outputs = client.embed(TEXTS, pooling_params=request, model=name)
    st = ref.sentence_transformer(name, normalize=use_activation is not False)
    expected = st.encode(TEXTS, convert_to_numpy=True, truncate_dim=dimensions)
    if use_activation is not False:
        expected = l2_normalize(expected)
    assert_close([o.outputs.embedding for o in outputs], expected)


def test_embed_matryoshka_without_dimensions_is_full_size(
    client: PoolingClient, ref: Reference
) -> None:
    outputs = client.embed(TEXTS, model="minilm-dims")
    expected = ref.sentence_transformer("minilm-dims").encode(TEXTS, convert_to_numpy=True)
    assert_close([o.outputs.embedding for o in outputs], expected)


# ---------------------------------------------------------------------------------------------
# token_embed
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "use_activation", "dimensions"),
    [
        ("tiny-bert", None, None),
        ("tiny-bert", False, None),
        ("tiny-decoder", True, None),
        (MINILM_NAME, None, None),
        ("minilm-matryoshka", None, 64),
        ("minilm-matryoshka", False, 64),
    ],
)
def test_token_embed_matches_hidden_states(
    client: PoolingClient,
    ref: Reference,
    name: str,
    use_activation: bool | None,
    dimensions: int | None,
) -> None:
    request = params(use_activation=use_activation, dimensions=dimensions)
    outputs = client.encode(TEXTS, pooling_task="token_embed", pooling_params=request, model=name)
    assert len(outputs) == len(TEXTS)
    for text, output in zip(TEXTS, outputs, strict=True):
        enc = ref.tokenize(name, text)
        check_token_metadata(output.outputs, enc)
        rows = ref.hidden_rows(name, enc["input_ids"])
        if dimensions is not None:
            rows = rows[:, :dimensions]
        if use_activation is not False:
            rows = l2_normalize(rows)
        assert_close(output.outputs.data, rows)
        assert output.outputs.label_ids == []
        assert output.outputs.labels == []


def test_token_embed_matches_sentence_transformers_token_embeddings(
    client: PoolingClient, ref: Reference
) -> None:
    outputs = client.encode(
        TEXTS, pooling_task="token_embed", pooling_params=params(use_activation=False)
    )
    expected = ref.sentence_transformer(MINILM_NAME).encode(
        TEXTS, output_value="token_embeddings", convert_to_numpy=False
    )
    for output, rows in zip(outputs, expected, strict=True):
        assert_close(output.outputs.data, rows.numpy())


def test_token_offsets_match_tokenize(client: PoolingClient, ref: Reference) -> None:
    """The Tokenize RPC and token_embed describe the same tokens."""
    tokenized = client.tokenize(TEXTS, model="tiny-bert")
    rows = client.encode(TEXTS, pooling_task="token_embed", model="tiny-bert")
    for text, item, row in zip(TEXTS, tokenized, rows, strict=True):
        enc = ref.tokenize("tiny-bert", text)
        assert item.token_ids == row.outputs.token_ids == list(enc["input_ids"])
        assert item.offsets == row.outputs.offsets
        assert item.tokens == ref.tokenizer("tiny-bert").convert_ids_to_tokens(enc["input_ids"])


# ---------------------------------------------------------------------------------------------
# classify
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_activation", [None, True, False])
@pytest.mark.parametrize("name", list(ACTIVATION))
def test_classify_matches_sequence_classifier(
    client: PoolingClient, ref: Reference, name: str, use_activation: bool | None
) -> None:
    outputs = client.classify(
        TEXTS, pooling_params=params(use_activation=use_activation), model=name
    )
    id2label = ref.config(name).id2label
    activation = ACTIVATION[name] if use_activation is not False else "identity"
    for text, output in zip(TEXTS, outputs, strict=True):
        expected = activate(ref.sequence_logits(name, text), activation)
        assert_close(output.outputs.probs, expected)
        assert output.outputs.label_id == int(np.argmax(expected))
        assert output.outputs.label == id2label[int(np.argmax(expected))]


def test_classify_softmax_probabilities_sum_to_one(client: PoolingClient) -> None:
    for output in client.classify(TEXTS, model="tiny-classifier"):
        assert sum(output.outputs.probs) == pytest.approx(1.0, abs=1e-5)
        assert output.outputs.label in ("negative", "neutral", "positive")


# ---------------------------------------------------------------------------------------------
# score
# ---------------------------------------------------------------------------------------------


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """The pairs a score call means: 1:1, 1:N (text_1 broadcast) or N:N."""
    firsts = [text_1] if isinstance(text_1, str) else text_1
    seconds = [text_2] if isinstance(text_2, str) else text_2
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    return list(zip(firsts, seconds, strict=True))


SCORE_SHAPES = {
    "1:1": (QUERIES[0], DOCUMENTS[0]),
    "1:N": (QUERIES[0], DOCUMENTS),
    "1:N-unicode": (QUERIES[2], DOCUMENTS),
    "N:N": (QUERIES + QUERIES, DOCUMENTS),
}


@pytest.mark.parametrize("use_activation", [None, True, False])
@pytest.mark.parametrize("shape", list(SCORE_SHAPES))
@pytest.mark.parametrize("name", ["tiny-cross-encoder", "tiny-regression"])
def test_score_cross_encoder(
    client: PoolingClient, ref: Reference, name: str, shape: str, use_activation: bool | None
) -> None:
    """sigmoid(logit) of the pair tokenized as text/text_pair; the raw logit when off."""
    text_1, text_2 = SCORE_SHAPES[shape]
    outputs = client.score(
        text_1, text_2, pooling_params=params(use_activation=use_activation), model=name
    )
    pairs = score_pairs(text_1, text_2)
    assert len(outputs) == len(pairs)
    logits = np.array([ref.sequence_logits(name, a, b)[0] for a, b in pairs])
    expected = logits if use_activation is False else sigmoid(logits)
    assert_close([o.outputs.score for o in outputs], expected)


def test_score_cross_encoder_matches_sentence_transformers_cross_encoder(
    client: PoolingClient, ref: Reference
) -> None:
    pairs = score_pairs(QUERIES + QUERIES, DOCUMENTS)
    outputs = client.score(QUERIES + QUERIES, DOCUMENTS, model="tiny-cross-encoder")
    expected = ref.cross_encoder("tiny-cross-encoder").predict(pairs, convert_to_numpy=True)
    assert_close([o.outputs.score for o in outputs], expected)


def test_score_pairs_form_matches_n_to_n(client: PoolingClient) -> None:
    pairs = score_pairs(QUERIES + QUERIES, DOCUMENTS)
    by_pairs = client.score(pairs, model="tiny-cross-encoder")
    by_lists = client.score(QUERIES + QUERIES, DOCUMENTS, model="tiny-cross-encoder")
    assert_close([o.outputs.score for o in by_pairs], [o.outputs.score for o in by_lists])


@pytest.mark.parametrize("shape", list(SCORE_SHAPES))
def test_score_bi_encoder_is_cosine_of_st_embeddings(
    client: PoolingClient, ref: Reference, shape: str
) -> None:
    text_1, text_2 = SCORE_SHAPES[shape]
    outputs = client.score(text_1, text_2, model=MINILM_NAME)
    pairs = score_pairs(text_1, text_2)
    st = ref.sentence_transformer(MINILM_NAME)
    first = st.encode([a for a, _ in pairs], convert_to_tensor=True)
    second = st.encode([b for _, b in pairs], convert_to_tensor=True)
    expected = [float(util.cos_sim(first[i], second[i])[0, 0]) for i in range(len(pairs))]
    assert_close([o.outputs.score for o in outputs], expected)


def test_score_bi_encoder_cls_and_last_pooling(client: PoolingClient, ref: Reference) -> None:
    """Cosine of the pooled vectors for CLS (tiny-bert) and LAST (tiny-decoder) too."""
    pairs = score_pairs(QUERIES[3], DOCUMENTS)
    for name in ("tiny-bert", "tiny-decoder"):
        outputs = client.score(QUERIES[3], DOCUMENTS, model=name)
        expected = [float(ref.embedding(name, a) @ ref.embedding(name, b)) for a, b in pairs]
        assert_close([o.outputs.score for o in outputs], expected)


# ---------------------------------------------------------------------------------------------
# token_classify
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("use_activation", [None, True, False])
def test_token_classify_matches_token_classifier(
    client: PoolingClient, ref: Reference, use_activation: bool | None
) -> None:
    outputs = client.encode(
        TEXTS,
        pooling_task="token_classify",
        pooling_params=params(use_activation=use_activation),
        model="tiny-ner",
    )
    id2label = ref.config("tiny-ner").id2label
    for text, output in zip(TEXTS, outputs, strict=True):
        enc = ref.tokenize("tiny-ner", text)
        check_token_metadata(output.outputs, enc)
        logits = ref.token_logits("tiny-ner", enc["input_ids"])
        expected = logits if use_activation is False else softmax(logits)
        assert_close(output.outputs.data, expected)
        label_ids = [int(i) for i in np.argmax(expected, axis=-1)]
        assert output.outputs.label_ids == label_ids
        assert output.outputs.labels == [id2label[i] for i in label_ids]


# ---------------------------------------------------------------------------------------------
# truncation
# ---------------------------------------------------------------------------------------------

TRUNCATION_TEXTS = [*TEXTS, LONG_TEXT, AT_MAX_TEXT, ONE_OVER_TEXT]


@pytest.mark.parametrize("truncate", [2, 3, 7, 20, 128, -1])
@pytest.mark.parametrize(("name", "side"), [("tiny-bert", "right"), ("tiny-bert-left", "left")])
def test_embed_truncate_prompt_tokens(
    client: PoolingClient, ref: Reference, name: str, side: str, truncate: int
) -> None:
    """Keep N tokens including specials, cut on the model's side; -1 = the model maximum."""
    outputs = client.embed(
        TRUNCATION_TEXTS, pooling_params=params(truncate_prompt_tokens=truncate), model=name
    )
    max_length = TINY_MAX if truncate == -1 else truncate
    for text, output in zip(TRUNCATION_TEXTS, outputs, strict=True):
        expected = ref.embedding(name, text, max_length=max_length, side=side)
        assert_close(output.outputs.embedding, expected)


@pytest.mark.parametrize("truncate", [5, -1])
@pytest.mark.parametrize(("name", "side"), [("tiny-bert", "right"), ("tiny-bert-left", "left")])
def test_token_embed_truncate_prompt_tokens(
    client: PoolingClient, ref: Reference, name: str, side: str, truncate: int
) -> None:
    """The kept tokens (ids, offsets, specials) are exactly the tokenizer's truncated ones."""
    outputs = client.encode(
        TRUNCATION_TEXTS,
        pooling_task="token_embed",
        truncate_prompt_tokens=truncate,
        model=name,
    )
    max_length = TINY_MAX if truncate == -1 else truncate
    for text, output in zip(TRUNCATION_TEXTS, outputs, strict=True):
        enc = ref.tokenize(name, text, max_length=max_length, side=side)
        check_token_metadata(output.outputs, enc)
        assert_close(output.outputs.data, l2_normalize(ref.hidden_rows(name, enc["input_ids"])))


def test_truncate_kwarg_equals_params_field(client: PoolingClient) -> None:
    by_kwarg = client.embed(TRUNCATION_TEXTS, truncate_prompt_tokens=7, model="tiny-bert-left")
    by_params = client.embed(
        TRUNCATION_TEXTS, pooling_params=params(truncate_prompt_tokens=7), model="tiny-bert-left"
    )
    for a, b in zip(by_kwarg, by_params, strict=True):
        assert_close(a.outputs.embedding, b.outputs.embedding)


@pytest.mark.parametrize("truncate", [6, 40, -1])
def test_classify_and_score_truncate_prompt_tokens(
    client: PoolingClient, ref: Reference, truncate: int
) -> None:
    max_length = TINY_MAX if truncate == -1 else truncate
    texts = [*TEXTS[:4], LONG_TEXT]
    outputs = client.classify(texts, truncate_prompt_tokens=truncate, model="tiny-classifier")
    for text, output in zip(texts, outputs, strict=True):
        logits = ref.sequence_logits("tiny-classifier", text, max_length=max_length)
        assert_close(output.outputs.probs, softmax(logits))
    documents = [*DOCUMENTS[:3], LONG_TEXT]
    scores = client.score(
        QUERIES[0], documents, truncate_prompt_tokens=truncate, model="tiny-cross-encoder"
    )
    for document, output in zip(documents, scores, strict=True):
        logit = ref.sequence_logits(
            "tiny-cross-encoder", QUERIES[0], document, max_length=max_length
        )
        assert_close(output.outputs.score, sigmoid(logit[0]))


# ---------------------------------------------------------------------------------------------
# long input: rejected, or chunked with --long-input chunk
# ---------------------------------------------------------------------------------------------


def token_count(ref: Reference, text: str) -> int:
    return len(ref.tokenize("tiny-bert", text)["input_ids"])


@pytest.mark.parametrize(
    ("task", "name"),
    [("embed", "tiny-bert"), ("token_embed", "tiny-bert-mean"), ("token_classify", "tiny-ner")],
)
def test_long_input_rejected(client: PoolingClient, ref: Reference, task: str, name: str) -> None:
    texts = ["short", LONG_TEXT, AT_MAX_TEXT, ONE_OVER_TEXT]
    with pytest.raises(PoolingError) as caught:
        client.encode(texts, pooling_task=task, model=name)
    error = caught.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == "INPUT_TOO_LONG"
    violations = {v.field: v.description for v in error.field_violations}
    assert set(violations) == {f"{task}.texts[1]", f"{task}.texts[3]"}
    for index in (1, 3):
        description = violations[f"{task}.texts[{index}]"]
        assert str(token_count(ref, texts[index])) in description
        assert str(TINY_MAX) in description


def test_long_input_rejected_by_classifier(client: PoolingClient, ref: Reference) -> None:
    with pytest.raises(PoolingError) as caught:
        client.classify([LONG_TEXT], model="tiny-classifier")
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.reason == "INPUT_TOO_LONG"
    assert [v.field for v in caught.value.field_violations] == ["classify.texts[0]"]
    assert str(token_count(ref, LONG_TEXT)) in caught.value.field_violations[0].description


def test_long_pair_rejected_by_cross_encoder(client: PoolingClient, ref: Reference) -> None:
    """A pair is measured as the model sees it: text, text_pair and three specials."""
    documents = ["short", LONG_TEXT]
    with pytest.raises(PoolingError) as caught:
        client.score(QUERIES[0], documents, model="tiny-cross-encoder")
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.reason == "INPUT_TOO_LONG"
    [violation] = caught.value.field_violations
    assert violation.field.startswith("score.") and violation.field.endswith("[1]")
    pair_tokens = len(ref.tokenize("tiny-cross-encoder", QUERIES[0], LONG_TEXT)["input_ids"])
    assert str(pair_tokens) in violation.description


CHUNK_TEXTS = [
    "short",
    AT_MAX_TEXT,
    ONE_OVER_TEXT,
    LONG_TEXT,
    TWO_WINDOWS_TEXT,
    VERY_LONG_TEXT,
    TEXTS[3],
    "",
]


@pytest.mark.parametrize("use_activation", [None, False])
def test_chunked_embed(client: PoolingClient, ref: Reference, use_activation: bool | None) -> None:
    """Token-count weighted mean of the chunks' mean-pooled vectors, then normalised."""
    name = "tiny-bert-chunk"
    outputs = client.embed(
        CHUNK_TEXTS, pooling_params=params(use_activation=use_activation), model=name
    )
    for text, output in zip(CHUNK_TEXTS, outputs, strict=True):
        expected = ref.chunked_embedding(name, text, use_activation)
        assert_close(output.outputs.embedding, expected)
    # A text that fits is not chunked: the same as plain mean pooling.
    plain = client.embed(
        [AT_MAX_TEXT], pooling_params=params(use_activation=use_activation), model="tiny-bert-mean"
    )
    assert_close(outputs[1].outputs.embedding, plain[0].outputs.embedding)


def test_chunked_model_truncates_instead_when_asked(client: PoolingClient, ref: Reference) -> None:
    """truncate_prompt_tokens wins over chunking: one window of the first N tokens."""
    texts = [LONG_TEXT, VERY_LONG_TEXT, "short"]
    for truncate, max_length in ((-1, TINY_MAX), (50, 50)):
        outputs = client.embed(texts, truncate_prompt_tokens=truncate, model="tiny-bert-chunk")
        for text, output in zip(texts, outputs, strict=True):
            expected = ref.embedding("tiny-bert-chunk", text, max_length=max_length)
            assert_close(output.outputs.embedding, expected)


def test_chunked_score_is_cosine_of_chunked_embeddings(
    client: PoolingClient, ref: Reference
) -> None:
    documents = ["short", VERY_LONG_TEXT, ONE_OVER_TEXT, TEXTS[3]]
    outputs = client.score(LONG_TEXT, documents, model="tiny-bert-chunk")
    query = ref.chunked_embedding("tiny-bert-chunk", LONG_TEXT)
    expected = [float(query @ ref.chunked_embedding("tiny-bert-chunk", d)) for d in documents]
    assert_close([o.outputs.score for o in outputs], expected)


def test_chunked_token_embed(client: PoolingClient, ref: Reference) -> None:
    name = "tiny-bert-chunk"
    outputs = client.encode(CHUNK_TEXTS, pooling_task="token_embed", model=name)
    for text, output in zip(CHUNK_TEXTS, outputs, strict=True):
        check_token_metadata(output.outputs, ref.tokenize(name, text))
        rows = ref.chunked_rows(name, text, lambda ids: ref.hidden_rows(name, ids))
        assert_close(output.outputs.data, l2_normalize(rows))


@pytest.mark.parametrize("use_activation", [None, False])
def test_chunked_token_classify(
    client: PoolingClient, ref: Reference, use_activation: bool | None
) -> None:
    name = "tiny-ner-chunk"
    outputs = client.encode(
        CHUNK_TEXTS,
        pooling_task="token_classify",
        pooling_params=params(use_activation=use_activation),
        model=name,
    )
    id2label = ref.config(name).id2label
    for text, output in zip(CHUNK_TEXTS, outputs, strict=True):
        check_token_metadata(output.outputs, ref.tokenize(name, text))
        logits = ref.chunked_rows(name, text, lambda ids: ref.token_logits(name, ids))
        expected = logits if use_activation is False else softmax(logits)
        assert_close(output.outputs.data, expected)
        label_ids = [int(i) for i in np.argmax(expected, axis=-1)]
        assert output.outputs.label_ids == label_ids
        assert output.outputs.labels == [id2label[i] for i in label_ids]


# ---------------------------------------------------------------------------------------------
# mixed models in one burst
# ---------------------------------------------------------------------------------------------


def _flatten(outputs: list[Any]) -> list[np.ndarray]:
    """Every numeric result of a call, one array per input, for comparison."""
    flat = []
    for output in outputs:
        result = output.outputs
        if hasattr(result, "embedding"):
            flat.append(np.asarray(result.embedding))
        elif hasattr(result, "probs"):
            flat.append(np.asarray([*result.probs, result.label_id]))
        elif hasattr(result, "score"):
            flat.append(np.asarray([result.score]))
        else:
            flat.append(np.asarray(result.data).ravel())
    return flat


def burst_calls(client: PoolingClient) -> list[Callable[[], list[Any]]]:
    calls: list[Callable[[], list[Any]]] = []
    for i in range(5):
        texts = TEXTS[i : i + 3 + i % 3]
        calls += [
            lambda t=texts: client.embed(t, model=MINILM_NAME),
            lambda t=texts: client.embed(t, model="tiny-bert"),
            lambda t=texts: client.embed(
                t, pooling_params=params(dimensions=128), model="minilm-dims"
            ),
            lambda t=texts: client.embed(
                t, pooling_params=params(use_activation=False), model="tiny-decoder"
            ),
            lambda t=texts: client.embed(
                t, pooling_params=params(use_activation=False), model="tiny-bert"
            ),
            lambda t=texts: client.encode(t, pooling_task="token_embed", model="tiny-bert"),
            lambda t=texts, i=i: client.embed(
                t, pooling_params=params(dimensions=8 * (i + 1)), model="minilm-matryoshka"
            ),
            lambda t=texts: client.classify(t, model="tiny-classifier"),
            lambda t=texts: client.score(t[0], t, model="tiny-cross-encoder"),
            lambda t=texts: client.encode(t, pooling_task="token_classify", model="tiny-ner"),
        ]
    calls.append(lambda: client.embed([LONG_TEXT, "x"], model="tiny-bert-chunk"))
    calls.append(lambda: client.embed([LONG_TEXT], truncate_prompt_tokens=9, model="tiny-bert"))
    return calls


def test_mixed_models_in_one_burst(client: PoolingClient) -> None:
    calls = burst_calls(client)
    assert len(calls) >= 30
    one_by_one = [_flatten(call()) for call in calls]
    with ThreadPoolExecutor(max_workers=16) as pool:
        futures = [pool.submit(call) for call in calls]
        concurrent = [_flatten(future.result()) for future in futures]
    for alone, together in zip(one_by_one, concurrent, strict=True):
        assert len(alone) == len(together)
        for a, b in zip(alone, together, strict=True):
            assert_close(b, a)


# ---------------------------------------------------------------------------------------------
# ListModels
# ---------------------------------------------------------------------------------------------

HIDDEN_TASKS = {"embed", "token_embed", "score"}
EXPECTED_TASKS = {
    "tiny-classifier": {"classify"},
    "tiny-multilabel": {"classify"},
    "tiny-cross-encoder": {"classify", "score"},
    "tiny-regression": {"classify", "score"},
    "tiny-ner": {"token_classify"},
    "tiny-ner-chunk": {"token_classify"},
}
EXPECTED_POOLING = {
    **POOLING,
    **dict.fromkeys(("tiny-classifier", "tiny-multilabel", "tiny-cross-encoder"), "cls"),
    "tiny-regression": "cls",
    "tiny-ner": "all",
    "tiny-ner-chunk": "all",
}


def test_list_models_matches_capabilities(
    client: PoolingClient, ref: Reference, served: dict[str, Served]
) -> None:
    infos = client.models()
    assert [info.name for info in infos] == list(served)
    assert [info.is_default for info in infos] == [i == 0 for i in range(len(infos))]
    for info in infos:
        config = ref.config(info.name)
        spec = served[info.name]
        labels = [config.id2label[i] for i in range(config.num_labels)]
        expected_labels = labels if info.name in EXPECTED_TASKS else []
        dims = spec.hf_overrides.get("matryoshka_dimensions", [])
        matryoshka = bool(spec.hf_overrides.get("is_matryoshka")) or bool(dims)
        assert set(info.tasks) == EXPECTED_TASKS.get(info.name, HIDDEN_TASKS), info.name
        assert info.hidden_size == config.hidden_size, info.name
        assert info.max_input_tokens == (256 if "minilm" in info.name.lower() else TINY_MAX)
        assert info.labels == expected_labels, info.name
        assert info.pooling_type == EXPECTED_POOLING[info.name], info.name
        assert info.is_matryoshka == matryoshka, info.name
        assert info.matryoshka_dimensions == dims, info.name
        assert info.default_use_activation is True, info.name
        assert info.truncation_side == spec.truncation_side, info.name
        assert info.long_input == spec.long_input, info.name
        assert info.architecture == config.architectures[0], info.name


def test_list_models_agrees_with_outputs(client: PoolingClient) -> None:
    """What ListModels promises is what the outputs look like."""
    for info in client.models():
        if "embed" in info.tasks:
            [output] = client.embed(["probe"], model=info.name)
            assert len(output.outputs.embedding) == info.hidden_size, info.name
        if "classify" in info.tasks:
            [output] = client.classify(["probe"], model=info.name)
            assert len(output.outputs.probs) == len(info.labels), info.name
            assert output.outputs.label in info.labels, info.name
        if "token_classify" in info.tasks:
            [output] = client.encode(["probe"], pooling_task="token_classify", model=info.name)
            assert set(output.outputs.labels) <= set(info.labels), info.name
            assert np.asarray(output.outputs.data).shape[1] == len(info.labels), info.name
