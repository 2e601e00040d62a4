"""Decoding an HTTP route's JSON body into its declared type with bounded work, whatever
the client sends, and its refusals named by field path from the errors table.

A body is checked before anything in it is built: its nesting (MAX_DEPTH), then, for a
large body, each list of inputs the type names (`counted`) by its number of entries,
counted on the raw bytes. Then msgspec decodes it whole, in C, into the route's Struct
(service/http/bodies.py, tei.py, cohere.py): unknown fields are skipped unread, a wrong
type stops the decoder at its first wrong value, and every integer is bounded by the
wire's int32. msgspec's refusal ("Expected `int` <= 2147483647 - at `$.top_n`") becomes
the door's: the field's path, and the reason a client reads (INVALID_BODY,
VALUE_OUT_OF_RANGE, TOKEN_INPUT_NOT_SUPPORTED, the enum's own *_UNKNOWN).

So a 16 MB body of four million two-character texts, or of four million empty lists,
is refused without building four million objects, and a body nested 1,000 deep is
MALFORMED_REQUEST rather than a RecursionError.
"""

from __future__ import annotations

import functools
import re
import typing
from typing import Any, TypeVar

import msgspec
import numpy as np

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError, clip
from pooling_server.engine.requests.shape_rules import too_many_inputs
from pooling_server.engine.requests.validation import UNKNOWN_VALUES, unknown_value
from pooling_server.service.http.bodies import (
    INT32_MAX,
    INT32_MIN,
    NOT_TEXTS,
    TOKEN_IDS,
    Inputs,
    Texts,
    inputs_hook,
)

MAX_DEPTH = 32  # our bodies nest 3 deep; JSON parsers differ on where nesting must stop
# Lists this small are decoded and then counted by the request rules: at most a few
# thousand short strings, which costs less than the count.
COUNT_SCAN_BYTES = 64 * 1024
_SCAN_CHUNK = 1 << 20  # bytes per step of the structure scan, bounding its temporary arrays
_TOKEN_IDS = re.compile(rb"\[\s*[-0-9]")  # a list that opens with a number
_TEXT_ENTRY = re.compile(r"Expected `str`, got `(int|float|array)`")
S = TypeVar("S", bound=msgspec.Struct)


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


def decode(raw: Buffer, kind: type[S], max_inputs: int) -> S:
    """The body as `kind`, within its bounds; MALFORMED_REQUEST for what is not JSON or
    nests too deep, INVALID_BODY (OpenAI's 422) naming the field for JSON of the wrong
    shape, TOO_MANY_INPUTS for a list over `max_inputs` counted before it is built."""
    check_depth(raw)
    if len(raw) > COUNT_SCAN_BYTES and _counted(kind):
        _count_lists(raw, kind, max_inputs)
    try:
        return _decoder(kind).decode(raw)
    except msgspec.ValidationError as exc:
        raise refusal(str(exc), kind) from None
    except msgspec.DecodeError as exc:
        if "UTF-8" in str(exc):
            raise BodyError(_not_utf8(raw, kind), "holds bytes that are not valid UTF-8") from None
        raise malformed(f"the body is not valid JSON: {exc}") from None
    except RecursionError:
        raise malformed("the body is not valid JSON: nested too deep") from None


@functools.cache
def _decoder(kind: type) -> msgspec.json.Decoder[Any]:
    return msgspec.json.Decoder(kind, dec_hook=inputs_hook)


def _counted(kind: type) -> tuple[str, ...]:
    return getattr(kind, "counted", ())


@functools.cache
def _view(kind: type, names: tuple[str, ...]) -> msgspec.json.Decoder[Any]:
    """A decoder of `names` of the body as raw JSON, every other field skipped unread."""
    fields = [(name, msgspec.Raw, msgspec.Raw()) for name in names]
    return msgspec.json.Decoder(msgspec.defstruct(f"{kind.__name__}View", fields))


def _raw_fields(raw: Buffer, kind: type, names: tuple[str, ...]) -> dict[str, msgspec.Raw]:
    try:
        view = _view(kind, names).decode(raw)
    except msgspec.ValidationError:
        raise BodyError("body", "must be a JSON object") from None
    except msgspec.DecodeError as exc:
        raise malformed(f"the body is not valid JSON: {exc}") from None
    return {name: getattr(view, name) for name in names if len(getattr(view, name))}


def _count_lists(raw: Buffer, kind: type, max_inputs: int) -> None:
    """TOO_MANY_INPUTS for a large list of inputs over `max_inputs`, counted on its bytes;
    a large list of numbers is token ids, refused before one is built."""
    for name, field in _raw_fields(raw, kind, _counted(kind)).items():
        if len(field) <= COUNT_SCAN_BYTES or memoryview(field)[0] != ord("["):
            continue
        count = count_entries(field)
        if count > max_inputs:
            raise PoolingError.invalid([too_many_inputs(name, count, max_inputs)])
        if name in _texts_fields(kind) and _TOKEN_IDS.match(bytes(memoryview(field)[:64])):
            raise PoolingError.invalid(
                [FieldViolation(name, TOKEN_IDS, "TOKEN_INPUT_NOT_SUPPORTED")]
            )


def _not_utf8(raw: Buffer, kind: type) -> str:
    """The field holding bytes that are not UTF-8 (msgspec says no more than that)."""
    names = tuple(kind.__struct_fields__)
    for name, field in _raw_fields(raw, kind, names).items():
        try:
            msgspec.json.decode(field)
        except msgspec.DecodeError:
            return name
    return "body"


@functools.cache
def _texts_fields(kind: type) -> frozenset[str]:
    """The fields of `kind` that hold texts (a string or a list of strings, or `Inputs`),
    where a list of numbers is token ids."""
    texts = (Texts, Texts | None)
    return frozenset(
        f.name
        for f in msgspec.structs.fields(kind)
        if f.type in texts
        or any(isinstance(t, type) and issubclass(t, Inputs) for t in _args(f.type))
    )


def _args(kind: Any) -> tuple[Any, ...]:
    return typing.get_args(kind) or (kind,)


def refusal(problem: str, kind: type) -> PoolingError:
    """msgspec's refusal of a body of `kind` as the door's: the field's path ("input[3]",
    "late_chunking.spans[1][0]"), and its reason from the errors table."""
    message, _, at = problem.partition(" - at `$")
    path = at.rstrip("`").lstrip(".")
    if not path:
        if message.startswith("Object missing required field"):
            name = message.split("`")[1]
            return BodyError(name, NOT_TEXTS if name in _texts_fields(kind) else "is required")
        return BodyError("body", "must be a JSON object")
    field = re.split(r"[.\[]", path, maxsplit=1)[0]
    if field in _texts_fields(kind):
        if path != field and _TEXT_ENTRY.match(message):
            violation = FieldViolation(field, TOKEN_IDS, "TOKEN_INPUT_NOT_SUPPORTED")
            return PoolingError.invalid([violation])
        return BodyError(field, NOT_TEXTS)
    if message.startswith(("Expected `int` >=", "Expected `int` <=")):
        description = f"must be an integer from {INT32_MIN} to {INT32_MAX}"
        return PoolingError.invalid([FieldViolation(path, description, "VALUE_OUT_OF_RANGE")])
    named = re.sub(r"\[\d+\]", "", path)
    if message.startswith("Invalid enum value") and named in UNKNOWN_VALUES:
        return unknown_value(named, clip(message[19:].strip("'"), 64))
    if message.startswith("Object missing required field"):
        return BodyError(f"{path}.{message.split('`')[1]}", "is required")
    if message.startswith("Object contains unknown field"):
        return BodyError(path, f"has no field {message.split('`')[1]!r}")
    return BodyError(path, _in_words(message))


_WORDS = {
    "int": "an integer",
    "str": "a string",
    "bool": "true or false",
    "float": "a number",
    "array": "a list",
    "object": "an object",
}


def _in_words(message: str) -> str:
    """msgspec's "Expected `int | null`, got `str`" as "must be an integer"."""
    wanted = re.match(r"Expected `([^`]*)`, got `[^`]*`$", message)
    if wanted is None:
        return message.replace("Expected", "must be", 1).replace("`", "")
    names = [_WORDS.get(name, name) for name in wanted.group(1).split(" | ") if name != "null"]
    return "must be " + " or ".join(names)
