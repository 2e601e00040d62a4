"""Counting a gRPC message's inputs on its wire bytes, before protobuf parses them.

Parsing a 16 MB PoolRequest of four million two-character texts takes protobuf a third
of a second or more with the GIL held (the event loop waits) and about 200 MB of arena,
before any rule could look at the count. So a large message is walked first: its fields
are skipped by their length prefixes, and the entries of each input list are counted,
stopping at the first list over the limit. Legitimate messages cost one step per text.

The walk decides only what it can decide cheaply. Within its step budget, or on bytes it
cannot read, it says nothing, and protobuf parses the message as usual (reporting any
malformation itself).
"""

from __future__ import annotations

# Messages smaller than this are parsed at once: they hold a few tens of thousands of
# entries at most, cheap to parse, and the request rules count them.
PRECOUNT_BYTES = 64 * 1024

# What to count in each request message: field number -> (path name, the submessage's
# own table, or None for a repeated string to count).
Spec = dict[int, tuple[str, "Spec | None"]]
_TEXTS: Spec = {1: ("texts", None)}
# TextInput: texts, or an image model's items (Item messages, counted alike), and its
# zero-shot candidate labels.
_TEXT_INPUT: Spec = {1: ("texts", None), 2: ("items", None), 3: ("candidate_labels", None)}
_SCORE: Spec = {
    1: ("text_1", None),
    2: ("text_2", None),
    3: ("items_1", None),
    4: ("items_2", None),
}
POOL_REQUEST: Spec = {
    4: ("embed", _TEXT_INPUT),
    5: ("classify", _TEXT_INPUT),
    6: ("score", _SCORE),
    7: ("token_embed", _TEXT_INPUT),
    8: ("token_classify", _TEXT_INPUT),
    9: ("embed_sparse", _TEXTS),
    13: ("embed_multi", _TEXT_INPUT),
    14: ("late_chunking", {1: ("spans", None)}),
    15: ("embed_outputs", _TEXTS),
}
SPECS: dict[str, Spec] = {
    "PoolRequest": POOL_REQUEST,
    "PoolStreamRequest": {1: ("request", POOL_REQUEST)},
    "RerankRequest": {4: ("documents", None), 9: ("items", None)},
    "TokenizeRequest": {2: ("texts", None)},
}


class _Undecided(Exception):
    """The walk stops without a verdict: over its budget, or bytes it cannot read."""


def _varint(data: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[pos]  # IndexError past the end: the caller's _Undecided
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
        if shift > 63:
            raise _Undecided


class _Walk:
    def __init__(self, data: bytes, limit: int) -> None:
        self.data = data
        self.limit = limit
        self.steps = 3 * limit + 256  # every input list full, and the other fields
        self.counts: dict[str, int] = {}

    def over(self, pos: int, end: int, spec: Spec, prefix: str) -> str | None:
        """The path of the first list of `spec` with more than `limit` entries."""
        data = self.data
        while pos < end:
            key, pos = _varint(data, pos)
            self.steps -= 1
            if self.steps < 0:
                raise _Undecided
            number, wire = key >> 3, key & 7
            if wire == 0:
                _, pos = _varint(data, pos)
                continue
            if wire == 1 or wire == 5:
                pos += 8 if wire == 1 else 4
                continue
            if wire != 2:
                raise _Undecided  # groups, or not protobuf
            length, pos = _varint(data, pos)
            stop = pos + length
            if stop > end:
                raise _Undecided
            entry = spec.get(number)
            if entry is not None:
                name, inner = entry
                path = prefix + name
                if inner is None:
                    count = self.counts[path] = self.counts.get(path, 0) + 1
                    if count > self.limit:
                        return path
                else:
                    found = self.over(pos, stop, inner, path + ".")
                    if found is not None:
                        return found
            pos = stop
        if pos != end:
            raise _Undecided
        return None


def list_over_limit(data: bytes, spec: Spec, limit: int) -> str | None:
    """The field path of an input list in `data` (a message of `spec`) with more than
    `limit` entries, e.g. "embed.texts"; None when none is, or when that is not known
    cheaply. Every occurrence of a list counts, as protobuf merges them."""
    if len(data) < PRECOUNT_BYTES:
        return None
    try:
        return _Walk(data, limit).over(0, len(data), spec, "")
    except (_Undecided, IndexError, RecursionError):
        return None


def string_at(data: bytes, path: tuple[int, ...], steps: int = 1024) -> str:
    """The string at field-number `path` (submessages, then a string field), as protobuf
    would read it (the last occurrence wins); "" when absent or not cheaply found. A
    refused stream message keeps its request_id this way."""
    try:
        return _string_at(data, 0, len(data), path, [steps])
    except (_Undecided, IndexError, UnicodeDecodeError):
        return ""


def _string_at(data: bytes, pos: int, end: int, path: tuple[int, ...], steps: list[int]) -> str:
    found = ""
    while pos < end:
        key, pos = _varint(data, pos)
        steps[0] -= 1
        if steps[0] < 0:
            raise _Undecided
        number, wire = key >> 3, key & 7
        if wire == 0:
            _, pos = _varint(data, pos)
        elif wire == 1 or wire == 5:
            pos += 8 if wire == 1 else 4
        elif wire == 2:
            length, pos = _varint(data, pos)
            stop = pos + length
            if number == path[0]:
                if len(path) == 1:
                    found = data[pos:stop].decode()
                else:
                    found = _string_at(data, pos, stop, path[1:], steps) or found
            pos = stop
        else:
            raise _Undecided
    return found
