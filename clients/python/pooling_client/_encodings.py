"""Decoding the packed embedding encodings (``Embedding.data`` / ``TokenMatrix.data``).

Works without numpy (``struct``), and uses numpy when it is installed. The layouts are the
schema's (see ``EmbeddingEncoding`` in pooling.proto):

- ``float32`` / ``float16``: little-endian IEEE values, 4 / 2 bytes each.
- ``bfloat16``: the top 16 bits of a float32, 2 bytes each; decoded by shifting them back.
- ``binary`` / ``ubinary``: sentence-transformers' ``quantize_embeddings`` precisions: one
  bit per value (1 where the value is > 0), packed most significant bit first, as int8
  (``binary``: the byte minus 128) or uint8 (``ubinary``); ceil(dimensions / 8) per vector.
- ``int8`` / ``uint8``: one calibrated level per value (``quantize_embeddings`` with the
  model's ranges).
"""

from __future__ import annotations

import struct
from typing import Any

from pooling_client.v1 import pooling_pb2

#: Encoding names accepted by ``embed(encoding=...)`` / ``encode(encoding=...)``.
ENCODINGS: dict[str, int] = {
    "float32": pooling_pb2.EMBEDDING_ENCODING_FLOAT32,
    "float16": pooling_pb2.EMBEDDING_ENCODING_FLOAT16,
    "bfloat16": pooling_pb2.EMBEDDING_ENCODING_BFLOAT16,
    "binary": pooling_pb2.EMBEDDING_ENCODING_BINARY,
    "ubinary": pooling_pb2.EMBEDDING_ENCODING_UBINARY,
    "int8": pooling_pb2.EMBEDDING_ENCODING_INT8,
    "uint8": pooling_pb2.EMBEDDING_ENCODING_UINT8,
}
NAMES: dict[int, str] = {value: name for name, value in ENCODINGS.items()}

#: Tasks whose outputs take an encoding.
ENCODING_TASKS = ("embed", "token_embed", "embed_multi", "embed_outputs")

#: Bytes per value of the byte-aligned encodings.
_WIDTH = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "uint8": 1}
#: numpy dtype each encoding decodes to (bfloat16 widens exactly to float32).
NUMPY_DTYPES = {
    "float32": "<f4",
    "float16": "<f2",
    "bfloat16": "<f4",
    "binary": "i1",
    "ubinary": "u1",
    "int8": "i1",
    "uint8": "u1",
}
_STRUCT = {"float32": "f", "float16": "e", "int8": "b", "uint8": "B", "binary": "b", "ubinary": "B"}

OUTPUTS = ("list", "numpy")


def require_numpy() -> Any:
    """The numpy module, or an ImportError saying how to get it."""
    try:
        import numpy
    except ImportError as error:  # pragma: no cover - exercised only where numpy is absent
        raise ImportError(
            "numpy output needs numpy, an optional extra of pooling-client: "
            "pip install 'pooling-client[numpy]'"
        ) from error
    return numpy


def _numpy_or_none() -> Any:
    try:
        import numpy
    except ImportError:  # pragma: no cover - exercised only where numpy is absent
        return None
    return numpy


def check_encoding(encoding: str | None, task: str) -> None:
    """Raise ValueError for an unknown encoding name, or one asked of a task without one."""
    if encoding is None:
        return
    if encoding not in ENCODINGS:
        raise ValueError(f"Unknown encoding {encoding!r}; expected one of {list(ENCODINGS)}")
    if task not in ENCODING_TASKS:
        raise ValueError(
            f"encoding is only for embed and token_embed (and embed_multi), not {task}"
        )


def check_output(output: str) -> None:
    """Raise ValueError unless ``output`` is "list" or "numpy"; check numpy is there."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {list(OUTPUTS)}, got {output!r}")
    if output == "numpy":
        require_numpy()


def name_of(value: int) -> str:
    """The short name of a wire EmbeddingEncoding value (a newer one raises ValueError)."""
    name = NAMES.get(value)
    if name is None:
        raise ValueError(f"unknown embedding encoding {value}: upgrade pooling-client")
    return name


def row_bytes(encoding: str, dimensions: int) -> int:
    """Bytes one vector of ``dimensions`` values takes in ``encoding``."""
    if encoding in ("binary", "ubinary"):
        return (dimensions + 7) // 8
    return _WIDTH[encoding] * dimensions


def row_width(encoding: str, dimensions: int) -> int:
    """Decoded values per vector: ``dimensions``, or its packed bytes for the bit encodings."""
    return (dimensions + 7) // 8 if encoding in ("binary", "ubinary") else dimensions


def _check_size(data: bytes, encoding: str, rows: int, dimensions: int) -> None:
    expected = rows * row_bytes(encoding, dimensions)
    if len(data) != expected:
        raise ValueError(
            f"{encoding} data of {rows} x {dimensions} values should hold {expected} bytes, "
            f"got {len(data)}"
        )


def decode_array(data: bytes, encoding: str, rows: int, dimensions: int) -> Any:
    """A numpy array of shape (rows, row_width): the values, or the packed bits as
    sentence-transformers' ``quantize_embeddings`` returns them."""
    np = require_numpy()
    _check_size(data, encoding, rows, dimensions)
    width = row_width(encoding, dimensions)
    if encoding == "bfloat16":
        halves = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return halves.view("<f4").astype(np.float32).reshape(rows, width)
    return np.frombuffer(data, dtype=NUMPY_DTYPES[encoding]).reshape(rows, width)


def decode_list(data: bytes, encoding: str, dimensions: int) -> list[Any]:
    """One vector's values as Python floats (ints for the integer and bit encodings)."""
    np = _numpy_or_none()
    if np is not None:
        return decode_array(data, encoding, 1, dimensions)[0].tolist()
    _check_size(data, encoding, 1, dimensions)
    count = row_width(encoding, dimensions)
    if encoding == "bfloat16":
        widened = b"".join(b"\x00\x00" + data[i : i + 2] for i in range(0, len(data), 2))
        return list(struct.unpack(f"<{count}f", widened))
    return list(struct.unpack(f"<{count}{_STRUCT[encoding]}", data))


def decode_rows(data: bytes, encoding: str, rows: int, dimensions: int) -> Any:
    """A token matrix: a numpy array (rows, row_width) when numpy is installed, else a list
    of row lists."""
    if _numpy_or_none() is not None:
        return decode_array(data, encoding, rows, dimensions)
    _check_size(data, encoding, rows, dimensions)
    size = row_bytes(encoding, dimensions)
    return [decode_list(data[r * size : (r + 1) * size], encoding, dimensions) for r in range(rows)]
