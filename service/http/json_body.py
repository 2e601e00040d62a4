"""Decoding an HTTP route's JSON body with bounded work, whatever the client sends.

A body is checked before anything in it is built: its nesting (MAX_DEPTH), then each
list of texts by its number of entries, counted on the raw bytes. Only the fields a route
knows are kept, as raw JSON; unknown ones are skipped unread, and a field is decoded to
the one type it must have when the route reads it, so a wrong type stops the decoder at
its first wrong value. Integers are range-checked before they reach protobuf (int32).

So a 16 MB body of four million two-character texts, or of four million empty lists,
is refused without building four million objects, and a body nested 1,000 deep is
MALFORMED_REQUEST rather than a RecursionError.
"""

from __future__ import annotations

import re
from typing import Any

import msgspec
import numpy as np

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError
from pooling_server.engine.requests.request import Item
from pooling_server.engine.requests.validation import too_many_inputs
from pooling_server.service.http.image_parts import (
    Message,
    Part,
    has_image,
    input_items,
    messages_item,
)

MAX_DEPTH = 32  # our bodies nest 3 deep; JSON parsers differ on where nesting must stop
# Lists this small are decoded and then counted by the request rules: at most a few
# thousand short strings, which costs less than the count.
COUNT_SCAN_BYTES = 64 * 1024
_SCAN_CHUNK = 1 << 20  # bytes per step of the structure scan, bounding its temporary arrays
INT32 = (-(2**31), 2**31 - 1)
_NUMBER_OR_LIST = re.compile(rb"\[\s*[-0-9\[]")
_AT = re.compile(r" - at `\$(.*)`$")


class BodyError(PoolingError):
    """A body that is JSON but not of the route's shape (INVALID_BODY: OpenAI's 422), with
    the field at fault: a PoolingError, rendered, counted and logged as any other."""

    def __init__(self, field: str, description: str) -> None:
        violation = FieldViolation(field, description, "INVALID_BODY")
        error = PoolingError.invalid([violation])
        super().__init__(error.kind, error.reason, error.message, error.violations)

    @property
    def violation(self) -> FieldViolation:
        return self.violations[0]


class _Fields(msgspec.Struct):
    """Every field a route reads, as raw JSON (empty when absent)."""

    input: msgspec.Raw = msgspec.Raw()
    model: msgspec.Raw = msgspec.Raw()
    encoding_format: msgspec.Raw = msgspec.Raw()
    embed_dtype: msgspec.Raw = msgspec.Raw()
    endianness: msgspec.Raw = msgspec.Raw()
    dimensions: msgspec.Raw = msgspec.Raw()
    text_1: msgspec.Raw = msgspec.Raw()
    text_2: msgspec.Raw = msgspec.Raw()
    task: msgspec.Raw = msgspec.Raw()
    use_activation: msgspec.Raw = msgspec.Raw()
    softmax: msgspec.Raw = msgspec.Raw()
    normalize: msgspec.Raw = msgspec.Raw()
    activation: msgspec.Raw = msgspec.Raw()
    truncate_prompt_tokens: msgspec.Raw = msgspec.Raw()
    documents: msgspec.Raw = msgspec.Raw()
    query: msgspec.Raw = msgspec.Raw()
    top_n: msgspec.Raw = msgspec.Raw()
    return_documents: msgspec.Raw = msgspec.Raw()
    add_special_tokens: msgspec.Raw = msgspec.Raw()
    prompt_name: msgspec.Raw = msgspec.Raw()  # /pooling embed_multi: "query" or "document"
    late_chunking: msgspec.Raw = msgspec.Raw()  # /v1/embeddings and /pooling (embed)
    messages: msgspec.Raw = msgspec.Raw()  # /v1/embeddings: vLLM's chat form (one input)
    instruction: msgspec.Raw = msgspec.Raw()  # rerank and score: an LLM reranker's
    # /pooling embed_outputs (bge-m3): the outputs asked for and the sparse one's shape;
    # score and rerank: the weights of its outputs' scores.
    outputs: msgspec.Raw = msgspec.Raw()
    sparse_top_k: msgspec.Raw = msgspec.Raw()
    return_tokens: msgspec.Raw = msgspec.Raw()
    output_weights: msgspec.Raw = msgspec.Raw()


class _Document(msgspec.Struct):
    """A rerank document given as an object: its text; other keys are skipped unread."""

    text: str


LIST_FIELDS = ("input", "text_1", "text_2", "documents")
_fields = msgspec.json.Decoder(_Fields)
_str = msgspec.json.Decoder(str)
_int = msgspec.json.Decoder(int)
_bool = msgspec.json.Decoder(bool)
_texts = msgspec.json.Decoder(str | list[str])
_documents = msgspec.json.Decoder(list[str | _Document])
# Inputs that may hold images: texts and content parts (service/http/image_parts.py).
_items = msgspec.json.Decoder(str | dict[str, Any] | list[str | dict[str, Any] | list[Part]])
_messages = msgspec.json.Decoder(list[Message])
_NOT_TEXTS = ("INVALID_BODY", "TOKEN_INPUT_NOT_SUPPORTED")  # a list's faults parts may explain


def _is_null(raw: msgspec.Raw) -> bool:
    return len(raw) == 4 and bytes(raw) == b"null"


def malformed(problem: str) -> PoolingError:
    return PoolingError(ErrorKind.INVALID_ARGUMENT, "MALFORMED_REQUEST", problem)


def _counts(data: np.ndarray, values: bytes) -> list[int]:
    """How often each of `values` occurs in `data` (uint8), a chunk at a time so that the
    temporaries stay small."""
    totals = [0] * len(values)
    for start in range(0, len(data), _SCAN_CHUNK):
        chunk = data[start : start + _SCAN_CHUNK]
        for i, value in enumerate(values):
            totals[i] += int(np.count_nonzero(chunk == value))
    return totals


Buffer = bytes | bytearray | msgspec.Raw  # what a body or a field of it is read from


def structure(raw: Buffer) -> tuple[int, int]:
    """(the deepest nesting, the values directly inside the outermost array or object) of
    valid JSON text, read from its bytes without decoding them."""
    data = np.frombuffer(raw, dtype=np.uint8)
    return _scan(_unescaped(raw) if _counts(data, b"\\")[0] else data)


def _unescaped(raw: Buffer) -> np.ndarray:
    """The text with its escapes dropped (an escaped backslash, then an escaped quote), so
    that every quote left opens or closes a string: the one case that copies the text."""
    return np.frombuffer(bytes(raw).replace(b"\\\\", b"").replace(b'\\"', b""), np.uint8)


def _scan(data: np.ndarray) -> tuple[int, int]:
    """`structure` of text without escapes: brackets and commas outside strings."""
    in_string, depth, deepest, commas = 0, 0, 0, 0
    for start in range(0, len(data), _SCAN_CHUNK):
        chunk = data[start : start + _SCAN_CHUNK]
        # The running count of quotes, mod 2 (uint8 wraps at 256, which keeps the parity).
        inside = (np.cumsum(chunk == 34, dtype=np.uint8) + in_string) & 1
        outside = inside == 0
        opens = ((chunk == 91) | (chunk == 123)) & outside
        closes = ((chunk == 93) | (chunk == 125)) & outside
        level = np.cumsum(opens.astype(np.int32) - closes, dtype=np.int32) + depth
        deepest = max(deepest, int(level.max()))
        commas += int(np.count_nonzero((chunk == 44) & outside & (level == 1)))
        in_string, depth = int(inside[-1]), int(level[-1])
    return deepest, (commas + 1 if len(data) > 2 else 0)


def count_entries(raw: Buffer) -> int:
    """The entries of a JSON array, counted on its bytes in place: a 16 MB list is
    counted without a second 16 MB held beside it."""
    data = np.frombuffer(raw, dtype=np.uint8)
    quotes, escapes, braces, brackets = _counts(data, b'"\\{[')
    if not escapes and not braces and brackets == 1:
        # A flat list without escapes: each string entry shows its two quotes (an entry
        # of another type stops the typed decoder at once), which is quicker to count.
        return quotes // 2
    return _scan(_unescaped(raw) if escapes else data)[1]


def check_depth(raw: bytes | bytearray) -> None:
    """MALFORMED_REQUEST for JSON nested deeper than MAX_DEPTH; cheap for the usual body."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return  # the common case: too few brackets to nest that deep
    deepest, _ = structure(raw)
    if deepest > MAX_DEPTH:
        raise malformed(f"the body nests {deepest} levels deep, more than {MAX_DEPTH}")


class Body:
    """A decoded body: its fields, each read once to the type it must have.

    List fields are counted and decoded here (`parse_body` may run on a worker thread);
    a list's fault is kept as a violation, not an exception, and raised when a route
    reads that field, so a field the route ignores never fails it.
    """

    def __init__(self, fields: _Fields, max_inputs: int) -> None:
        self._fields = fields
        self._lists: dict[str, list[str] | tuple[str, FieldViolation]] = {}
        self._items: dict[str, list[Item]] = {}  # lists that hold an image
        for name in LIST_FIELDS:
            raw = getattr(fields, name)
            if len(raw) and not _is_null(raw):
                value = decode_list(name, raw, max_inputs)
                if isinstance(value, tuple) and value[1].reason in _NOT_TEXTS:
                    value = _decode_items(name, raw) or value  # base64-decoded here, off-loop
                if isinstance(value, list) and has_image(value):
                    self._items[name] = value
                    value = []
                self._lists[name] = value  # type: ignore[assignment]

    def _raw(self, name: str) -> msgspec.Raw | None:
        raw: msgspec.Raw = getattr(self._fields, name)
        return raw if len(raw) and not _is_null(raw) else None

    def has(self, name: str) -> bool:
        """Given, and not null (null reads as absent, as the routes always took it)."""
        return name in self._lists or self._raw(name) is not None

    def _typed(self, name: str, decoder: msgspec.json.Decoder, wants: str) -> Any:
        raw = self._raw(name)
        if raw is None:
            return None
        try:
            return decoder.decode(raw)
        except msgspec.DecodeError as exc:
            raise BodyError(name, _not_utf8(exc) or f"must be {wants}") from None

    def typed(self, name: str, decoder: msgspec.json.Decoder, wants: str) -> Any:
        """A field read by a route's own decoder (an object); None when absent."""
        return self._typed(name, decoder, wants)

    def string(self, name: str, default: str) -> str:
        value = self._typed(name, _str, "a string")
        return default if value is None else value

    def boolean(self, name: str) -> bool | None:
        return self._typed(name, _bool, "true or false")

    def integer(self, name: str, low: int = INT32[0], high: int = INT32[1]) -> int | None:
        """The integer, or None when absent; outside [low, high] (which lies within int32,
        the wire type) it is INVALID_ARGUMENT, naming the range."""
        value = self._typed(name, _int, "an integer")
        if value is not None and not low <= value <= high:
            raise PoolingError.invalid(
                [
                    FieldViolation(
                        name,
                        f"must be an integer from {low} to {high}, got {value}",
                        "VALUE_OUT_OF_RANGE",
                    )
                ]
            )
        return value

    def items(self, name: str) -> list[Item]:
        """A list of texts and images (content parts), or a string, as a list."""
        if name in self._items:
            return self._items[name]
        return list(self.texts(name))

    def message_item(self) -> Item | None:
        """vLLM's `messages` (one input: a text or an image); None when absent."""
        messages = self._typed("messages", _messages, "a list of chat messages")
        return None if messages is None else messages_item(messages)

    def texts(self, name: str) -> list[str]:
        """A string or a list of strings, as a list."""
        if name in self._items:
            raise BodyError(name, "images are not taken here: send texts")
        value = self._lists.get(name)
        if value is None:
            raise BodyError(name, "must be a string or a list of strings")
        if isinstance(value, tuple):
            _, violation = value
            if violation.reason == "INVALID_BODY":
                raise BodyError(violation.field, violation.description)
            raise PoolingError.invalid([violation])
        return value

    def documents(self) -> list[str]:
        """Rerank's documents: strings, or objects whose text is read."""
        if "documents" not in self._lists:
            raise BodyError("documents", "must be a list of strings (or of {text} objects)")
        return self.texts("documents")


def _out_of_range(path: str, value: int) -> PoolingError:
    low, high = INT32
    return PoolingError.invalid(
        [
            FieldViolation(
                path, f"must be an integer from {low} to {high}, got {value}", "VALUE_OUT_OF_RANGE"
            )
        ]
    )


def check_int32(body: msgspec.Struct, path: str = "") -> None:
    """Every integer field of a decoded body (nested objects' too, and integer pairs such
    as spans) within int32, the wire type every integer field has: one beyond it is
    VALUE_OUT_OF_RANGE naming its path and the range, as Body.integer says it."""
    for name in body.__struct_fields__:
        value = getattr(body, name)
        where = f"{path}.{name}" if path else name
        if isinstance(value, bool):
            continue
        if isinstance(value, int):
            if not INT32[0] <= value <= INT32[1]:
                raise _out_of_range(where, value)
        elif isinstance(value, msgspec.Struct):
            check_int32(value, where)
        elif isinstance(value, list):
            for i, entry in enumerate(value):
                numbers = entry if isinstance(entry, tuple) else (entry,)
                for number in numbers:
                    wide = isinstance(number, int) and not INT32[0] <= number <= INT32[1]
                    if wide and not isinstance(number, bool):
                        raise _out_of_range(f"{where}[{i}]", number)


def decode_list(
    name: str, raw: msgspec.Raw, max_inputs: int
) -> list[str] | tuple[str, FieldViolation]:
    """The field's texts, or why not: counted on the bytes first when the list is large."""
    if len(raw) > COUNT_SCAN_BYTES and memoryview(raw)[0] == ord("["):
        count = count_entries(raw)
        if count > max_inputs:
            return name, too_many_inputs(name, count, max_inputs)
    if name == "documents":
        return _decode_documents(raw)
    try:
        value = _texts.decode(raw)
    except msgspec.DecodeError as exc:
        if problem := _not_utf8(exc):
            return name, FieldViolation(name, problem, "INVALID_BODY")
        if _NUMBER_OR_LIST.match(bytes(memoryview(raw)[:64])):
            return name, FieldViolation(
                name,
                "token-id input is not supported: token ids of another tokenizer would be "
                "meaningless to this model; send the texts",
                "TOKEN_INPUT_NOT_SUPPORTED",
            )
        return name, FieldViolation(name, "must be a string or a list of strings", "INVALID_BODY")
    return [value] if isinstance(value, str) else value


def _decode_items(name: str, raw: msgspec.Raw) -> list[Item] | None:
    """A list of texts and content parts as items; None if it is not one (the caller's
    own violation then stands). A part's own fault is raised with its path."""
    try:
        entries = _items.decode(raw)
    except msgspec.DecodeError:
        return None
    return input_items(entries, name)


def _not_utf8(exc: msgspec.DecodeError) -> str | None:
    """A string whose bytes are not UTF-8 is said to be so, not to be of the wrong type."""
    return "holds bytes that are not valid UTF-8" if "UTF-8" in str(exc) else None


def _decode_documents(raw: msgspec.Raw) -> list[str] | tuple[str, FieldViolation]:
    try:
        documents = _documents.decode(raw)
    except msgspec.DecodeError as error:
        at = _AT.search(str(error))
        path = "documents" + (at.group(1).removesuffix(".text") if at else "")
        problem = "must be a string or an object with text"
        if path == "documents":
            problem = "must be a list of strings (or of {text} objects)"
        return "documents", FieldViolation(path, problem, "INVALID_BODY")
    return [d if isinstance(d, str) else d.text for d in documents]


def parse_body(raw: bytes | bytearray, max_inputs: int) -> Body:
    """The body's fields, its lists counted and decoded; MALFORMED_REQUEST for what is
    not JSON or nests too deep, 422 for JSON that is not an object."""
    check_depth(raw)
    try:
        fields = _fields.decode(raw)
    except msgspec.ValidationError:
        raise BodyError("body", "must be a JSON object") from None
    except (msgspec.DecodeError, RecursionError) as exc:
        raise malformed(f"the body is not valid JSON: {exc}") from None
    return Body(fields, max_inputs)


# The names other doors first imported (service/http/door.py).
_check_depth = check_depth
_decode_list = decode_list
