"""The Python client's side of compact embeddings, without a model: decoding every encoding
with and without numpy, the numpy output, and usage and server timings on results (both
clients, unary and chunked over PoolStream) against an in-process fake server."""

from __future__ import annotations

import asyncio
import pickle
import sys
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest

from pooling_client import (
    AsyncPoolingClient,
    PoolingClient,
    PoolingResults,
    ServerTiming,
    Usage,
)
from pooling_client import _encodings as decoding
from pooling_client._chunking import ChunkedJob
from pooling_client.outputs import embedding_request_outputs, pooling_request_outputs
from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.requests.encodings import encode
from pooling_server.engine.requests.params import OutputEncoding
from tests.client.in_process import serve_in_process

RNG = np.random.default_rng(5)
VECTORS = RNG.standard_normal((3, 21)).astype(np.float32)
RANGES = np.vstack([VECTORS.min(axis=0), VECTORS.max(axis=0)]).astype(np.float32)
ENCODINGS = list(decoding.ENCODINGS)
# Largest relative error of each float encoding (round to nearest: half a unit in the last place),
# and float16's absolute one below 2**-14, where its step is fixed at 2**-24 (subnormals).
RELATIVE = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}
ABSOLUTE = {"float32": 0.0, "float16": 2.0**-25, "bfloat16": 0.0}


def packed(values: np.ndarray, name: str) -> bytes:
    return encode(values, OutputEncoding(name), RANGES)


def expected(values: np.ndarray, name: str) -> np.ndarray:
    """What the client should decode: the values in the encoding's precision."""
    from sentence_transformers.util.quantization import quantize_embeddings

    if name in RELATIVE:
        return values.astype(np.float16) if name == "float16" else values
    if name.endswith("int8"):
        return quantize_embeddings(values, precision=name, ranges=RANGES)
    return quantize_embeddings(values, precision=name)


def check_decoded(decoded: Any, values: np.ndarray, name: str) -> None:
    decoded = np.asarray(decoded)
    want = expected(values, name)
    assert decoded.shape == want.shape
    if name in RELATIVE:
        bound = np.abs(values) * RELATIVE[name] + ABSOLUTE[name]
        assert (np.abs(decoded.astype(np.float64) - values) <= bound).all(), name
    else:
        np.testing.assert_array_equal(decoded, want)


@pytest.mark.parametrize("name", ENCODINGS)
def test_decode_array_and_list(name: str) -> None:
    data = packed(VECTORS, name)
    array = decoding.decode_array(data, name, 3, 21)
    assert array.dtype == np.dtype(decoding.NUMPY_DTYPES[name])
    check_decoded(array, VECTORS, name)
    one = packed(VECTORS[1], name)
    values = decoding.decode_list(one, name, 21)
    assert all(isinstance(v, int if name.endswith(("int8", "binary")) else float) for v in values)
    check_decoded([values], VECTORS[1:2], name)


@pytest.mark.parametrize("name", ENCODINGS)
def test_decoding_without_numpy_agrees(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    data = packed(VECTORS, name)
    with_numpy = decoding.decode_rows(data, name, 3, 21).tolist()
    monkeypatch.setattr(decoding, "_numpy_or_none", lambda: None)
    rows = decoding.decode_rows(data, name, 3, 21)
    assert isinstance(rows, list) and isinstance(rows[0], list)
    assert rows == with_numpy
    assert decoding.decode_list(packed(VECTORS[0], name), name, 21) == with_numpy[0]


def test_wrong_sizes_and_unknown_encodings_fail() -> None:
    with pytest.raises(ValueError, match="should hold 42 bytes"):
        decoding.decode_array(b"\0" * 40, "float16", 1, 21)
    with pytest.raises(ValueError, match="upgrade pooling-client"):
        decoding.name_of(42)
    with pytest.raises(ValueError, match="Unknown encoding"):
        decoding.check_encoding("float8", "embed")
    with pytest.raises(ValueError, match="only for embed and token_embed"):
        decoding.check_encoding("int8", "classify")
    with pytest.raises(ValueError, match="output must be one of"):
        decoding.check_output("tensor")


def test_numpy_output_needs_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "numpy", None)
    with pytest.raises(ImportError, match=r"pip install 'pooling-client\[numpy\]'"):
        decoding.check_output("numpy")
    decoding.check_output("list")


def _embed_response(name: str | None, values: np.ndarray = VECTORS) -> pb.PoolResponse:
    response = pb.PoolResponse(request_id="r", usage=pb.Usage(prompt_tokens=9, total_tokens=9))
    for vector in values:
        if name is None:
            response.embed.embeddings.add(values=vector.tolist())
        else:
            response.embed.embeddings.add(
                data=packed(vector, name),
                dimensions=vector.shape[0],
                encoding=decoding.ENCODINGS[name],  # type: ignore[arg-type]
            )
    return response


@pytest.mark.parametrize("name", ENCODINGS)
def test_embed_outputs_and_their_numpy_form(name: str) -> None:
    outputs = embedding_request_outputs(_embed_response(name))
    assert [o.outputs.encoding for o in outputs] == [name] * 3
    assert [o.outputs.hidden_size for o in outputs] == [21] * 3
    results = PoolingResults(outputs, Usage(9, 9))
    check_decoded([o.outputs.embedding for o in outputs], VECTORS, name)
    check_decoded(results.numpy(), VECTORS, name)
    check_decoded(outputs[2].outputs.numpy()[None], VECTORS[2:], name)


def test_default_embeddings_stack_as_float32() -> None:
    results = PoolingResults(embedding_request_outputs(_embed_response(None)))
    array = results.numpy()
    assert array.dtype == np.float32 and array.shape == (3, 21)
    np.testing.assert_array_equal(array, VECTORS)
    assert results[0].outputs.encoding is None and results[0].outputs.hidden_size == 21


@pytest.mark.parametrize("name", ENCODINGS)
def test_token_matrices_decode(name: str) -> None:
    response = pb.PoolResponse(request_id="r")
    response.token_embed.items.add(
        rows=3,
        cols=21,
        data=packed(VECTORS, name),
        encoding=decoding.ENCODINGS[name],  # type: ignore[arg-type]
        token_ids=[1, 2, 3],
    )
    (output,) = pooling_request_outputs(response)
    assert output.outputs.encoding == name
    check_decoded(output.outputs.data, VECTORS, name)
    (array,) = PoolingResults([output]).numpy()
    check_decoded(array, VECTORS, name)


def test_results_are_a_list_with_usage_and_timing() -> None:
    timing = ServerTiming.from_metadata(
        (
            ("x-total-time-ms", "5.500"),
            ("x-tokenization-time-ms", "1.000"),
            ("x-queue-time-ms", "0.250"),
            ("x-inference-time-ms", "4.000"),
            ("x-prompt-tokens", "9"),
        )
    )
    assert timing == ServerTiming(5.5, 1.0, 0.25, 4.0)
    assert ServerTiming.from_metadata((("x-total-time-ms", "1"),)) is None
    assert ServerTiming.from_metadata(None) is None
    results = PoolingResults(
        embedding_request_outputs(_embed_response("int8")), Usage(9, 9), timing
    )
    assert isinstance(results, list) and len(results) == 3
    again = pickle.loads(pickle.dumps(results))
    assert again == results and again.usage == Usage(9, 9) and again.timing == timing
    assert PoolingResults().numpy().shape == (0, 0)


def test_chunked_job_sums_usage() -> None:
    template = pb.PoolRequest(request_id="j", encoding=pb.EMBEDDING_ENCODING_FLOAT16)
    job = ChunkedJob("embed", ["a", "b", "c"], template, size=2, window=2)
    requests = job.fill()
    assert [r.request.encoding for r in requests] == [pb.EMBEDDING_ENCODING_FLOAT16] * 2
    for request, count, tokens in zip(requests, (2, 1), (7, 4), strict=True):
        response = _embed_response("float16", VECTORS[:count])
        response.request_id = request.request.request_id
        response.usage.prompt_tokens = response.usage.total_tokens = tokens
        job.accept(pb.PoolStreamResponse(request_id=response.request_id, response=response))
    results = job.outputs()
    assert results.usage == Usage(11, 11) and results.timing is None
    assert results.numpy().dtype == np.float16


# Against an in-process fake server.


class EncodingServicer(pooling_pb2_grpc.PoolingServiceServicer):
    """Embeds text i as VECTORS[i % 3] in the request's encoding, with usage and timings."""

    def __init__(self) -> None:
        self.requests: list[pb.PoolRequest] = []

    def _answer(self, request: pb.PoolRequest) -> pb.PoolResponse:
        self.requests.append(request)
        name = decoding.NAMES.get(request.encoding)
        case = request.WhichOneof("input")
        texts = list(getattr(request, case).texts)
        values = np.stack([VECTORS[len(text) % 3] for text in texts])
        if case == "embed":
            response = _embed_response(name, values)
        else:
            response = pb.PoolResponse()
            for vector in values:
                matrix = response.token_embed.items.add(rows=1, cols=21, token_ids=[0])
                if name is None:
                    matrix.values.extend(vector.tolist())
                else:
                    matrix.data = packed(vector, name)
                    matrix.encoding = request.encoding
        response.request_id = request.request_id
        response.usage.prompt_tokens = response.usage.total_tokens = 2 * len(texts)
        return response

    def Pool(self, request: pb.PoolRequest, context: grpc.ServicerContext) -> pb.PoolResponse:
        context.set_trailing_metadata(
            (
                ("x-total-time-ms", "3.000"),
                ("x-tokenization-time-ms", "0.500"),
                ("x-queue-time-ms", "0.500"),
                ("x-inference-time-ms", "2.000"),
                ("x-prompt-tokens", str(2 * len(request.embed.texts))),
            )
        )
        return self._answer(request)

    def PoolStream(self, requests: Any, context: grpc.ServicerContext) -> Any:
        for message in requests:
            response = self._answer(message.request)
            yield pb.PoolStreamResponse(request_id=response.request_id, response=response)

    def ListModels(self, request: Any, context: grpc.ServicerContext) -> Any:
        return pb.ListModelsResponse(max_client_batch_size=2, max_stream_inflight=4)


@pytest.fixture(scope="module")
def fake() -> Iterator[tuple[str, EncodingServicer]]:
    servicer = EncodingServicer()
    with serve_in_process(servicer) as address:
        yield address, servicer


TEXTS = ["", "a", "bb"]  # VECTORS[0], [1], [2]
TIMING = ServerTiming(3.0, 0.5, 0.5, 2.0)


def test_sync_client_sends_encoding_and_reports_usage_and_timing(
    fake: tuple[str, EncodingServicer],
) -> None:
    address, servicer = fake
    with PoolingClient(address, timeout=10) as client:
        for name in ENCODINGS:
            results = client.embed(TEXTS, encoding=name)
            assert servicer.requests[-1].encoding == decoding.ENCODINGS[name]
            assert results.usage == Usage(6, 6) and results.timing == TIMING
            check_decoded(results.numpy(), VECTORS, name)
            check_decoded(client.embed(TEXTS, encoding=name, output="numpy"), VECTORS, name)
        default = client.embed(TEXTS, output="numpy")
        assert servicer.requests[-1].encoding == pb.EMBEDDING_ENCODING_UNSPECIFIED
        np.testing.assert_array_equal(default, VECTORS)
        tokens = client.encode(TEXTS, encoding="bfloat16", output="numpy")
        assert [t.shape for t in tokens] == [(1, 21)] * 3
        check_decoded(np.concatenate(tokens), VECTORS, "bfloat16")
        with pytest.raises(ValueError, match="only for embed and token_embed"):
            client.encode(TEXTS, pooling_task="token_classify", encoding="int8")


def test_chunked_calls_sum_usage(fake: tuple[str, EncodingServicer]) -> None:
    address, _ = fake
    texts = TEXTS * 12  # 36 texts: over the unary threshold, in chunks of 2
    with PoolingClient(address, timeout=10, batch_size=2) as client:
        results = client.embed(texts, encoding="ubinary")
    assert results.usage == Usage(72, 72) and results.timing is None
    check_decoded(results.numpy(), np.concatenate([VECTORS] * 12), "ubinary")


def test_async_client_sends_encoding_and_reports_usage_and_timing(
    fake: tuple[str, EncodingServicer],
) -> None:
    address, servicer = fake

    async def main() -> None:
        async with AsyncPoolingClient(address, timeout=10) as client:
            for name in ENCODINGS:
                results = await client.embed(TEXTS, encoding=name)
                assert servicer.requests[-1].encoding == decoding.ENCODINGS[name]
                assert results.usage == Usage(6, 6) and results.timing == TIMING
                check_decoded(results.numpy(), VECTORS, name)
                array = await client.encode(
                    TEXTS, pooling_task="embed", encoding=name, output="numpy"
                )
                check_decoded(array, VECTORS, name)
            tokens = await client.encode(TEXTS, encoding="float16")
            assert tokens.usage == Usage(6, 6)
            check_decoded(np.concatenate([t.outputs.data for t in tokens]), VECTORS, "float16")
            chunked = await client.embed(TEXTS * 12, encoding="int8", output="list")
            assert chunked.usage == Usage(72, 72)

    asyncio.run(main())
