"""Answers laid out byte by byte with numpy, for answers that grow with their input.

A Tokenize answer for a text of a million tokens, built the usual way, is a million
Python ints, strings, tuples and messages (or dicts): hundreds of megabytes for a 15 MB
answer, and seconds of one core. Here an answer is rows (one per token) of parts laid
end to end: fixed bytes, numbers (protobuf varints, JSON decimals) and spans copied out of
a buffer (a token's string from the vocabulary, its text from the input). The exact size
is known from the parts' lengths before a byte is written, so an answer over the cap is
refused unbuilt; building it is a few numpy passes over the rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np


@dataclass(frozen=True)
class _Part:
    lengths: np.ndarray  # int64, one per row (0: nothing in that row)
    # uint8: the bytes (fixed), the buffer (a span), or the values (numbers)
    data: np.ndarray
    starts: np.ndarray | None = None  # for a span: where each row's bytes start in `data`
    digits: Callable[[np.ndarray, np.ndarray], np.ndarray] | None = None  # numbers' bytes


class Layout:
    """Rows of parts, in row order and, within a row, in the order they were added."""

    def __init__(self, rows: int) -> None:
        self.rows = rows
        self._parts: list[_Part] = []

    def fixed(self, data: bytes, where: np.ndarray | None = None) -> Layout:
        """The same bytes in each row (`where`: only in the rows it marks)."""
        lengths = np.full(self.rows, len(data), dtype=np.int64)
        if where is not None:
            lengths[~where] = 0
        self._parts.append(_Part(lengths, np.frombuffer(data, dtype=np.uint8)))
        return self

    def varints(self, values: np.ndarray, where: np.ndarray | None = None) -> Layout:
        """Non-negative integers as protobuf varints."""
        values = np.asarray(values, dtype=np.uint64).ravel()
        return self._numbers(values, varint_lengths(values), _varint_matrix, where)

    def decimals(self, values: np.ndarray, where: np.ndarray | None = None) -> Layout:
        """Non-negative integers as decimal text (JSON numbers)."""
        values = np.asarray(values, dtype=np.int64).ravel()
        return self._numbers(values, decimal_lengths(values), _decimal_matrix, where)

    def spans(
        self,
        buffer: np.ndarray,
        starts: np.ndarray,
        lengths: np.ndarray,
        where: np.ndarray | None = None,
    ) -> Layout:
        """`buffer[starts[i]:starts[i] + lengths[i]]` in row i."""
        lengths = np.asarray(lengths, dtype=np.int64).copy()
        if where is not None:
            lengths[~where] = 0
        self._parts.append(_Part(lengths, buffer, np.asarray(starts, dtype=np.int64)))
        return self

    def _numbers(
        self,
        values: np.ndarray,
        lengths: np.ndarray,
        digits: Callable[[np.ndarray, np.ndarray], np.ndarray],
        where: np.ndarray | None,
    ) -> Layout:
        if where is not None:
            lengths = lengths.copy()
            lengths[~where] = 0
        self._parts.append(_Part(lengths, values, digits=digits))
        return self

    def row_sizes(self) -> np.ndarray:
        sizes = np.zeros(self.rows, dtype=np.int64)
        for part in self._parts:
            sizes += part.lengths
        return sizes

    def size(self) -> int:
        return int(sum(int(part.lengths.sum()) for part in self._parts))

    def build(self) -> bytes:
        if not self._parts or self.rows == 0:
            return b""
        lengths = np.stack([part.lengths for part in self._parts], axis=1)  # (rows, parts)
        flat = lengths.ravel()
        places = (np.cumsum(flat) - flat).reshape(lengths.shape)  # where each part begins
        out = np.empty(int(flat.sum()), dtype=np.uint8)
        for k, part in enumerate(self._parts):
            at = places[:, k]
            if part.starts is not None:
                self._copy_spans(out, at, part)
            elif part.digits is None:  # the same bytes in each row that has them
                rows = at[part.lengths > 0]
                out[rows[:, None] + np.arange(len(part.data))] = part.data
            else:  # numbers: each row's leading bytes of their (rows, width) block
                block = part.digits(part.data, part.lengths)
                keep = np.arange(block.shape[1])[None, :] < part.lengths[:, None]
                within = np.broadcast_to(np.arange(block.shape[1]), block.shape)[keep]
                out[np.repeat(at, part.lengths) + within] = block[keep]
        return out.tobytes()

    def _copy_spans(self, out: np.ndarray, at: np.ndarray, part: _Part) -> None:
        assert part.starts is not None
        total = int(part.lengths.sum())
        if total == 0:
            return
        rows = np.repeat(np.arange(self.rows), part.lengths)
        firsts = np.cumsum(part.lengths) - part.lengths
        within = np.arange(total, dtype=np.int64) - firsts[rows]
        out[at[rows] + within] = part.data[part.starts[rows] + within]


def varint_lengths(values: np.ndarray) -> np.ndarray:
    """Each non-negative integer's length as a protobuf varint."""
    v = np.asarray(values, dtype=np.uint64)
    lengths = np.ones(v.shape, dtype=np.int64)
    for k in range(1, 10):
        above = v >> np.uint64(7 * k)
        if not above.any():
            break
        lengths += above > 0
    return lengths


def decimal_lengths(values: np.ndarray) -> np.ndarray:
    """Each non-negative integer's count of decimal digits."""
    v = np.asarray(values, dtype=np.int64)
    lengths = np.ones(v.shape, dtype=np.int64)
    for k in range(1, 19):
        above = v >= 10**k
        if not above.any():
            break
        lengths += above
    return lengths


def _varint_matrix(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    width = int(lengths.max(initial=1))
    data = np.empty((len(values), width), dtype=np.uint8)
    for k in range(width):
        seven = (values >> np.uint64(7 * k)) & np.uint64(0x7F)
        data[:, k] = seven | np.where(lengths > k + 1, 0x80, 0).astype(np.uint64)
    return data


def _decimal_matrix(values: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Most significant digit first: row i's number is its first lengths[i] bytes."""
    width = int(lengths.max(initial=1))
    data = np.empty((len(values), width), dtype=np.uint8)
    for k in range(width):
        power = 10 ** np.maximum(lengths - 1 - k, 0)
        data[:, k] = (values // power) % 10 + ord("0")
    return data


def varint(value: int) -> bytes:
    out = bytearray()
    while value > 0x7F:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def json_escaped(text: str) -> tuple[np.ndarray, np.ndarray] | None:
    """`text` escaped as inside a JSON string, as bytes, and where each character's bytes
    start (one more entry: the end), so that a span of characters is a span of bytes.
    None where the text holds what this count does not know (a lone surrogate)."""
    try:
        escaped = np.frombuffer(text.encode("utf-8"), dtype=np.uint8)
    except UnicodeEncodeError:
        return None
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    sizes = np.select(
        [points < 0x80, points < 0x800, points < 0x10000], [1, 2, 3], default=4
    ).astype(np.int64)
    quoted = (points == 0x22) | (points == 0x5C) | np.isin(points, (8, 9, 10, 12, 13))
    control = (points < 0x20) & ~quoted
    if quoted.any() or control.any():  # as msgspec writes them: \" \\ \n ... and \u00XX
        sizes[quoted] = 2
        sizes[control] = 6
        escaped = np.frombuffer(msgspec.json.encode(text)[1:-1], dtype=np.uint8)
    places = np.zeros(len(points) + 1, dtype=np.int64)
    np.cumsum(sizes, out=places[1:])
    if places[-1] != len(escaped):
        return None
    return escaped, places
