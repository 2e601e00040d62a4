"""Compact encodings of embed and token_embed outputs, applied after the other heads.

Each function turns finished float32 values (a vector, or one row per token) into the bytes
of `Embedding.data` / `TokenMatrix.data` (see EmbeddingEncoding in the schema):

- float32, float16: little-endian IEEE values.
- bfloat16: the top 16 bits of each float32, rounded to nearest even.
- binary / ubinary: sentence-transformers' quantize_embeddings(precision="binary" /
  "ubinary"): one bit per value (1 where > 0), packed most significant bit first per row;
  binary is that byte minus 128 as int8.
- int8 / uint8: quantize_embeddings(precision=..., ranges=...) with the per-dimension
  calibration ranges that ship with the model folder (see CALIBRATION_FILES).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from pooling_server.engine.requests.params import OutputEncoding

# Where a model folder keeps its int8/uint8 calibration ranges: JSON {"min": [...],
# "max": [...]} with one number per dimension, or an .npy array of shape (2, dimensions)
# (minimums, then maximums), as quantize_embeddings' `ranges` takes them.
CALIBRATION_JSON = "calibration_ranges.json"
CALIBRATION_NPY = "calibration_ranges.npy"
CALIBRATION_FILES = (CALIBRATION_JSON, CALIBRATION_NPY)

NEEDS_RANGES = frozenset({OutputEncoding.INT8, OutputEncoding.UINT8})
BITS = frozenset({OutputEncoding.BINARY, OutputEncoding.UBINARY})


def to_bfloat16(values: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float32 values, rounded to nearest even; NaN stays
    NaN (quiet)."""
    bits = np.ascontiguousarray(values, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(values)
    if nan.any():
        rounded = np.where(nan, (bits >> np.uint32(16)) | np.uint32(0x40), rounded)
    return rounded.astype(np.uint16)


def quantize(values: np.ndarray, encoding: OutputEncoding, ranges: np.ndarray | None) -> np.ndarray:
    """The encoded array whose little-endian bytes are the wire layout (same leading shape;
    binary encodings pack the last axis into ceil(n / 8) bytes)."""
    values = np.asarray(values, dtype=np.float32)
    if encoding is OutputEncoding.FLOAT32 or encoding is OutputEncoding.FLOAT:
        return values.astype("<f4", copy=False)
    if encoding is OutputEncoding.FLOAT16:
        return values.astype("<f2")
    if encoding is OutputEncoding.BFLOAT16:
        return to_bfloat16(values).astype("<u2", copy=False)
    if encoding in BITS:
        packed = np.packbits(values > 0, axis=-1)
        return packed if encoding is OutputEncoding.UBINARY else (packed ^ 0x80).view(np.int8)
    if encoding in NEEDS_RANGES:
        if ranges is None:
            raise ValueError(f"{encoding} needs calibration ranges")
        starts = ranges[0, : values.shape[-1]]
        steps = (ranges[1, : values.shape[-1]] - starts) / np.float32(255)
        steps = np.where(steps == 0, np.float32(1), steps)
        levels = np.clip(np.floor((values - starts) / steps), 0, 255)
        if encoding is OutputEncoding.UINT8:
            return levels.astype(np.uint8)
        return (levels - 128).astype(np.int8)
    raise ValueError(f"unknown encoding {encoding!r}")


def encode(values: np.ndarray, encoding: OutputEncoding, ranges: np.ndarray | None) -> bytes:
    """The wire bytes of `values` in `encoding`."""
    return np.ascontiguousarray(quantize(values, encoding, ranges)).tobytes()


def encoded_size(dimensions: int, encoding: OutputEncoding) -> int:
    """Bytes per vector (or per token row) of `dimensions` values."""
    if encoding in BITS:
        return (dimensions + 7) // 8
    if encoding in (OutputEncoding.FLOAT16, OutputEncoding.BFLOAT16):
        return 2 * dimensions
    if encoding in NEEDS_RANGES:
        return dimensions
    return 4 * dimensions


def ranges_array(ranges: Sequence[Sequence[float]] | None) -> np.ndarray | None:
    """ModelInfo.calibration_ranges as the float32 (2, dimensions) array quantize takes."""
    return None if ranges is None else np.asarray(ranges, dtype=np.float32)


def read_calibration_ranges(folder: Path, hidden_size: int) -> list[list[float]] | None:
    """The calibration ranges shipped in `folder`, checked, or None when there are none.

    Raises ValueError (naming the file) for a malformed file, both files at once, or
    ranges whose length is not the model's hidden size.
    """
    present = [folder / name for name in CALIBRATION_FILES if (folder / name).is_file()]
    if not present:
        return None
    if len(present) > 1:
        raise ValueError(f"{folder}: ship one of {' or '.join(CALIBRATION_FILES)}, not both")
    path = present[0]
    try:
        if path.suffix == ".npy":
            array = np.load(path, allow_pickle=False)
        else:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or not {"min", "max"} <= data.keys():
                raise ValueError('expected {"min": [...], "max": [...]}')
            array = np.array([data["min"], data["max"]], dtype=np.float64)
        array = np.asarray(array, dtype=np.float64)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"{path}: unreadable calibration ranges: {exc}") from exc
    if array.ndim != 2 or array.shape[0] != 2:
        raise ValueError(
            f"{path}: calibration ranges must be 2 rows (min, max) of one value per "
            f"dimension, got shape {array.shape}"
        )
    if array.shape[1] != hidden_size:
        raise ValueError(
            f"{path}: calibration ranges cover {array.shape[1]} dimensions, but the model's "
            f"embeddings have {hidden_size}"
        )
    if not np.isfinite(array).all() or (array[0] > array[1]).any():
        raise ValueError(f"{path}: calibration ranges must be finite with min <= max")
    return array.astype(np.float32).tolist()
