"""vLLM's embed_dtype and endianness (service/http/float_format.py): the bytes of each
dtype and byte order equal torch's conversion of the same values, as vLLM's own
serializer makes them (torch's dtype, viewed as its bit pattern, byte-swapped for the
other order); and the refusals of unknown values."""

from __future__ import annotations

import base64
import json
import sys

import numpy as np
import pytest
import torch

from pooling_server.engine.errors import PoolingError
from pooling_server.service.http.bodies import PoolingBody
from pooling_server.service.http.float_format import (
    EMBED_DTYPES,
    ENDIANNESS,
    FloatFormat,
    float_format,
)
from pooling_server.service.http.json_body import decode

TORCH = {
    "float32": (torch.float32, torch.float32),
    "float16": (torch.float16, torch.float16),
    "bfloat16": (torch.bfloat16, torch.int16),
    "fp8_e4m3": (torch.float8_e4m3fn, torch.uint8),
    "fp8_e5m2": (torch.float8_e5m2, torch.uint8),
}


def torch_bytes(values: np.ndarray, dtype: str, endianness: str) -> bytes:
    cast, view = TORCH[dtype]
    array = torch.from_numpy(values).to(cast).flatten().contiguous().view(view).numpy()
    if endianness not in ("native", sys.byteorder):
        array = array.byteswap()
    return array.tobytes()


def values() -> np.ndarray:
    """Normalised rows, as embeddings are, plus values at the formats' edges: ties of
    rounding, subnormals, zeros of both signs, and the largest fp8_e4m3 value."""
    rng = np.random.default_rng(0)
    rows = rng.standard_normal((4, 96)).astype(np.float32)
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    edges = np.array([1.0 + 2**-8, 1.0 + 3 * 2**-8, 2**-10, -0.0, 0.0, 448.0, -(2**-16), 1e-3])
    return np.concatenate([rows.ravel(), edges.astype(np.float32)]).reshape(-1, 8)


@pytest.mark.parametrize("dtype", EMBED_DTYPES)
@pytest.mark.parametrize("endianness", ENDIANNESS)
def test_bytes_equal_torch(dtype: str, endianness: str) -> None:
    data = values()
    fmt = FloatFormat("base64", dtype, endianness)
    assert fmt.raw(data) == torch_bytes(data, dtype, endianness)
    assert base64.b64decode(fmt.json(data)) == fmt.raw(data)
    assert FloatFormat("float", dtype, endianness).json(data) == data.tolist()


def test_the_answer_budget_counts_each_value_as_sent() -> None:
    assert FloatFormat("base64", "float32").float_bytes == 6
    assert FloatFormat("base64", "float16").float_bytes == 3
    assert FloatFormat("base64", "fp8_e5m2").float_bytes == 2


@pytest.mark.parametrize(
    ("field", "value"),
    [("encoding_format", "bytes_maybe"), ("embed_dtype", "int8"), ("endianness", "middle")],
)
def test_unknown_values_are_refused_by_name(field: str, value: str) -> None:
    raw = json.dumps({field: value, "input": "x"}).encode()
    with pytest.raises(PoolingError) as caught:
        float_format(decode(raw, PoolingBody, 64))
    [violation] = caught.value.violations
    assert violation.field == field and violation.reason == "ENCODING_UNKNOWN"
