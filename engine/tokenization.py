"""Turning texts into token sequences: truncation, offsets, special tokens and chunking."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass

from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Encoding:
    """One token sequence as the model sees it, with where each token came from."""

    input_ids: list[int]
    token_type_ids: list[int] | None
    offsets: list[tuple[int, int]]
    special_mask: list[bool]

    def __len__(self) -> int:
        return len(self.input_ids)

    def window(self, positions: Sequence[int]) -> Encoding:
        return Encoding(
            [self.input_ids[i] for i in positions],
            None if self.token_type_ids is None else [self.token_type_ids[i] for i in positions],
            [self.offsets[i] for i in positions],
            [self.special_mask[i] for i in positions],
        )


class ModelTokenizer:
    """A model's tokenizer, safe to call from several threads.

    Hugging Face fast tokenizers keep truncation settings on the shared Rust object,
    so each call sets them under a lock.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, max_input_tokens: int) -> None:
        self._tokenizer = tokenizer
        self._lock = threading.Lock()
        self.max_input_tokens = max_input_tokens
        self.uses_token_type_ids = "token_type_ids" in tokenizer.model_input_names
        self.pad_token_id = _pad_token_id(tokenizer)

    def num_special_tokens(self, pair: bool = False) -> int:
        return self._tokenizer.num_special_tokens_to_add(pair=pair)

    def encode(
        self,
        texts: Sequence[str],
        pairs: Sequence[str] | None = None,
        *,
        truncate: int | None = None,
        side: str = "right",
        add_special_tokens: bool = True,
    ) -> list[Encoding]:
        """Tokenize texts (or text pairs); `truncate` keeps that many tokens, -1 the maximum."""
        if not texts:
            return []
        max_length = self.max_input_tokens if truncate == -1 else truncate
        with self._lock:
            self._tokenizer.truncation_side = side
            batch = self._tokenizer(
                list(texts),
                None if pairs is None else list(pairs),
                add_special_tokens=add_special_tokens,
                truncation="longest_first" if max_length is not None else False,
                max_length=max_length,
                return_offsets_mapping=True,
                return_special_tokens_mask=True,
                return_token_type_ids=self.uses_token_type_ids,
                return_attention_mask=False,
            )
        type_ids = batch.get("token_type_ids") if self.uses_token_type_ids else None
        return [
            Encoding(
                list(batch["input_ids"][i]),
                None if type_ids is None else list(type_ids[i]),
                [tuple(span) for span in batch["offset_mapping"][i]],
                [bool(flag) for flag in batch["special_tokens_mask"][i]],
            )
            for i in range(len(texts))
        ]

    def tokens(self, ids: Sequence[int]) -> list[str]:
        return self._tokenizer.convert_ids_to_tokens(list(ids))

    def chunk(self, encoding: Encoding) -> list[Encoding]:
        """Split a too-long sequence into max-length windows, each with the special tokens."""
        prefix, suffix = special_edges(encoding.special_mask)
        end = len(encoding) - suffix
        window = self.max_input_tokens - prefix - suffix
        head, tail = list(range(prefix)), list(range(end, len(encoding)))
        return [
            encoding.window(head + list(range(start, min(start + window, end))) + tail)
            for start in range(prefix, end, window)
        ]


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
