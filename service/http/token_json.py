"""TEI's /tokenize answer laid out from the token arrays (service/byte_layout.py).

[[{"id", "text", "special", "start", "stop"}, ...], ...]: one object per token, whose
`text` is the input's span of the token, or the token itself for a special token (which
has no span: its start and stop are null). As dicts, a text of a million tokens is five
million Python objects; here it is a few numpy passes, and the exact size is known, and
refused over the cap, before a byte is written.
"""

from __future__ import annotations

import msgspec
import numpy as np

from pooling_server.engine.inputs.tokenization import Vocabulary
from pooling_server.engine.requests.output_size import ResponseBudget
from pooling_server.engine.requests.size_rules import output_too_large
from pooling_server.engine.scheduling.engine import Tokenized, TokenizedText
from pooling_server.service.byte_layout import Layout, json_escaped

TOKEN_BLOCK = 16384  # tokens laid out at once: bounds the layout's arrays


def tokenize_json(tokenized: Tokenized, budget: ResponseBudget) -> bytes:
    """The answer's bytes, or OUTPUT_TOO_LARGE (naming `budget`'s setting) past its cap."""
    vocabulary = tokenized.vocabulary
    texts = []
    size = 2 + max(len(tokenized.items) - 1, 0)  # the outer brackets and commas
    for text, item in zip(tokenized.inputs, tokenized.items, strict=True):
        escaped = json_escaped(text)
        blocks = 0 if escaped is None else sum(b.size() for b in _blocks(item, escaped, vocabulary))
        size += 2 + (len(_objects(text, item, vocabulary)) if escaped is None else blocks)
        texts.append(escaped)
        if size > budget.max_bytes:
            break  # over already: the rest need not be counted
    if size > budget.max_bytes:
        raise output_too_large("inputs", size, budget)
    out = [b"["]
    for n, (text, item, escaped) in enumerate(
        zip(tokenized.inputs, tokenized.items, texts, strict=True)
    ):
        out.append(b",[" if n else b"[")
        if escaped is None:
            out.append(_objects(text, item, vocabulary)[1:-1])
        else:
            out += (block.build() for block in _blocks(item, escaped, vocabulary))
        out.append(b"]")
    out.append(b"]")
    return b"".join(out)


def _blocks(
    item: TokenizedText, escaped: tuple[np.ndarray, np.ndarray], vocabulary: Vocabulary
) -> list[Layout]:
    """One text's token objects, comma-separated, a block of tokens at a time."""
    buffer, places = escaped
    layouts = []
    for first in range(0, len(item), TOKEN_BLOCK):
        ids = item.token_ids[first : first + TOKEN_BLOCK]
        special = item.special_mask[first : first + TOKEN_BLOCK]
        plain = ~special
        offsets = item.offsets[first : first + TOKEN_BLOCK]
        start = np.clip(offsets[:, 0], 0, len(places) - 1)
        stop = np.clip(offsets[:, 1], start, len(places) - 1)
        inside = (ids >= 0) & (ids < len(vocabulary.json_lengths))
        known = np.where(inside, ids, 0)
        comma = np.ones(len(ids), dtype=bool)
        comma[0] = first > 0
        layouts.append(
            Layout(len(ids))
            .fixed(b",", comma)
            .fixed(b'{"id":')
            .decimals(ids)
            .fixed(b',"text":"')
            .spans(buffer, places[start], places[stop] - places[start], plain)
            .spans(
                vocabulary.json_utf8,
                vocabulary.json_starts[known],
                np.where(inside, vocabulary.json_lengths[known], 0),
                special,
            )
            .fixed(b'","special":true,"start":null,"stop":null}', special)
            .fixed(b'","special":false,"start":', plain)
            .decimals(offsets[:, 0], plain)
            .fixed(b',"stop":', plain)
            .decimals(offsets[:, 1], plain)
            .fixed(b"}", plain)
        )
    return layouts


def _objects(text: str, item: TokenizedText, vocabulary: Vocabulary) -> bytes:
    """One text's token list the plain way: for a text the byte count cannot map (a lone
    surrogate), which no long answer is made of."""
    tokens = []
    for token_id, special, (start, stop) in zip(
        item.token_ids.tolist(), item.special_mask.tolist(), item.offsets.tolist(), strict=True
    ):
        if special:
            at = vocabulary.starts[token_id]
            name = bytes(vocabulary.utf8[at : at + vocabulary.lengths[token_id]]).decode()
        tokens.append(
            {
                "id": token_id,
                "text": name if special else text[start:stop],
                "special": special,
                "start": None if special else start,
                "stop": None if special else stop,
            }
        )
    return msgspec.json.encode(tokens)
