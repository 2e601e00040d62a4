"""Hugging Face's token-classification answer (InferenceClient.token_classification, on
TEI's root route): a token_classify result grouped into entities as transformers'
token-classification pipeline groups them, so a client gets the pipeline's answer.

Per text: the raw logits of every token become softmax scores (the pipeline's, whatever
the model's own activation); special tokens are dropped; `none` keeps a row per token,
`simple` joins neighbouring tokens of one entity (B-/I- tags), and `first`, `average`
and `max` first join a word's pieces by that rule, then the words. Labels in `ignore`
("O" by default) are left out last.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from pooling_server.engine.inputs.tokenization import ModelTokenizer
from pooling_server.engine.requests.outputs import TokenRows

AGGREGATIONS = ("none", "simple", "first", "average", "max")
DEFAULT_AGGREGATION = "simple"  # what Hugging Face's hosted token classification answers
DEFAULT_IGNORED = ("O",)


@dataclass(frozen=True)
class _Piece:
    """One token of the text: its string (the span's for an unknown token), softmax
    scores, character span, position, and whether it continues the word before it."""

    word: str
    scores: np.ndarray
    start: int
    end: int
    index: int
    is_subword: bool


def entities(
    text: str,
    rows: TokenRows,
    labels: Sequence[str],
    tokenizer: ModelTokenizer,
    aggregation: str,
    ignore: Collection[str],
) -> list[dict[str, Any]]:
    """The pipeline's entity list for one text; `rows.values` are the raw logits."""
    pieces = _pieces(text, rows, tokenizer)
    if aggregation in ("none", "simple"):
        found = [_tagged(piece, labels) for piece in pieces]
    else:
        found = [_word(word, labels, tokenizer, aggregation) for word in _words(pieces)]
    if aggregation != "none":
        found = _groups(found, tokenizer)
    return [e for e in found if e.get("entity", e.get("entity_group")) not in ignore]


def _pieces(text: str, rows: TokenRows, tokenizer: ModelTokenizer) -> list[_Piece]:
    logits = np.asarray(rows.values, dtype=np.float32)
    shifted = np.exp(logits - logits.max(axis=-1, keepdims=True))
    scores = shifted / shifted.sum(axis=-1, keepdims=True)
    words = tokenizer.tokens(rows.token_ids)
    # A tokenizer that marks a word's continuing pieces ("##" in WordPiece) tells them by
    # length; others by the pipeline's heuristic: no space before the piece.
    marked = bool(tokenizer.subword_prefix)
    unknown = tokenizer.unk_id
    pieces = []
    spans = zip(rows.token_ids, rows.offsets, strict=True)
    for index, (token_id, (start, end)) in enumerate(spans):
        if rows.special_tokens_mask[index]:
            continue
        word, span = words[index], text[start:end]
        if token_id == unknown:
            word, is_subword = span, False
        elif marked:
            is_subword = len(word) != len(span)
        else:
            is_subword = start > 0 and " " not in text[start - 1 : start + 1]
        pieces.append(_Piece(word, scores[index], start, end, index, is_subword))
    return pieces


def _tagged(piece: _Piece, labels: Sequence[str]) -> dict[str, Any]:
    best = int(piece.scores.argmax())
    return {
        "entity": labels[best],
        "score": float(piece.scores[best]),
        "index": piece.index,
        "word": piece.word,
        "start": piece.start,
        "end": piece.end,
    }


def _words(pieces: list[_Piece]) -> list[list[_Piece]]:
    words: list[list[_Piece]] = []
    for piece in pieces:
        if words and piece.is_subword:
            words[-1].append(piece)
        else:
            words.append([piece])
    return words


def _word(
    pieces: list[_Piece], labels: Sequence[str], tokenizer: ModelTokenizer, aggregation: str
) -> dict[str, Any]:
    """One word's entity: its first piece's best label, the best label of its most sure
    piece, or the best of its pieces' mean scores."""
    if aggregation == "average":
        scores = np.nanmean(np.stack([piece.scores for piece in pieces]), axis=0)
    elif aggregation == "max":
        scores = max(pieces, key=lambda piece: piece.scores.max()).scores
    else:
        scores = pieces[0].scores
    best = int(scores.argmax())
    return {
        "entity": labels[best],
        "score": float(scores[best]),
        "word": tokenizer.join_tokens([piece.word for piece in pieces]),
        "start": pieces[0].start,
        "end": pieces[-1].end,
    }


def _tag(entity: str) -> tuple[str, str]:
    """("B" or "I", the type): B-PER -> (B, PER); a label without a prefix continues."""
    if entity.startswith(("B-", "I-")):
        return entity[0], entity[2:]
    return "I", entity


def _groups(found: list[dict[str, Any]], tokenizer: ModelTokenizer) -> list[dict[str, Any]]:
    """Neighbours of one type joined, a B- tag starting a new group."""
    runs: list[list[dict[str, Any]]] = []
    for entity in found:
        bi, tag = _tag(entity["entity"])
        if runs and bi != "B" and _tag(runs[-1][-1]["entity"])[1] == tag:
            runs[-1].append(entity)
        else:
            runs.append([entity])
    return [
        {
            "entity_group": run[0]["entity"].split("-", 1)[-1],
            "score": float(np.nanmean([entity["score"] for entity in run])),
            "word": tokenizer.join_tokens([entity["word"] for entity in run]),
            "start": run[0]["start"],
            "end": run[-1]["end"],
        }
        for run in runs
    ]
