"""Turning texts into token sequences: truncation, offsets, special tokens and chunking."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np
from tokenizers import Tokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(slots=True)
class TokenSequence:
    """One token sequence as the model sees it, with where each token came from.

    Not frozen: a frozen dataclass sets each field through object.__setattr__, ~0.5 us
    more per sequence, and an engine process builds one per queued item. Nothing
    changes one after it is made."""

    input_ids: list[int]
    token_type_ids: list[int] | None
    offsets: list[tuple[int, int]]
    special_mask: list[int]  # 1 for special tokens, as the tokenizers library gives it

    def __len__(self) -> int:
        return len(self.input_ids)

    def window(self, positions: Sequence[int]) -> TokenSequence:
        return TokenSequence(
            [self.input_ids[i] for i in positions],
            None if self.token_type_ids is None else [self.token_type_ids[i] for i in positions],
            [self.offsets[i] for i in positions],
            [self.special_mask[i] for i in positions],
        )


@dataclass(frozen=True)
class TokenizerSpec:
    """Everything needed to tokenize as the model does, without transformers: the engine
    process sends it to front ends, which then need neither torch nor transformers."""

    source: str  # the Rust tokenizer's JSON
    uses_token_type_ids: bool
    pad_token_id: int

    @classmethod
    def of(cls, tokenizer: PreTrainedTokenizerBase) -> TokenizerSpec:
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is None:
            raise ValueError("the model needs a fast (Rust `tokenizers`) tokenizer")
        return cls(
            backend.to_str(),
            "token_type_ids" in tokenizer.model_input_names,
            _pad_token_id(tokenizer),
        )


class ModelTokenizer:
    """A model's tokenizer; each calling thread gets its own copy of the Rust tokenizer.

    Truncation settings live on the Rust object, so a shared one would need a lock across
    callers; per-thread copies need none, and each keeps the settings it last used.
    Token sequences come straight from the `tokenizers` library: transformers' batch wrapper
    costs more Python per call than the tokenization of a short text itself.
    """

    def __init__(self, spec: TokenizerSpec, max_input_tokens: int) -> None:
        self.spec = spec
        self._local = threading.local()
        # Shared, its settings never changed after this: ids to tokens, and counting.
        self._shared = Tokenizer.from_str(spec.source)
        self._shared.no_truncation()
        self._shared.no_padding()
        self.max_input_tokens = max_input_tokens
        self.uses_token_type_ids = spec.uses_token_type_ids
        self.pad_token_id = spec.pad_token_id
        self._vocabulary: Vocabulary | None = None

    def _backend(self, max_length: int | None, side: str, split: bool = False) -> Tokenizer:
        """This thread's tokenizer, set to truncate at `max_length` (None: never), and to
        read special tokens' texts as text where `split`."""
        local = self._local
        backend: Tokenizer | None = getattr(local, "backend", None)
        if backend is None:
            backend = Tokenizer.from_str(self.spec.source)
            backend.no_padding()
            local.backend, local.truncation = backend, ()
        if local.truncation != (max_length, side):
            if max_length is None:
                backend.no_truncation()
            else:
                backend.enable_truncation(max_length, strategy="longest_first", direction=side)
            local.truncation = (max_length, side)
        if backend.encode_special_tokens != split:
            backend.encode_special_tokens = split
        return backend

    def special_tokens(self) -> dict[str, int]:
        """The special tokens' texts and ids (those a text's own tokens never hold once
        split_special_tokens is asked)."""
        found = self._shared.get_added_tokens_decoder()
        return {token.content: i for i, token in found.items() if token.special}

    def tokenize(
        self,
        texts: Sequence[str],
        pairs: Sequence[str] | None = None,
        *,
        truncate: int | None = None,
        side: str = "right",
        add_special_tokens: bool = True,
        split_special_tokens: bool = False,
    ) -> list[TokenSequence]:
        """Tokenize texts (or text pairs); `truncate` keeps that many tokens, -1 the maximum.
        `split_special_tokens`: a special token's text in the input is read as text, never
        as that token (a template's user values: a document must not close its turn)."""
        if not texts:
            return []
        max_length = self.max_input_tokens if truncate == -1 else truncate
        backend = self._backend(max_length, side, split_special_tokens)
        shifts: list[tuple[int, int]] = []
        if pairs is None:
            inputs: list[str] | list[tuple[str, str]] = list(texts)
        elif max_length is None:
            inputs = list(zip(texts, pairs, strict=True))
        else:
            inputs, shifts = self._cut_pairs(texts, pairs, max_length, side)
        batch = backend.encode_batch(inputs, add_special_tokens=add_special_tokens)
        types = self.uses_token_type_ids
        sequences = [
            TokenSequence(e.ids, e.type_ids if types else None, e.offsets, e.special_tokens_mask)
            for e in batch
        ]
        for index, shift in enumerate(shifts):
            if shift != (0, 0):  # a side cut on the left: offsets into the whole text
                e = batch[index]
                offsets = [
                    (start + shift[seq], end + shift[seq]) if seq is not None else (start, end)
                    for (start, end), seq in zip(e.offsets, e.sequence_ids, strict=True)
                ]
                sequences[index] = TokenSequence(
                    e.ids, e.type_ids if types else None, offsets, e.special_tokens_mask
                )
        return sequences

    def _cut_pairs(
        self, texts: Sequence[str], pairs: Sequence[str], max_length: int, side: str
    ) -> tuple[list[tuple[str, str]], list[tuple[int, int]]]:
        """Pairs with long sides cut short first, so that `tokenizers` truncates quickly;
        and, per pair, where each side's kept text starts in the whole side.

        Truncating a pair, `tokenizers` builds every combination of the two sides' overflow
        windows: two sides of 7,400 and 800 tokens truncated to 8 took 19 s, a request a
        hostile client can send in 25 KB. Neither side keeps more than `max_length` tokens,
        so each long side is cut, at a token's edge, `PAIR_MARGIN` tokens past that (one
        more on the longer side, so the longer stays longer: longest_first keeps that
        order); the truncation of what is left gives the same tokens.
        """
        out: list[tuple[str, str]] = []
        shifts: list[tuple[int, int]] = []
        keep = max_length + PAIR_MARGIN
        for first, second in zip(texts, pairs, strict=True):
            if len(first) + len(second) <= CHARS_PER_TOKEN_BOUND * max_length:
                out.append((first, second))  # few enough tokens either way
                shifts.append((0, 0))
                continue
            a, b = self._shared.encode_batch([first, second], add_special_tokens=False)
            keep_a, keep_b = min(len(a), keep), min(len(b), keep)
            if len(a) > len(b) and keep_a <= keep_b:
                keep_a = keep_b + 1
            elif len(b) > len(a) and keep_b <= keep_a:
                keep_b = keep_a + 1
            (first, start_a), (second, start_b) = (
                _cut(first, a.offsets, keep_a, side),
                _cut(second, b.offsets, keep_b, side),
            )
            out.append((first, second))
            shifts.append((start_a, start_b))
        return out, shifts

    def token_arrays(
        self, texts: Sequence[str], add_special_tokens: bool = True
    ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Each text's (ids, [start, end) offsets, special mask) as arrays, untruncated
        (Tokenize's). Texts go to `tokenizers` in groups of about GROUP_CHARS characters,
        each group's lists dropped once copied: a text of a million tokens never has them
        all as Python ints and tuples at once beside the others'."""
        backend = self._backend(None, "right")
        group: list[str] = []
        chars = 0
        for n, text in enumerate(texts):
            group.append(text)
            chars += len(text)
            if chars < GROUP_CHARS and n + 1 < len(texts):
                continue
            for e in backend.encode_batch(group, add_special_tokens=add_special_tokens):
                ids = np.array(e.ids, dtype=np.int64)
                offsets = np.array(e.offsets, dtype=np.int64).reshape(len(ids), 2)
                yield ids, offsets, np.array(e.special_tokens_mask, dtype=bool).reshape(-1)
            group, chars = [], 0

    def tokens(self, ids: Sequence[int]) -> list[str]:
        to_token = self._shared.id_to_token
        return [to_token(i) for i in ids]

    def join_tokens(self, tokens: Sequence[str]) -> str:
        """Token strings as text by the tokenizer's decoder, as transformers'
        convert_tokens_to_string joins them ("john", "##son" -> "johnson")."""
        decoder = self._shared.decoder
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)

    @property
    def subword_prefix(self) -> str:
        """What marks a word's continuing pieces ("##" in WordPiece); "" if none does."""
        return getattr(self._shared.model, "continuing_subword_prefix", None) or ""

    @property
    def unk_id(self) -> int | None:
        """The unknown token's id (None: the tokenizer has none)."""
        token = getattr(self._shared.model, "unk_token", None)
        return None if token is None else self._shared.token_to_id(token)

    def vocabulary(self) -> Vocabulary:
        """Every token's string as bytes, built once: the doors copy a long text's token
        strings out of it with numpy, where a string per token costs ~60 bytes of Python."""
        table = self._vocabulary
        if table is None:  # two threads may both build it: the same table either way
            table = self._vocabulary = Vocabulary.of(self.tokens(range(self.vocab_size)))
        return table

    @property
    def vocab_size(self) -> int:
        """Ids below this are tokens (added tokens included)."""
        return int(self._shared.get_vocab_size(with_added_tokens=True))

    def decode(self, ids: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """Token id sequences back to text (TEI's /decode); ids must be below vocab_size."""
        batch = [list(sequence) for sequence in ids]
        return list(self._shared.decode_batch(batch, skip_special_tokens=skip_special_tokens))

    def chunk(self, sequence: TokenSequence) -> list[TokenSequence]:
        """Split a too-long sequence into max-length windows, each with the special tokens."""
        prefix, suffix = special_edges(sequence.special_mask)
        end = len(sequence) - suffix
        window = self.max_input_tokens - prefix - suffix
        head, tail = list(range(prefix)), list(range(end, len(sequence)))
        return [
            sequence.window(head + list(range(start, min(start + window, end))) + tail)
            for start in range(prefix, end, window)
        ]


@dataclass(frozen=True)
class Vocabulary:
    """Token strings by id, packed: `utf8[starts[i]:starts[i] + lengths[i]]` is token i's
    UTF-8, and the `json_` arrays hold it escaped as inside a JSON string."""

    utf8: np.ndarray  # uint8
    starts: np.ndarray  # int64, one per id
    lengths: np.ndarray  # int64
    json_utf8: np.ndarray
    json_starts: np.ndarray
    json_lengths: np.ndarray

    @classmethod
    def of(cls, tokens: Sequence[str | None]) -> Vocabulary:
        raw = [(token or "").encode("utf-8", "replace") for token in tokens]
        escaped = [msgspec.json.encode(token or "")[1:-1] for token in tokens]
        return cls(*_packed(raw), *_packed(escaped))


def _packed(pieces: Sequence[bytes]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    lengths = np.fromiter(map(len, pieces), dtype=np.int64, count=len(pieces))
    starts = np.zeros(len(pieces), dtype=np.int64)
    np.cumsum(lengths[:-1], out=starts[1:])
    return np.frombuffer(b"".join(pieces), dtype=np.uint8), starts, lengths


# Characters of texts tokenized together by token_arrays: small texts share one call (and
# the library's threads), a long one goes alone.
GROUP_CHARS = 65536

# See ModelTokenizer._cut_pairs: tokens kept past the truncation length when a pair's side
# is cut, so that the cut edge never changes a kept token; and a pair of at most this many
# characters per token of the length is left whole (its overflow windows are few).
PAIR_MARGIN = 16
CHARS_PER_TOKEN_BOUND = 4


def _cut(text: str, offsets: Sequence[tuple[int, int]], keep: int, side: str) -> tuple[str, int]:
    """The span of `text`'s first (right truncation) or last `keep` tokens, and its start."""
    if len(offsets) <= keep:
        return text, 0
    if side == "right":
        return text[: offsets[keep - 1][1]], 0
    start = offsets[len(offsets) - keep][0]
    return text[start:], start


def special_edges(special_mask: Sequence[bool]) -> tuple[int, int]:
    """How many special tokens lead and trail a sequence."""
    prefix = next((i for i, special in enumerate(special_mask) if not special), len(special_mask))
    if prefix == len(special_mask):
        return prefix, 0
    suffix = next(i for i, special in enumerate(reversed(special_mask)) if not special)
    return prefix, suffix


def _pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """Padded positions are masked out, so any id works when a tokenizer has no pad token."""
    for candidate in (tokenizer.pad_token_id, tokenizer.eos_token_id, tokenizer.unk_token_id):
        if candidate is not None:
            return int(candidate)
    return 0
