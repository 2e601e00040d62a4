"""How an OpenAI/vLLM answer carries its float arrays.

`encoding_format`: float (JSON numbers), base64 (each array's bytes in the JSON), or
vLLM's bytes and bytes_only (the arrays' bytes one after another as the whole body,
application/octet-stream; with bytes, a `metadata` header holds the JSON of id, model,
usage and each array's index, start, end and shape).

That header is one line, and a line of 100 KB (vLLM's form for 1,024 vectors) is refused by
Python's http.client (64 KB a line), aiohttp (8 KB) and proxies (nginx's 4-8 KB buffer
for all of an answer's headers). So vLLM's form is sent while it fits METADATA_MAX_BYTES;
past that, a compact form: the arrays lie back to back in index order, all of `shape`, or
of `[rows[i], *shape]` where their first dimension differs, with no `data` list. A compact
form that would still not fit (thousands of matrices of different lengths) is refused
(METADATA_TOO_LARGE) before the body is built: bytes_only and base64 answer it.

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
import msgspec
import numpy as np

from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.engine.requests.encodings import to_bfloat16
from pooling_server.service.http.bodies import FloatFields
from pooling_server.service.http.door import (
    BASE64_FLOAT_BYTES,
    JSON_FLOAT_BYTES,
    base64_floats,
    base64_of,
)

ENCODING_FORMATS = ("float", "base64", "bytes", "bytes_only")
EMBED_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8_e4m3": 1, "fp8_e5m2": 1}
ENDIANNESS = ("native", "big", "little")
_FP8 = {"fp8_e4m3": ml_dtypes.float8_e4m3fn, "fp8_e5m2": ml_dtypes.float8_e5m2}
# The `metadata` header's value at most: with the answer's other headers (~200 bytes) it
# stays within an 8 KB header buffer, and far within http.client's 64 KB line.
METADATA_MAX_BYTES = 6144


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
    usage, as its JSON form has them): vLLM's metadata, or the compact form past
    METADATA_MAX_BYTES (see the module's docstring)."""
    metadata = None if fmt.encoding == "bytes_only" else header_metadata(fmt, arrays, head)
    return BinaryAnswer([fmt.raw(values) for values in arrays], metadata)


def header_metadata(
    fmt: FloatFormat, arrays: list[np.ndarray], head: dict[str, Any]
) -> dict[str, Any]:
    """The `metadata` header's JSON, within METADATA_MAX_BYTES; refused if it cannot be."""
    width = EMBED_DTYPES[fmt.dtype]
    items, at = [], 0
    for index, values in enumerate(arrays):
        end = at + values.size * width
        items.append(
            {
                "index": index,
                "embed_dtype": fmt.dtype,
                "endianness": fmt.endianness,
                "start": at,
                "end": end,
                "shape": list(values.shape),
            }
        )
        at = end
    full = {**head, "data": items}
    if len(msgspec.json.encode(full)) <= METADATA_MAX_BYTES:
        return full
    compact = {**head, "embed_dtype": fmt.dtype, "endianness": fmt.endianness}
    compact["count"] = len(arrays)
    shapes = {values.shape for values in arrays}
    if len(shapes) == 1:
        compact["shape"] = list(shapes.pop())
    elif len({shape[1:] for shape in shapes}) == 1 and all(shape for shape in shapes):
        compact["shape"] = list(arrays[0].shape[1:])
        compact["rows"] = [values.shape[0] for values in arrays]
    size = len(msgspec.json.encode(compact))
    if "shape" not in compact or size > METADATA_MAX_BYTES:
        raise metadata_too_large(size)
    return compact


def metadata_too_large(size: int) -> PoolingError:
    return PoolingError(
        ErrorKind.INVALID_ARGUMENT,
        "METADATA_TOO_LARGE",
        f"the bytes answer's metadata header would take {size} bytes, more than "
        f"{METADATA_MAX_BYTES} (what proxies and HTTP clients read in one header); ask "
        "encoding_format bytes_only or base64, or send fewer inputs a request",
        metadata={"metadata_bytes": str(size), "limit_bytes": str(METADATA_MAX_BYTES)},
    )


def float_format(body: FloatFields) -> FloatFormat:
    """encoding_format, embed_dtype and endianness, as vLLM's embeddings and pooling
    routes take them (the last two shape the bytes of base64); the body's type holds
    each to its values."""
    return FloatFormat(
        body.encoding_format or "float", body.embed_dtype or "float32", body.endianness or "native"
    )
