"""Compact embeddings end to end, on a real server of tiny random models: every encoding as
decoded by the Python clients (sync and async) and the Node client, against the float32
values of the same server, within each encoding's precision; binary and ubinary bit-exact
with sentence-transformers' quantize_embeddings, int8/uint8 exact with its `ranges` on a
folder that ships calibration ranges (JSON and .npy), and with the ranges computed at load
on one that ships none (gRPC and the cohere SDK); the refusals with their field paths."""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Iterator
from pathlib import Path

import cohere
import grpc
import numpy as np
import pytest
import torch
from sentence_transformers import SentenceTransformer
from sentence_transformers.util.quantization import quantize_embeddings

from pooling_client import AsyncPoolingClient, PoolingClient, PoolingError, PoolingParams, Usage
from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.backends import CALIBRATION_FILE
from pooling_server.engine.models.loader import load_model
from pooling_server.engine.models.model_spec import ModelSpec
from tests.client.test_node_client import _require_node, install_node_modules, run_node
from tests.conftest import Served, server_args
from tests.rpc_errors import DecodedError, decode_rpc_error, decode_status
from tests.server_process import ServerProcess, free_port, running_server

TEXTS = [
    "Hello world",
    "Compact embeddings travel as packed bytes.",
    "Binary quantization keeps one bit per dimension.",
    "naïve café 東京 🙂",
]
CALIBRATION_TEXTS = [f"calibration sentence number {i} about topic {i % 7}" for i in range(40)]
ENCODINGS = ["float32", "float16", "bfloat16", "binary", "ubinary", "int8", "uint8"]
# Largest relative error of each float encoding (round to nearest: half a unit in the last place),
# and float16's absolute one below 2**-14, where its step is fixed at 2**-24 (subnormals).
RELATIVE = {"float32": 0.0, "float16": 2.0**-11, "bfloat16": 2.0**-8}
ABSOLUTE = {"float32": 0.0, "float16": 2.0**-25, "bfloat16": 0.0}
WIDTH = 32  # the tiny models' hidden size


@pytest.fixture(scope="module")
def folders(model_folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """tiny-st-mean with calibration_ranges.json (ranges of its sentence-transformers
    embeddings), and tiny-bert with calibration_ranges.npy."""
    root = tmp_path_factory.mktemp("calibrated")
    st_folder = shutil.copytree(model_folders["tiny-st-mean"], root / "st-json")
    st_embeddings = SentenceTransformer(str(st_folder), device="cpu").encode(CALIBRATION_TEXTS)
    ranges = np.vstack([st_embeddings.min(axis=0), st_embeddings.max(axis=0)])
    (st_folder / "calibration_ranges.json").write_text(
        json.dumps({"min": ranges[0].tolist(), "max": ranges[1].tolist()})
    )
    bert_folder = shutil.copytree(model_folders["tiny-bert"], root / "bert-npy")
    spread = np.linspace(0.2, 0.4, WIDTH)
    np.save(bert_folder / "calibration_ranges.npy", np.vstack([-spread, spread]))
    return {
        "st-json": st_folder,
        "bert-npy": bert_folder,
        "plain": model_folders["tiny-st-mean"],
        "classifier": model_folders["tiny-classifier"],
    }


def ranges_of(folder: Path) -> np.ndarray:
    if (folder / "calibration_ranges.npy").is_file():
        return np.load(folder / "calibration_ranges.npy").astype(np.float32)
    data = json.loads((folder / "calibration_ranges.json").read_text())
    return np.array([data["min"], data["max"]], dtype=np.float32)


def computed_ranges(folder: Path) -> np.ndarray:
    """Independently of the server: sentence-transformers' embeddings of the calibration
    texts the server ships, min and max per dimension (quantize_embeddings' own ranges)."""
    texts = [line.strip() for line in CALIBRATION_FILE.read_text().splitlines() if line.strip()]
    vectors = SentenceTransformer(str(folder), device="cpu").encode(texts)
    return np.vstack([vectors.min(axis=0), vectors.max(axis=0)]).astype(np.float32)


@pytest.fixture(scope="module")
def http_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def server(
    folders: dict, http_port: int, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    models = [
        Served("calibrated", str(folders["st-json"]), hf_overrides={"is_matryoshka": True}),
        Served("calibrated-npy", str(folders["bert-npy"])),
        Served("plain", str(folders["plain"])),
        Served("classifier", str(folders["classifier"])),
    ]
    args = [*server_args(models), "--dtype", "float32", "--http-port", str(http_port)]
    yield from running_server(args, tmp_path_factory.mktemp("encoding-logs"), "encodings")


def check(decoded: np.ndarray, floats: np.ndarray, encoding: str, ranges: np.ndarray) -> None:
    """`decoded` (as the client returns it) against the float32 values of the same server."""
    decoded = np.asarray(decoded)
    if encoding in RELATIVE:
        assert decoded.shape == floats.shape
        error = np.abs(decoded.astype(np.float64) - floats)
        bound = np.abs(floats) * RELATIVE[encoding] + ABSOLUTE[encoding]
        assert (error <= bound).all(), (encoding, error.max())
        return
    kwargs = {"ranges": ranges} if encoding.endswith("int8") else {}
    expected = quantize_embeddings(floats, precision=encoding, **kwargs)
    assert decoded.dtype == expected.dtype
    np.testing.assert_array_equal(decoded, expected)
    if encoding.endswith("int8"):  # back to floats: within one quantization step
        levels = decoded.astype(np.float64) + (128 if encoding == "int8" else 0)
        steps = (ranges[1] - ranges[0]) / 255
        inside = (floats >= ranges[0]) & (floats <= ranges[1])
        restored = ranges[0] + levels * steps
        assert (
            np.abs(restored - floats)[inside] <= np.broadcast_to(steps, floats.shape)[inside] + 1e-6
        ).all()


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_embed_decodes_to_float32_within_precision(
    client: PoolingClient, folders: dict, encoding: str
) -> None:
    floats = client.embed(TEXTS, model="calibrated").numpy()
    assert floats.dtype == np.float32 and floats.shape == (len(TEXTS), WIDTH)
    results = client.embed(TEXTS, model="calibrated", encoding=encoding)
    assert [r.outputs.encoding for r in results] == [encoding] * len(TEXTS)
    assert [r.outputs.hidden_size for r in results] == [WIDTH] * len(TEXTS)
    ranges = ranges_of(folders["st-json"])
    array = results.numpy()
    check(array, floats, encoding, ranges)
    lists = [r.outputs.embedding for r in results]
    check(np.array(lists, dtype=array.dtype), floats, encoding, ranges)
    check(
        client.embed(TEXTS, model="calibrated", encoding=encoding, output="numpy"),
        floats,
        encoding,
        ranges,
    )


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_token_embed_decodes_to_float32_within_precision(
    client: PoolingClient, folders: dict, encoding: str
) -> None:
    floats = client.encode(TEXTS, model="calibrated-npy", output="numpy")
    results = client.encode(TEXTS, model="calibrated-npy", encoding=encoding)
    ranges = ranges_of(folders["bert-npy"])
    for result, rows in zip(results, floats, strict=True):
        assert result.outputs.encoding == encoding
        check(result.outputs.data, rows, encoding, ranges)


def test_async_client_decodes_every_encoding(server: ServerProcess, folders: dict) -> None:
    async def main() -> None:
        async with AsyncPoolingClient(server.address, timeout=60, model="calibrated") as client:
            floats = await client.embed(TEXTS, output="numpy")
            tokens = await client.encode(TEXTS[:2], output="numpy")
            for encoding in ENCODINGS:
                results = await client.embed(TEXTS, encoding=encoding)
                check(results.numpy(), floats, encoding, ranges_of(folders["st-json"]))
                assert results.usage is not None and results.usage.prompt_tokens > len(TEXTS)
                assert results.timing is not None
                rows = await client.encode(TEXTS[:2], encoding=encoding, output="numpy")
                for got, want in zip(rows, tokens, strict=True):
                    check(got, want, encoding, ranges_of(folders["st-json"]))

    asyncio.run(main())


def test_bits_match_quantize_embeddings_of_sentence_transformers(
    client: PoolingClient, folders: dict
) -> None:
    """The server's float32 equals sentence-transformers on the folder, so its binary and
    ubinary equal quantize_embeddings of sentence-transformers' own embeddings (values this
    close to 0 could flip a bit; none of these are)."""
    reference = SentenceTransformer(str(folders["plain"]), device="cpu").encode(TEXTS)
    assert np.abs(reference).min() > 1e-5
    floats = client.embed(TEXTS, model="plain", output="numpy")
    np.testing.assert_allclose(floats, reference, atol=1e-5)
    for precision in ("binary", "ubinary"):
        got = client.embed(TEXTS, model="plain", encoding=precision, output="numpy")
        np.testing.assert_array_equal(got, quantize_embeddings(reference, precision=precision))


def test_default_encoding_keeps_repeated_float(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    request = pb.PoolRequest(model="plain", embed=pb.TextInput(texts=TEXTS[:2]))
    for embedding in stub.Pool(request).embed.embeddings:
        assert len(embedding.values) == WIDTH
        assert (embedding.data, embedding.dimensions, embedding.encoding) == (b"", 0, 0)
    request.encoding = pb.EMBEDDING_ENCODING_FLOAT16
    for embedding in stub.Pool(request).embed.embeddings:
        assert not embedding.values and len(embedding.data) == 2 * WIDTH
        assert (embedding.dimensions, embedding.encoding) == (WIDTH, request.encoding)


def test_sizes_on_the_wire(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    sizes = {"float32": 128, "float16": 64, "bfloat16": 64, "binary": 4, "ubinary": 4, "int8": 32}
    for name, size in sizes.items():
        value = pb.EmbeddingEncoding.Value(f"EMBEDDING_ENCODING_{name.upper()}")
        request = pb.PoolRequest(
            model="calibrated", embed=pb.TextInput(texts=["a"]), encoding=value
        )
        (embedding,) = stub.Pool(request).embed.embeddings
        assert len(embedding.data) == size, name


def test_model_cards_show_calibration_ranges(client: PoolingClient) -> None:
    cards = {
        info.name: (info.has_calibration_ranges, info.calibration_source)
        for info in client.models()
    }
    assert cards == {
        "calibrated": (True, "folder"),
        "calibrated-npy": (True, "folder"),
        "plain": (True, "computed"),  # its folder ships none
        "classifier": (False, ""),
    }


def test_usage_and_timings_on_results(client: PoolingClient) -> None:
    results = client.embed(TEXTS, model="plain", encoding="binary")
    tokens = client.tokenize(TEXTS, model="plain")
    prompt_tokens = sum(len(t.token_ids) for t in tokens)
    assert results.usage == Usage(prompt_tokens, prompt_tokens)
    timing = results.timing
    assert timing is not None
    assert timing.total_ms >= timing.inference_ms > 0
    assert timing.tokenization_ms >= 0 and timing.queue_ms >= 0
    classified = client.classify(TEXTS, model="classifier")
    assert classified.usage == Usage(prompt_tokens, prompt_tokens) and classified.timing


# Refusals, with their field paths.


def fail(stub: pooling_pb2_grpc.PoolingServiceStub, request: pb.PoolRequest) -> DecodedError:
    with pytest.raises(grpc.RpcError) as raised:
        stub.Pool(request)
    return decode_rpc_error(raised.value)


def near_quantization(
    got: np.ndarray, floats: np.ndarray, encoding: str, ranges: np.ndarray
) -> None:
    """`got` is quantize_embeddings of the server's floats with `ranges` computed apart
    from the server: float32 noise between the two computations of the ranges may move a
    value sitting on a level's edge by one level, nothing more."""
    expected = quantize_embeddings(floats, precision=encoding, ranges=ranges)
    got = np.asarray(got)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    difference = np.abs(got.astype(np.int16) - expected.astype(np.int16))
    assert difference.max() <= 1 and (difference == 0).mean() > 0.98


@pytest.mark.parametrize("encoding", ["int8", "uint8"])
def test_int8_on_a_model_that_ships_no_ranges_uses_computed_ones(
    client: PoolingClient, folders: dict, encoding: str
) -> None:
    """ "plain" ships no calibration ranges: the server computed them at load from its
    calibration texts, so int8 and uint8 are served (embed and token_embed), quantized with
    sentence-transformers' ranges of those texts; a text's bytes are the same whatever else
    its request (and so its batch) holds."""
    ranges = computed_ranges(folders["plain"])
    floats = client.embed(TEXTS, model="plain", output="numpy")
    results = client.embed(TEXTS, model="plain", encoding=encoding)
    assert [r.outputs.encoding for r in results] == [encoding] * len(TEXTS)
    array = results.numpy()
    near_quantization(array, floats, encoding, ranges)
    for n, text in enumerate(TEXTS):
        alone = client.embed([text], model="plain", encoding=encoding, output="numpy")
        np.testing.assert_array_equal(alone[0], array[n])
    rows = client.encode(TEXTS, model="plain", output="numpy")
    encoded = client.encode(TEXTS, model="plain", encoding=encoding, output="numpy")
    for got, want in zip(encoded, rows, strict=True):
        near_quantization(got, want, encoding, ranges)


def test_cohere_sdk_gets_int8_from_a_model_that_ships_no_ranges(
    client: PoolingClient, http_port: int
) -> None:
    """The official cohere SDK asks int8 beside float as a matter of course: served from
    the computed ranges, the values gRPC gives."""
    co = cohere.ClientV2(api_key="unused", base_url=f"http://127.0.0.1:{http_port}")
    response = co.embed(
        model="plain",
        texts=TEXTS,
        input_type="search_document",
        embedding_types=["float", "int8", "uint8"],
    )
    np.testing.assert_array_equal(
        np.array(response.embeddings.float_, dtype=np.float32),
        client.embed(TEXTS, model="plain", output="numpy"),
    )
    for name in ("int8", "uint8"):
        np.testing.assert_array_equal(
            getattr(response.embeddings, name),
            client.embed(TEXTS, model="plain", encoding=name, output="numpy"),
        )


@pytest.mark.parametrize("encoding", [pb.EMBEDDING_ENCODING_BINARY, pb.EMBEDDING_ENCODING_INT8])
@pytest.mark.parametrize("case", ["classify", "score"])
def test_encoding_on_other_tasks_is_refused(
    stub: pooling_pb2_grpc.PoolingServiceStub, case: str, encoding: int
) -> None:
    """A classifier has no embeddings, so no ranges: int8 is refused as any encoding is."""
    model = "classifier" if case == "classify" else "plain"
    request = pb.PoolRequest(model=model, encoding=encoding)  # type: ignore[arg-type]
    if case == "score":
        request.score.text_1.append("a")
        request.score.text_2.append("b")
    else:
        request.classify.texts.append("a")
    error = fail(stub, request)
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == "ENCODING_NOT_SUPPORTED_FOR_TASK"
    assert error.fields == ["encoding"]


def test_unknown_encoding_and_dimensions_mismatch(
    stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    request = pb.PoolRequest(model="calibrated", embed=pb.TextInput(texts=["a"]))
    request.encoding = 42  # type: ignore[assignment]
    error = fail(stub, request)
    assert (error.code, error.reason, error.fields) == (
        grpc.StatusCode.INVALID_ARGUMENT,
        "ENCODING_UNKNOWN",
        ["encoding"],
    )
    request.encoding = pb.EMBEDDING_ENCODING_INT8
    request.params.dimensions = 16
    error = fail(stub, request)
    assert (error.reason, error.fields) == ("CALIBRATION_RANGES_DIMENSIONS", ["encoding"])
    request.encoding = pb.EMBEDDING_ENCODING_BINARY  # bits need no ranges: any dimensions
    (embedding,) = stub.Pool(request).embed.embeddings
    assert (embedding.dimensions, len(embedding.data)) == (16, 2)


def test_refusals_in_band_on_a_stream(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    good = pb.PoolRequest(
        request_id="good",
        model="calibrated",
        embed=pb.TextInput(texts=["a"]),
        encoding=pb.EMBEDDING_ENCODING_INT8,
    )
    computed = pb.PoolRequest(
        request_id="computed",
        model="plain",
        embed=pb.TextInput(texts=["a"]),
        encoding=pb.EMBEDDING_ENCODING_INT8,
    )
    bad = pb.PoolRequest(
        request_id="bad",
        model="calibrated",
        embed=pb.TextInput(texts=["a"]),
        encoding=pb.EMBEDDING_ENCODING_INT8,
        params=pb.PoolingParams(dimensions=16),
    )
    requests = [pb.PoolStreamRequest(request=r) for r in (good, computed, bad)]
    answers = {r.request_id: r for r in stub.PoolStream(iter(requests))}
    assert len(answers["good"].response.embed.embeddings[0].data) == WIDTH
    assert len(answers["computed"].response.embed.embeddings[0].data) == WIDTH
    error = decode_status(answers["bad"].error)
    assert (error.reason, error.fields) == ("CALIBRATION_RANGES_DIMENSIONS", ["encoding"])


def test_python_client_refuses_locally_and_relays_the_server(client: PoolingClient) -> None:
    with pytest.raises(ValueError, match="only for embed and token_embed"):
        client.encode(TEXTS, pooling_task="classify", model="classifier", encoding="binary")
    with pytest.raises(PoolingError) as raised:
        client.embed(
            TEXTS,
            model="calibrated",
            encoding="uint8",
            pooling_params=PoolingParams(dimensions=16),
        )
    assert raised.value.reason == "CALIBRATION_RANGES_DIMENSIONS"
    assert [v.field for v in raised.value.field_violations] == ["encoding"]


def test_a_malformed_calibration_file_stops_the_load(model_folders: dict, tmp_path: Path) -> None:
    folder = shutil.copytree(model_folders["tiny-bert"], tmp_path / "bad")
    (folder / "calibration_ranges.json").write_text(
        json.dumps({"min": [0.0] * 3, "max": [1.0] * 3})
    )
    with pytest.raises(ValueError, match="cover 3 dimensions, but the model's embeddings have 32"):
        load_model(ModelSpec(str(folder)), device=torch.device("cpu"), dtype=torch.float32)


# The Node client.


@pytest.fixture(scope="module")
def node() -> str:
    """node, with clients/node's dependencies installed as its own tests install them (under
    their lock: both modules may run at once on two workers)."""
    node, npm = _require_node()
    install_node_modules(npm)
    return node


def node_embed(node: str, address: str, model: str, encoding: str | None, task: str) -> list:
    args = ["--address", address, "--model", model, "--task", task]
    if encoding is not None:
        args += ["--encoding", encoding]
    result = run_node([node, "scripts/embed.js", *args, *TEXTS])
    assert result.returncode == 0, f"{result.stdout}\n{result.stderr}"
    return json.loads(result.stdout)["embeddings"]


@pytest.mark.parametrize("encoding", ENCODINGS)
def test_node_client_decodes_every_encoding(
    node: str, server: ServerProcess, client: PoolingClient, folders: dict, encoding: str
) -> None:
    dtypes = {"binary": np.int8, "ubinary": np.uint8, "int8": np.int8, "uint8": np.uint8}
    dtype = dtypes.get(encoding, np.float64)
    floats = client.embed(TEXTS, model="calibrated", output="numpy")
    embedded = np.array(
        node_embed(node, server.address, "calibrated", encoding, "embed"), dtype=dtype
    )
    check(embedded, floats, encoding, ranges_of(folders["st-json"]))
    rows = client.encode(TEXTS, model="calibrated-npy", output="numpy")
    tokens = node_embed(node, server.address, "calibrated-npy", encoding, "token_embed")
    for got, want in zip(tokens, rows, strict=True):
        check(np.array(got, dtype=dtype), want, encoding, ranges_of(folders["bert-npy"]))
