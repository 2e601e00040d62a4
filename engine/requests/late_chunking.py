"""Late chunking: one vector per chunk of a text, each the mean of the chunk's token states
from a pass over the whole text, so every chunk keeps the context around it.

Chunks are character spans [start, end) of the text (Unicode code points, as token_embed's
offsets). A chunk holds the tokens from the first whose span overlaps it to the last, the
model's special tokens never (nor a prompt's): a span inside one token is that token.

A text longer than the model's maximum length is read in macro-windows of that length,
consecutive ones sharing a quarter of it; each token's state comes from the window whose
centre is nearest the token (so it has the most context on its shorter side), and a chunk
across windows is the token-weighted mean of its parts. The token ranges travel to the
model runner, which returns only their mean states (projected by the model's Dense modules,
if any): the token states never leave the engine.
"""

from __future__ import annotations

import itertools
import re
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from pooling_server.engine.errors import FieldViolation, PoolingError
from pooling_server.engine.inputs.tokenization import TokenSequence, special_edges
from pooling_server.engine.models.served import ServedModel
from pooling_server.engine.requests.encodings import NEEDS_RANGES, encode, ranges_array
from pooling_server.engine.requests.heads import normalize, truncate_dimensions
from pooling_server.engine.requests.output_size import late_chunk_count, pooled_bytes
from pooling_server.engine.requests.outputs import Embedding, ItemOutput, LateChunks
from pooling_server.engine.requests.params import OutputEncoding, Task
from pooling_server.engine.requests.request import ChunkRule, PoolRequest
from pooling_server.engine.requests.resolved import Limits, Resolved
from pooling_server.engine.requests.size_rules import (
    check_tokenized,
    output_too_large,
    response_budget,
)

Work = list[tuple[TokenSequence, bool | tuple[int, ...]]]
Finish = Callable[[list[np.ndarray]], list[ItemOutput]]

# Consecutive macro-windows share this fraction of their content tokens.
MACRO_OVERLAP = 0.25

# A sentence ends at . ! ? (or their CJK forms), with any closing quotes or brackets, before
# whitespace or the text's end; a line break ends one too.
_SENTENCE_END = re.compile(r"[.!?\u3002\uff01\uff1f]+[\"'\u201d\u2019)\]]*(?=\s|$)|\n")


def sentence_spans(text: str) -> list[tuple[int, int]]:
    """Each sentence's span, without the whitespace around it; blank pieces dropped."""
    spans, start = [], 0
    for match in _SENTENCE_END.finditer(text):
        spans.append((start, match.end()))
        start = match.end()
    spans.append((start, len(text)))
    trimmed = []
    for a, b in spans:
        piece = text[a:b]
        stripped = piece.strip()
        if stripped:
            a += len(piece) - len(piece.lstrip())
            trimmed.append((a, a + len(stripped)))
    return trimmed


_NONSPACE = re.compile(r"\S")


def sentence_count(text: str, most: int | None = None) -> int:
    """How many spans sentence_spans gives, counted without building them; counting stops
    at `most` (a bound past which the answer is refused anyway)."""
    count, start = 0, 0
    for match in _SENTENCE_END.finditer(text):
        if _NONSPACE.search(text, start, match.end()):
            count += 1
            if most is not None and count >= most:
                return count
        start = match.end()
    return count + bool(_NONSPACE.search(text, start))


def token_window_spans(
    offsets: Sequence[tuple[int, int]], window: int, overlap: int
) -> list[tuple[int, int]]:
    """Spans of `window` consecutive tokens (content tokens' offsets), each starting
    `window - overlap` tokens after the one before; the last reaches the last token."""
    spans, stride = [], window - overlap
    for first in range(0, len(offsets), stride):
        last = min(first + window, len(offsets)) - 1
        spans.append((offsets[first][0], offsets[last][1]))
        if last == len(offsets) - 1:
            break
    return spans


class TokenFinder:
    """Which content tokens a character span covers, found by binary search on the token
    offsets (a rule may ask for a chunk per token of a long text); a tokenizer whose
    offsets go backwards anywhere is searched token by token instead."""

    def __init__(self, offsets: Sequence[tuple[int, int]], content: range) -> None:
        self.content = content
        pairs = np.asarray([offsets[i] for i in content], dtype=np.int64).reshape(-1, 2)
        self.starts, self.ends = pairs[:, 0], pairs[:, 1]
        self.sorted = bool(np.all(np.diff(self.starts) >= 0) and np.all(np.diff(self.ends) >= 0))

    def __call__(self, span: tuple[int, int]) -> tuple[int, int] | None:
        """The token range [a, b) of sequence positions from the first token whose span
        overlaps `span` to the last; None where it covers no token."""
        start, end = span
        if self.sorted:
            first = int(np.searchsorted(self.ends, start, side="right"))
            last = int(np.searchsorted(self.starts, end, side="left")) - 1
        else:
            hits = np.flatnonzero((self.ends > start) & (self.starts < end))
            first, last = (int(hits[0]), int(hits[-1])) if len(hits) else (1, 0)
        if first > last:
            return None
        return self.content.start + first, self.content.start + last + 1


def macro_windows(length: int, prefix: int, suffix: int, max_tokens: int) -> list[range]:
    """The content positions of each macro-window of a sequence of `length` tokens: whole
    windows of `max_tokens` with the special tokens, the last one ending at the text's end."""
    end = length - suffix
    size = max_tokens - prefix - suffix
    if length <= max_tokens:
        return [range(prefix, end)]
    stride = max(1, size - int(size * MACRO_OVERLAP))
    starts = [*list(range(prefix, end - size, stride)), end - size]
    return [range(s, s + size) for s in starts]


def owned(windows: Sequence[range]) -> list[range]:
    """The positions whose state each window gives: those nearer its centre than any other
    window's (ties to the earlier window), so each window owns a contiguous run."""
    cuts = [windows[0].start]
    for left, right in itertools.pairwise(windows):
        cuts.append((right.start + left.stop - 1) // 2 + 1)
    cuts.append(windows[-1].stop)
    return [range(cuts[k], cuts[k + 1]) for k in range(len(windows))]


@dataclass(frozen=True)
class _Part:
    """A chunk's share of one window's pools: which chunk, its tokens, which pool."""

    chunk: int
    tokens: int
    item: int  # index of the window in the plan's work
    pool: int  # index of the mean among that window's pools


def _refusal(path: str, description: str, reason: str) -> PoolingError:
    return PoolingError.invalid([FieldViolation(path, description, reason)])


def _spans(
    request: PoolRequest, text: str, sequence: TokenSequence, shift: int, content: range
) -> list[tuple[int, int]]:
    """The request's spans, or the rule's for this text (offsets less the prompt's `shift`)."""
    chunking = request.late_chunking
    assert chunking is not None
    if chunking.rule is ChunkRule.SENTENCES:
        return sentence_spans(text)
    if chunking.rule is ChunkRule.TOKENS:
        offsets = [
            (sequence.offsets[i][0] - shift, sequence.offsets[i][1] - shift) for i in content
        ]
        return token_window_spans(offsets, chunking.window, chunking.overlap)
    return list(chunking.spans)


def plan_late_chunking(
    resolved: Resolved, model: ServedModel, limits: Limits
) -> tuple[Work, Finish]:
    """The windows to compute, each with the token ranges whose means it returns, and how
    those means become each text's chunks."""
    request, info = resolved.request, model.info
    chunking = request.late_chunking
    assert chunking is not None
    prompt = resolved.prompt or ""
    texts = [prompt + text for text in request.texts]
    sequences = model.tokenizer.tokenize(texts, truncate=None)
    check_tokenized(resolved, limits, "embed.texts", [len(e) for e in sequences])
    shift = len(prompt)
    contents = [_content(sequence, shift) for sequence in sequences]
    # One vector per chunk: the answer's size is known now, before any chunk is built.
    _check_chunks(resolved, limits, contents)
    work: Work = []
    plans: list[tuple[list[tuple[int, int]], list[_Part]]] = []
    for index, (text, sequence) in enumerate(zip(request.texts, sequences, strict=True)):
        prefix, suffix = special_edges(sequence.special_mask)
        content = contents[index]
        offsets = [(a - shift, b - shift) for a, b in sequence.offsets]
        spans = _spans(request, text, sequence, shift, content)
        if not spans:  # nothing to compute; a job of no work would never finish
            raise _refusal(
                f"embed.texts[{index}]",
                f"gives no chunk under the {chunking.rule} rule (it holds no token)",
                "LATE_CHUNKS_NONE",
            )
        ranges, find = [], TokenFinder(offsets, content)
        for k, span in enumerate(spans):
            found = find(span)
            if found is None:
                path = f"late_chunking.spans[{k}]" if chunking.spans else f"embed.texts[{index}]"
                raise _refusal(
                    path,
                    f"the span [{span[0]}, {span[1]}) covers no token of the text "
                    "(only whitespace or characters the tokenizer drops); widen it",
                    "LATE_CHUNK_NO_TOKENS",
                )
            ranges.append(found)
        windows = macro_windows(len(sequence), prefix, suffix, info.max_input_tokens)
        owns = owned(windows)
        firsts = [own.start for own in owns]
        pools: list[list[int]] = [[] for _ in windows]
        shares = []  # (chunk, tokens, window, pool): each chunk visits only its windows
        for k, (a, b) in enumerate(ranges):
            for w in range(bisect_right(firsts, a) - 1, bisect_right(firsts, b - 1)):
                lo, hi = max(a, owns[w].start), min(b, owns[w].stop)
                local = windows[w].start - prefix  # the window's first content position
                shares.append((k, hi - lo, w, len(pools[w]) // 2))
                pools[w] += [lo - local, hi - local]
        items = {}
        head = list(range(prefix))
        tail = list(range(len(sequence) - suffix, len(sequence)))
        for w, window in enumerate(windows):
            if pools[w]:  # a window no chunk needs is not computed
                items[w] = len(work)
                work.append((sequence.window(head + list(window) + tail), tuple(pools[w])))
        parts = [_Part(k, n, items[w], pool) for k, n, w, pool in shares]
        if info.projected and len({p.chunk for p in parts}) < len(parts):
            raise _refusal(
                f"embed.texts[{index}]",
                f"has {len(sequence)} tokens, more than the maximum of {info.max_input_tokens}, "
                f'and a chunk runs across macro-windows; model "{info.name}" projects its '
                "vectors (Dense modules), which needs each chunk's tokens in one window: "
                "use shorter texts or chunks",
                "LATE_CHUNK_ACROSS_WINDOWS",
            )
        plans.append((spans, parts))

    def finish(raws: list[np.ndarray]) -> list[ItemOutput]:
        return [_chunks(request, model, spans, parts, raws) for spans, parts in plans]

    return work, finish


def _content(sequence: TokenSequence, shift: int) -> range:
    """The text's own tokens: not the specials, nor a prompt's (`shift` characters)."""
    prefix, suffix = special_edges(sequence.special_mask)
    content = range(prefix, len(sequence) - suffix)
    first = next((i for i in content if sequence.offsets[i][1] > shift), content.stop)
    return range(first, content.stop)


def _check_chunks(resolved: Resolved, limits: Limits, contents: Sequence[range]) -> None:
    """The chunks counted from the token counts and the rule (the sentences' count on the
    texts, as validation counted it, and no further than the budget holds), and the
    answer refused, before any span, token range or window is built."""
    request, info = resolved.request, resolved.info
    chunking = request.late_chunking
    assert chunking is not None
    budget = response_budget(request, limits)
    dims, encoding = request.params.dimensions, request.encoding
    one = pooled_bytes(Task.EMBED, 1, info, dims, encoding, budget)
    most = budget.max_bytes // max(one, 1) + 1
    if chunking.spans:
        chunks = len(chunking.spans)
    elif chunking.rule is ChunkRule.TOKENS:
        chunks = sum(late_chunk_count(len(c), chunking.window, chunking.overlap) for c in contents)
    else:
        chunks = 0
        for text in request.texts:
            chunks += sentence_count(text, most - chunks)
            if chunks >= most:
                break
    if chunks * one > budget.max_bytes:
        raise output_too_large("embed.texts", chunks * one, budget)


def _chunks(
    request: PoolRequest,
    model: ServedModel,
    spans: list[tuple[int, int]],
    parts: list[_Part],
    raws: list[np.ndarray],
) -> LateChunks:
    """Each chunk's parts joined (weighted by their tokens), then the embed heads: matryoshka
    dimensions, normalisation (use_activation, else the model's default), the encoding."""
    info = model.info
    width = raws[parts[0].item].shape[-1] if parts else info.hidden_size
    sums = np.zeros((len(spans), width), dtype=np.float64)
    counts = np.zeros(len(spans), dtype=np.float64)
    for part in parts:
        sums[part.chunk] += raws[part.item][part.pool] * part.tokens
        counts[part.chunk] += part.tokens
    values = truncate_dimensions(sums / counts[:, None], request.params.dimensions)
    use = request.params.use_activation
    if info.default_normalize if use is None else use:
        values = normalize(values)
    values = values.astype(np.float32)
    ranges = None
    if request.encoding in NEEDS_RANGES:
        ranges = ranges_array(info.calibration_ranges)
    embeddings = [
        Embedding(row)
        if request.encoding is OutputEncoding.FLOAT
        else Embedding(row, request.encoding, encode(row, request.encoding, ranges))
        for row in values
    ]
    return LateChunks(list(spans), embeddings)
