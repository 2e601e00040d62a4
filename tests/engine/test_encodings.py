"""Output encodings without a model: the packing against sentence-transformers'
quantize_embeddings and torch's bfloat16, calibration files, the rules with their field
paths, and the wire conversion (the default stays `repeated float`)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers.util.quantization import quantize_embeddings

from pooling_client.v1 import pooling_pb2 as pb
from pooling_server.engine.errors import ErrorKind, PoolingError
from pooling_server.engine.models.model_info import Activation, HeadKind, ModelInfo
from pooling_server.engine.requests.encodings import (
    encode,
    encoded_size,
    quantize,
    read_calibration_ranges,
    to_bfloat16,
)
from pooling_server.engine.requests.outputs import Embedding, PoolResult, TokenRows
from pooling_server.engine.requests.params import OutputEncoding, PoolingParams, Task
from pooling_server.engine.requests.request import PoolRequest
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.requests.validation import validate_request
from pooling_server.service.grpc import convert
from tests.model_infos import embedder_info

E = OutputEncoding
RNG = np.random.default_rng(13)
# Odd widths so that the bit encodings pack a partial last byte.
VECTORS = RNG.standard_normal((6, 37)).astype(np.float32)
ROWS = RNG.standard_normal((5, 19)).astype(np.float32)
RANGES = np.vstack([VECTORS.min(axis=0) + 0.2, VECTORS.max(axis=0) - 0.2]).astype(np.float32)


@pytest.mark.parametrize("precision", ["binary", "ubinary"])
@pytest.mark.parametrize("values", [VECTORS, ROWS, VECTORS[0]], ids=["vectors", "rows", "one"])
def test_bits_match_quantize_embeddings(precision: str, values: np.ndarray) -> None:
    expected = quantize_embeddings(values, precision=precision)
    got = quantize(values, E(precision), None)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)
    assert encode(values, E(precision), None) == expected.tobytes()


@pytest.mark.parametrize("precision", ["int8", "uint8"])
def test_int8_matches_quantize_embeddings_with_ranges(precision: str) -> None:
    # RANGES are narrower than the values, so clipping at both ends is exercised too.
    expected = quantize_embeddings(VECTORS, precision=precision, ranges=RANGES)
    got = quantize(VECTORS, E(precision), RANGES)
    assert got.dtype == expected.dtype
    np.testing.assert_array_equal(got, expected)
    assert {got.min(), got.max()} == {expected.min(), expected.max()}
    assert expected.min() in (-128, 0) and expected.max() in (127, 255)


def test_int8_without_ranges_is_an_error() -> None:
    with pytest.raises(ValueError, match="calibration ranges"):
        quantize(VECTORS, E.INT8, None)


def test_bfloat16_rounds_to_nearest_even_as_torch() -> None:
    special = np.array(
        [1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 3.4e38, np.inf, -np.inf, 0.0, -0.0, 1e-40],
        dtype=np.float32,
    )
    for values in (VECTORS, special):
        expected = torch.from_numpy(values).to(torch.bfloat16).view(torch.int16).numpy()
        np.testing.assert_array_equal(to_bfloat16(values), expected.view(np.uint16))
    assert np.isnan(
        (to_bfloat16(np.array([np.nan], np.float32)).astype(np.uint32) << 16).view(np.float32)
    ).all()


def test_float_encodings_are_little_endian_ieee() -> None:
    assert encode(VECTORS, E.FLOAT32, None) == VECTORS.astype("<f4").tobytes()
    assert encode(VECTORS, E.FLOAT16, None) == VECTORS.astype("<f2").tobytes()
    assert encode(np.array([1.0, -2.0], np.float32), E.BFLOAT16, None) == bytes(
        [0x80, 0x3F, 0x00, 0xC0]
    )


@pytest.mark.parametrize(
    ("encoding", "size"),
    [
        (E.FLOAT32, 4 * 37),
        (E.FLOAT16, 2 * 37),
        (E.BFLOAT16, 2 * 37),
        (E.BINARY, 5),
        (E.UBINARY, 5),
        (E.INT8, 37),
        (E.UINT8, 37),
    ],
)
def test_sizes_per_vector(encoding: OutputEncoding, size: int) -> None:
    assert encoded_size(37, encoding) == size
    assert len(encode(VECTORS[0], encoding, RANGES)) == size


# Calibration files.


def test_calibration_json_and_npy(tmp_path: Path) -> None:
    ranges = [[-1.0, -0.5, 0.0], [1.0, 0.5, 0.25]]
    (tmp_path / "calibration_ranges.json").write_text(
        json.dumps({"min": ranges[0], "max": ranges[1]})
    )
    assert read_calibration_ranges(tmp_path, 3) == ranges
    npy = tmp_path / "npy"
    npy.mkdir()
    np.save(npy / "calibration_ranges.npy", np.array(ranges))
    assert read_calibration_ranges(npy, 3) == ranges
    assert read_calibration_ranges(tmp_path / "missing", 3) is None


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ('{"min": [0, 0, 0]}', "expected"),
        ("not json", "unreadable"),
        ('{"min": [0, 0], "max": [1, 1]}', "cover 2 dimensions, but the model's embeddings have 3"),
        ('{"min": [0, 2, 0], "max": [1, 1, 1]}', "min <= max"),
        ('{"min": [0, 0, 0], "max": [1, "x", 1]}', "unreadable"),
        ('{"min": [0, 0, 0], "max": [1, NaN, 1]}', "finite"),
    ],
)
def test_bad_calibration_files_name_the_file(tmp_path: Path, content: str, message: str) -> None:
    (tmp_path / "calibration_ranges.json").write_text(content)
    with pytest.raises(ValueError, match=message) as raised:
        read_calibration_ranges(tmp_path, 3)
    assert "calibration_ranges.json" in str(raised.value)


def test_both_calibration_files_is_an_error(tmp_path: Path) -> None:
    (tmp_path / "calibration_ranges.json").write_text('{"min": [0], "max": [1]}')
    np.save(tmp_path / "calibration_ranges.npy", np.array([[0.0], [1.0]]))
    with pytest.raises(ValueError, match="not both"):
        read_calibration_ranges(tmp_path, 1)


# The rules.

EMBEDDER = embedder_info(name="embedder", hidden_size=3, is_matryoshka=True)
CALIBRATED = replace(EMBEDDER, name="calibrated", calibration_ranges=[[-1.0] * 3, [1.0] * 3])
CLASSIFIER = replace(
    EMBEDDER,
    name="classifier",
    family="cross_encoder",
    head=HeadKind.SEQUENCE,
    tasks=(Task.CLASSIFY,),
    activation=Activation.SOFTMAX,
)
LIMITS = Limits()


def refusal(request: PoolRequest, info: ModelInfo) -> PoolingError:
    with pytest.raises(PoolingError) as raised:
        validate_request(request, info, LIMITS)
    return raised.value


def request(task: Task, encoding: OutputEncoding, **params: object) -> PoolRequest:
    inputs = {"text_1": ("a",), "text_2": ("b",)} if task is Task.SCORE else {"texts": ("a",)}
    return PoolRequest(task, PoolingParams(**params), encoding=encoding, **inputs)  # type: ignore[arg-type]


@pytest.mark.parametrize("encoding", list(E))
@pytest.mark.parametrize("task", [Task.EMBED, Task.TOKEN_EMBED])
def test_every_encoding_is_accepted_for_embed_and_token_embed(
    task: Task, encoding: OutputEncoding
) -> None:
    validate_request(request(task, encoding), CALIBRATED, LIMITS)


@pytest.mark.parametrize("encoding", [e for e in E if e is not E.FLOAT])
def test_encoding_on_other_tasks_is_invalid(encoding: OutputEncoding) -> None:
    for task, info in ((Task.SCORE, EMBEDDER), (Task.CLASSIFY, CLASSIFIER)):
        error = refusal(request(task, encoding), info)
        assert error.kind is ErrorKind.INVALID_ARGUMENT
        assert [(v.field, v.reason) for v in error.violations] == [
            ("encoding", "ENCODING_NOT_SUPPORTED_FOR_TASK")
        ]
        assert f"not {task}" in error.violations[0].description


@pytest.mark.parametrize("encoding", [E.INT8, E.UINT8])
def test_int8_needs_calibration_ranges(encoding: OutputEncoding) -> None:
    for task in (Task.EMBED, Task.TOKEN_EMBED):
        error = refusal(request(task, encoding), EMBEDDER)
        assert error.kind is ErrorKind.FAILED_PRECONDITION
        (violation,) = error.violations
        assert (violation.field, violation.reason) == ("encoding", "CALIBRATION_RANGES_MISSING")
        assert "calibration_ranges.json" in violation.description
        assert '"embedder"' in violation.description


def test_int8_with_other_dimensions_than_the_ranges_is_invalid() -> None:
    error = refusal(request(Task.EMBED, E.INT8, dimensions=2), CALIBRATED)
    assert error.kind is ErrorKind.INVALID_ARGUMENT
    assert [(v.field, v.reason) for v in error.violations] == [
        ("encoding", "CALIBRATION_RANGES_DIMENSIONS")
    ]
    validate_request(request(Task.EMBED, E.INT8, dimensions=3), CALIBRATED, LIMITS)
    validate_request(request(Task.EMBED, E.BINARY, dimensions=2), CALIBRATED, LIMITS)


# The wire.


def test_unknown_encoding_value_is_invalid() -> None:
    message = pb.PoolRequest(embed=pb.TextInput(texts=["a"]))
    message.encoding = 99  # type: ignore[assignment]
    with pytest.raises(PoolingError) as raised:
        convert.request_from_proto(message)
    assert [(v.field, v.reason) for v in raised.value.violations] == [
        ("encoding", "ENCODING_UNKNOWN")
    ]


def test_request_encoding_from_proto() -> None:
    for value, encoding in convert.ENCODING_FROM_PROTO.items():
        message = pb.PoolRequest(embed=pb.TextInput(texts=["a"]), encoding=value)  # type: ignore[arg-type]
        assert convert.request_from_proto(message).encoding is encoding
    assert set(convert.ENCODING_FROM_PROTO) == set(pb.EmbeddingEncoding.values())


def test_default_stays_repeated_float_byte_for_byte() -> None:
    values = VECTORS[0]
    result = PoolResult("r", "m", Task.EMBED, 3, [Embedding(values)])
    embedding = convert.response_to_proto(result).embed.embeddings[0]
    assert embedding.SerializeToString() == pb.Embedding(values=values.tolist()).SerializeToString()
    rows = TokenRows(ROWS, list(range(5)), [(0, 0)] * 5, [False] * 5)
    result = PoolResult("r", "m", Task.TOKEN_EMBED, 5, [rows])
    matrix = convert.response_to_proto(result).token_embed.items[0]
    assert not matrix.data and matrix.encoding == pb.EMBEDDING_ENCODING_UNSPECIFIED
    assert list(matrix.values) == ROWS.reshape(-1).tolist()


def test_encoded_outputs_fill_data_dimensions_and_encoding() -> None:
    data = encode(VECTORS[0], E.UBINARY, None)
    result = PoolResult("r", "m", Task.EMBED, 3, [Embedding(VECTORS[0], E.UBINARY, data)])
    embedding = convert.response_to_proto(result).embed.embeddings[0]
    assert (embedding.data, embedding.dimensions) == (data, 37)
    assert embedding.encoding == pb.EMBEDDING_ENCODING_UBINARY
    assert not embedding.values
    data = encode(ROWS, E.BINARY, None)
    rows = TokenRows(ROWS, list(range(5)), [(0, 0)] * 5, [False] * 5, encoding=E.BINARY, data=data)
    matrix = convert.response_to_proto(PoolResult("r", "m", Task.TOKEN_EMBED, 5, [rows]))
    item = matrix.token_embed.items[0]
    assert (item.rows, item.cols, item.data, item.encoding) == (
        5,
        19,
        data,
        pb.EMBEDDING_ENCODING_BINARY,
    )
    assert len(item.data) == 5 * 3 and not item.values
