"""Multi-output (bge-m3) models: a folder with `sparse_linear.pt` and `colbert_linear.pt`
beside its encoder gives three outputs from one forward pass.

- dense: the first token's last hidden state (normalised unless use_activation is false);
- sparse (lexical weights): relu(sparse_linear(h)) per token, the largest per token id,
  with the tokenizer's cls, eos/sep, pad and unk ids and zero weights left out;
- multi (ColBERT): colbert_linear(h) for every token after the first, each row normalised.

The forward (engine/families/bge_m3/multi_output_module.py) hands back one float32 row per token, of
max(hidden, 1 + ColBERT width) values: the first token's row holds its hidden state (the
dense vector), every later token's row its sparse weight then its ColBERT vector. The first
token is the tokenizer's cls (checked at load), whose lexical weight and ColBERT row bge-m3
drops, so nothing is lost, and the token rows a request brings back are about half as wide
as [hidden | weight | vector] would be. The functions here slice them. The scores are the
model card's: dense by the dot of normalised vectors, sparse by the sum over shared ids of
the products of weights, multi by the mean over query rows of the best dot product over
document rows; combined as sum(weight * score) / sum(weight).

Torch-free: front ends plan and finish with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pooling_server.engine.requests.params import Output, OutputWeights

SPARSE_FILE = "sparse_linear.pt"
COLBERT_FILE = "colbert_linear.pt"
OUTPUTS: tuple[str, ...] = tuple(output.value for output in Output)


@dataclass(frozen=True)
class MultiOutputSettings:
    """Where each output lies in a token's row, and the ids without lexical weight."""

    hidden: int  # the body's hidden size: the dense vector's width
    multi_width: int  # colbert_linear's output width
    unused_ids: tuple[int, ...] = ()

    @property
    def outputs(self) -> tuple[str, ...]:
        """Its outputs as ModelCard.outputs names them (ModelInfo.outputs)."""
        return OUTPUTS

    @property
    def width(self) -> int:
        """Values per token row: row 0 the dense vector, the others weight and vector."""
        return max(self.hidden, 1 + self.multi_width)


def normalize(values: np.ndarray) -> np.ndarray:
    """L2-normalise the last axis (engine.heads.normalize's rule; that module imports
    ModelInfo, which imports this one)."""
    return values / np.maximum(np.linalg.norm(values, axis=-1, keepdims=True), 1e-12)


def find_heads(path: Path) -> tuple[Path, Path] | None:
    """The sparse and ColBERT head files of a bge-m3 folder; None when it has neither. One
    without the other is refused: serving the folder as a plain encoder would hide it."""
    sparse, colbert = path / SPARSE_FILE, path / COLBERT_FILE
    if not sparse.is_file() and not colbert.is_file():
        return None
    if not (sparse.is_file() and colbert.is_file()):
        missing = SPARSE_FILE if not sparse.is_file() else COLBERT_FILE
        raise ValueError(
            f"{path}: a multi-output (bge-m3) folder needs both {SPARSE_FILE} and "
            f"{COLBERT_FILE}; {missing} is missing"
        )
    return sparse, colbert


def check_first_token(tokenizer: Any, unused: tuple[int, ...], path: Path) -> None:
    """The rows leave out the first token's lexical weight and ColBERT row, which bge-m3
    drops as the cls token's: every text must start with one of the unused ids."""
    first = tokenizer("a")["input_ids"][:1]
    if not first or first[0] not in unused:
        raise ValueError(
            f"{path}: a multi-output (bge-m3) model needs a tokenizer that starts every text "
            "with its cls token (bge-m3 drops that token's lexical weight and ColBERT row)"
        )


def unused_ids(tokenizer: Any) -> tuple[int, ...]:
    """The ids whose lexical weight bge-m3 drops: cls, eos (sep for BERT-like), pad, unk."""
    names = ("cls_token_id", "eos_token_id", "sep_token_id", "pad_token_id", "unk_token_id")
    ids = {getattr(tokenizer, name, None) for name in names}
    return tuple(sorted(i for i in ids if isinstance(i, int)))


def dense(settings: MultiOutputSettings, row: np.ndarray, normalized: bool) -> np.ndarray:
    """The dense vector from the first token's row (pooled by the runner, or row 0)."""
    values = np.ascontiguousarray(row[: settings.hidden], dtype=np.float32)
    return normalize(values) if normalized else values


def lexical(
    settings: MultiOutputSettings, input_ids: Any, rows: np.ndarray, top_k: int = 0
) -> tuple[np.ndarray, np.ndarray]:
    """(ids, weights): per token id its largest weight, zero weights and the unused ids left
    out, by decreasing weight (ties by id), the first top_k of them (0: all). The first
    token (cls, unused) has no weight in its row."""
    ids = np.asarray(input_ids, dtype=np.int64)[1:]
    weights = rows[1 : 1 + len(ids), 0].astype(np.float32)
    keep = (weights > 0) & ~np.isin(ids, settings.unused_ids)
    ids, weights = ids[keep], weights[keep]
    unique, where = np.unique(ids, return_inverse=True)
    best = np.zeros(len(unique), dtype=np.float32)
    np.maximum.at(best, where, weights)
    order = np.lexsort((unique, -best))[: top_k or None]
    return unique[order].astype(np.int32), best[order]


def colbert(settings: MultiOutputSettings, rows: np.ndarray) -> np.ndarray:
    """The ColBERT matrix: every token's row after the first, projected and normalised."""
    vectors = rows[1:, 1 : 1 + settings.multi_width]
    return normalize(np.ascontiguousarray(vectors, dtype=np.float32))


def lexical_score(a: tuple[np.ndarray, np.ndarray], b: tuple[np.ndarray, np.ndarray]) -> float:
    """Sum over the ids both texts hold of the product of their weights."""
    shared, in_a, in_b = np.intersect1d(a[0], b[0], assume_unique=True, return_indices=True)
    if not len(shared):
        return 0.0
    return float(np.dot(a[1][in_a].astype(np.float64), b[1][in_b].astype(np.float64)))


def colbert_score(query: np.ndarray, document: np.ndarray) -> float:
    """The mean over query rows of the best dot product over document rows."""
    if not len(query) or not len(document):
        return 0.0
    return float((query @ document.T).max(axis=1).sum() / len(query))


def combined(scores: dict[Output, float], weights: OutputWeights) -> float:
    """sum(weight * score) / sum(weight) over the outputs of positive weight."""
    total = sum(weights.of(output) for output in scores)
    return sum(weights.of(output) * score for output, score in scores.items()) / total


def weighted_outputs(weights: OutputWeights | None) -> tuple[Output, ...]:
    """The outputs a score needs: dense alone when unset, else those of positive weight."""
    if weights is None:
        return (Output.DENSE,)
    return tuple(output for output in Output if weights.of(output) > 0)
