"""How an OpenAI/vLLM answer carries its float arrays.

`encoding_format`: float (JSON numbers), base64 (each array's bytes in the JSON), or
vLLM's bytes and bytes_only (the arrays' bytes one after another as the whole body,
application/octet-stream; with bytes, a `metadata` header holds the JSON of id, model,
usage and each array's index, start, end and shape).

vLLM's `embed_dtype` and `endianness` say what those bytes are: float32 (the default,
OpenAI's), float16, bfloat16 (the top half of each float32, rounded to nearest even), or
fp8 (e4m3 or e5m2, one byte a value, as torch's float8_e4m3fn and float8_e5m2 round them);
in the server's byte order (native: little-endian on the hosts it runs on), big or little.
A client reads them back with numpy's frombuffer (bfloat16 and fp8 as their bit patterns).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import ml_dtypes
import numpy as np

from engine.encodings import to_bfloat16
from engine.validation import unknown_value
from service.http.door import BASE64_FLOAT_BYTES, JSON_FLOAT_BYTES, base64_floats, base64_of
from service.http.json_body import Body

ENCODING_FORMATS = ("float", "base64", "bytes", "bytes_only")
EMBED_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
ENDIANNESS = ("native", "big", "little")
_FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}


@dataclass(frozen=True)
class FloatFormat:
    encoding: str = "float"
    dtype: str = "float32"
    endianness: str = "native"

    @property
    def float_bytes(self) -> int:
        """The most bytes one value takes in the answer (for the answer's budget)."""
        if self.encoding == "float":
            return JSON_FLOAT_BYTES
        if self.binary:
            return EMBED_DTYPES[self.dtype]
        return min(BASE64_FLOAT_BYTES, -(-EMBED_DTYPES[self.dtype] * 4 // 3))

    @property
    def binary(self) -> bool:
        """The answer is the arrays' bytes, not JSON."""
        return self.encoding in ("bytes", "bytes_only")

    @property
    def _little(self) -> bool:
        order = sys.byteorder if self.endianness == "native" else self.endianness
        return order == "little"

    def raw(self, values: np.ndarray) -> bytes:
        """The values' bytes in this dtype and byte order, row after row."""
        values = np.ascontiguousarray(values, dtype=np.float32)
        order = "<" if self._little else ">"
        if self.dtype == "float32":
            return values.astype(f"{order}f4", copy=False).tobytes()
        if self.dtype == "float16":
            return values.astype(f"{order}f2").tobytes()
        if self.dtype == "bfloat16":
            return to_bfloat16(values).astype(f"{order}u2", copy=False).tobytes()
        return values.astype(_FP8[self.dtype]).view(np.uint8).tobytes()

    def json(self, values: np.ndarray) -> Any:
        """A JSON list of numbers, or (base64) the base64 of `raw`."""
        if self.encoding == "float":
            return values.tolist()
        if self.dtype == "float32" and self._little:
            return base64_floats(values)  # OpenAI's own: the common case, kept short
        return base64_of(self.raw(values))


@dataclass(frozen=True)
class BinaryAnswer:
    """A bytes answer: the body's parts, and the `metadata` header's JSON (None for
    bytes_only)."""

    parts: list[bytes]
    metadata: dict[str, Any] | None


def binary_answer(fmt: FloatFormat, arrays: list[np.ndarray], head: dict[str, Any]) -> BinaryAnswer:
    """Each array's bytes, and where each lies in the body (`head`: the answer's id, model,
    usage, as its JSON form has them)."""
    parts, items, at = [], [], 0
    for index, values in enumerate(arrays):
        data = fmt.raw(values)
        item = {"index": index, "embed_dtype": fmt.dtype, "endianness": fmt.endianness}
        items.append({**item, "start": at, "end": at + len(data), "shape": list(values.shape)})
        parts.append(data)
        at += len(data)
    metadata = None if fmt.encoding == "bytes_only" else {**head, "data": items}
    return BinaryAnswer(parts, metadata)


def float_format(body: Body) -> FloatFormat:
    """encoding_format, embed_dtype and endianness, as vLLM's embeddings and pooling
    routes take them (the last two shape the bytes of base64)."""
    encoding = body.string("encoding_format", "float")
    if encoding not in ENCODING_FORMATS:
        raise unknown_value("encoding_format", encoding)
    dtype = body.string("embed_dtype", "float32")
    if dtype not in EMBED_DTYPES:
        raise unknown_value("embed_dtype", dtype)
    endianness = body.string("endianness", "native")
    if endianness not in ENDIANNESS:
        raise unknown_value("endianness", endianness)
    return FloatFormat(encoding, dtype, endianness)
