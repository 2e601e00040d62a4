"""How large an answer will be, estimated before the work that makes it.

Each door bounds what it sends: gRPC refuses to send a message over --max-message-mb,
and the HTTP API caps its responses (--max-http-response-mb). An answer found too large
only when it is sent has already cost its whole computation, and its memory, so
validation (engine/requests/validation.py) refuses it first from these estimates: before any work
where the size follows from the request (vectors, classes, scores, Tokenize's characters),
and after tokenizing but before the forward pass where it follows from the tokens.

The estimates count what dominates an answer: its values, at the door's cost per value,
and a fixed cost per output and per token row. They are near the real size (within a
few percent for token outputs), not above it; the doors also check the real size.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass

from pooling_server.engine.models.model_info import ModelInfo
from pooling_server.engine.requests.encodings import encoded_size
from pooling_server.engine.requests.params import OutputEncoding, Task

MIB = 1024 * 1024


@dataclass(frozen=True)
class ResponseBudget:
    """The largest answer a door sends, and what each part of an answer costs on its wire."""

    max_bytes: int = 16 * MIB
    setting: str = "--max-message-mb"  # what sets max_bytes, named in refusals
    float_bytes: int = 4  # one float value: 4 in protobuf, about 21 as JSON text
    item_bytes: int = 8  # framing of one output (a vector, a matrix, a score)
    # One token row beyond its values: in protobuf the token id, its offsets and its
    # special-token flag; the HTTP API sends the values alone, in brackets.
    row_bytes: int = 12
    # The HTTP API answers in JSON only; gRPC packs the compact encodings.
    encodings: bool = True


GRPC_BUDGET = ResponseBudget()


def _vector_bytes(width: int, encoding: OutputEncoding, budget: ResponseBudget) -> int:
    """One vector (or token row) of `width` values as the door sends it."""
    if encoding is OutputEncoding.FLOAT or not budget.encodings:
        return width * budget.float_bytes
    return encoded_size(width, encoding)


def output_width(task: Task, info: ModelInfo, dimensions: int | None) -> int:
    """Values per output (embed, classify) or per token row (token outputs)."""
    if task in (Task.CLASSIFY, Task.TOKEN_CLASSIFY):
        return max(len(info.labels), 1)
    if task in (Task.EMBED, Task.TOKEN_EMBED):
        return dimensions or info.hidden_size
    return 1


def pooled_bytes(
    task: Task,
    inputs: int,
    info: ModelInfo,
    dimensions: int | None,
    encoding: OutputEncoding,
    budget: ResponseBudget,
) -> int:
    """An answer of one output per input (embed, classify, score): known from the request.
    embed_sparse counts 0 here: how many weights a text keeps is known only once computed."""
    if task is Task.EMBED_SPARSE or task in (Task.TOKEN_EMBED, Task.TOKEN_CLASSIFY):
        return 0
    width = output_width(task, info, dimensions)
    per_item = budget.item_bytes + _vector_bytes(width, encoding, budget)
    if task is Task.CLASSIFY:
        per_item += max((len(label) for label in info.labels), default=0)
    return inputs * per_item


def token_rows_bytes(
    task: Task,
    rows: Iterable[int],
    info: ModelInfo,
    dimensions: int | None,
    encoding: OutputEncoding,
    budget: ResponseBudget,
) -> int:
    """token_embed or token_classify over texts of `rows` tokens each."""
    width = output_width(task, info, dimensions)
    per_row = budget.row_bytes + _vector_bytes(width, encoding, budget)
    if task is Task.TOKEN_CLASSIFY and budget.encodings:  # label id and label, per token
        per_row += 3 + max((len(label) for label in info.labels), default=0)
    counts = list(rows)
    return len(counts) * budget.item_bytes + sum(counts) * per_row


def matrix_bytes(
    rows: Iterable[int], width: int, encoding: OutputEncoding, budget: ResponseBudget
) -> int:
    """Matrices of `rows` rows of `width` values each (embed_multi's and embed_outputs'
    multi output): gRPC packs a matrix's values with its shape (two items' framing, about
    18 bytes measured); JSON brackets each row."""
    counts = list(rows)
    per_row = _vector_bytes(width, encoding, budget)
    if not budget.encodings:
        per_row += budget.row_bytes
    return len(counts) * 2 * budget.item_bytes + sum(counts) * per_row


def sparse_bytes(entries: Iterable[int], budget: ResponseBudget) -> int:
    """Sparse vectors of at most `entries` weights each: an index and a weight apiece."""
    counts = list(entries)
    return len(counts) * budget.item_bytes + sum(counts) * 2 * budget.float_bytes


def late_chunk_count(tokens: int, window: int, overlap: int) -> int:
    """The chunks of the tokens rule over a text of `tokens` content tokens: windows of
    `window` tokens, each starting `window - overlap` after the one before, the last
    reaching the text's end (engine/requests/late_chunking.py's token_window_spans)."""
    if tokens <= 0:
        return 0
    stride = max(window - overlap, 1)
    return 1 + -(-max(tokens - window, 0) // stride)


# One entity of TEI's token classification as JSON, aggregation none, beyond its label,
# word and numbers: {"entity":"","score":,"index":,"word":"","start":,"end":} and its comma
# (58 bytes), and a score as Python writes a float (22 characters at most: 1.2345e-05 in
# full); a WordPiece word may carry "##".
ENTITY_JSON_BYTES = 58 + 22 + 2


def entity_budget(
    max_bytes: int, setting: str, longest_label: int, longest_text: int
) -> ResponseBudget:
    """The budget of a token classification answered as entities (TEI's root route): at
    most one entity per token, each of ENTITY_JSON_BYTES, its label, and three numbers
    as long as the longest text's length; each text's words at most its characters.
    Counted by token_rows_bytes as a row per token with no values."""
    digits = len(str(max(longest_text, 1)))
    return ResponseBudget(
        max_bytes=max_bytes,
        setting=setting,
        float_bytes=0,
        item_bytes=2 + longest_text,
        row_bytes=ENTITY_JSON_BYTES + longest_label + 3 * digits,
        encodings=False,
    )


def fewest_tokens(texts: Iterable[str], specials: int, cap: int | None) -> list[int]:
    """The fewest tokens each text can have, without tokenizing: its special tokens and one
    per whitespace-separated word (WordPiece, BPE and SentencePiece never join two words
    into one token), at most `cap` (truncation, or the maximum length past which the text
    is refused anyway; None where texts run long, chunked)."""
    words_cap = None if cap is None else max(cap - specials, 0)
    floors = [word_count(text, words_cap) + specials for text in texts]
    return floors if cap is None else [min(floor, cap) for floor in floors]


_SPACE = re.compile(r"\s")
WORD_SLICE = 65536  # characters split at a time: a list of one slice's words, never all


def word_count(text: str, most: int | None = None) -> int:
    """The whitespace-separated words of `text`, counted a slice at a time, so that a text
    of many short words never becomes a list of them all; counting stops at `most`."""
    count, start, length, size = 0, 0, len(text), 1024
    while start < length:
        size = min(size * 4, WORD_SLICE)  # small first: a few words may be all it needs
        end = start + size
        found = _SPACE.search(text, end) if end < length else None
        end = found.start() if found is not None else length  # no word cut in two
        count += len(text[start:end].split())
        if most is not None and count >= most:
            return most
        start = end
    return count


def tokenize_bytes(
    tokens_and_lengths: Iterable[tuple[int, int]], budget: ResponseBudget = GRPC_BUDGET
) -> int:
    """A Tokenize answer for texts of (tokens, characters) each. In protobuf (a budget with
    the compact encodings: gRPC's), per token its id, its token string (of one character at
    least) and its offsets, whose varints grow with the text's length. As JSON (TEI's
    /tokenize), per token an object of five fields, at least JSON_TOKEN_BYTES."""
    total = 0
    for tokens, chars in tokens_and_lengths:
        if not budget.encodings:
            total += 2 + tokens * JSON_TOKEN_BYTES
            continue
        offset = _varint_len(chars)
        total += 8 + tokens * (2 + 3 + 2 + 2 * (1 + offset))
    return total


# The least one token costs in TEI's /tokenize answer:
# {"id":1,"text":"a","special":false,"start":0,"stop":1}, and its comma.
JSON_TOKEN_BYTES = 55


def _varint_len(value: int) -> int:
    return max(1, (max(value, 1).bit_length() + 6) // 7)


def megabytes(size: int) -> str:
    return f"{size / MIB:.1f} MiB"
