"""embed_sparse: SPLADE parity with sentence-transformers' SparseEncoder, through a real server.

The tests build tiny random masked-LM folders: a SparseEncoder saved by sentence-transformers
itself (Transformer fill-mask + SpladePooling max/relu), a legacy one (MLMTransformer +
SpladePooling sum/log1p_relu), and a plain BertForMaskedLM served with --pooling-type splade.
The MLM bias is lowered so that, as with a trained SPLADE model, a text has a few hundred
non-zero weights rather than the whole vocabulary.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from sentence_transformers import SparseEncoder
from sentence_transformers.sparse_encoder.modules import MLMTransformer, SpladePooling, Transformer
from transformers import AutoModelForMaskedLM, AutoTokenizer, BertForMaskedLM, BertModel

from pooling_client import AsyncPoolingClient, PoolingClient, PoolingError, PoolingParams
from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.engine.models.loader import load_model
from pooling_server.engine.models.model_info import PoolingType
from pooling_server.engine.models.model_spec import ModelSpec
from tests.conftest import Served, server_args
from tests.engine.test_task_parity import TEXTS  # varied texts, all within 128 positions
from tests.fixture_models import MINILM, _bert_config
from tests.rpc_errors import decode_rpc_error
from tests.server_process import ServerProcess, running_server, start_server

ATOL = 1e-5
MAX_POSITIONS = 128
LONG_TEXT = " ".join(f"Sentence {i} mentions topic {i * 7 % 13}, and Zürich." for i in range(30))


def _mlm() -> BertForMaskedLM:
    model = BertForMaskedLM(_bert_config())  # fixture_models' tiny BERT, 128 positions
    with torch.no_grad():  # logits are ~N(0, 0.11): keep a few hundred positive per text
        model.cls.predictions.bias.fill_(-0.35)
    return model


def build_folders(root: Path) -> dict[str, Path]:
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    mlm = root / "tiny-mlm"
    _mlm().save_pretrained(mlm)
    tokenizer.save_pretrained(mlm)
    dense = root / "tiny-dense"
    BertModel(_mlm().config).save_pretrained(dense)
    tokenizer.save_pretrained(dense)
    # SparseEncoders saved by sentence-transformers itself, on the same weights.
    splade = root / "tiny-splade"
    transformer = Transformer(str(mlm), transformer_task="fill-mask")
    SparseEncoder(modules=[transformer, SpladePooling("max")], device="cpu").save(str(splade))
    legacy = root / "tiny-splade-sum"
    modules = [MLMTransformer(str(mlm)), SpladePooling("sum", "log1p_relu")]
    SparseEncoder(modules=modules, device="cpu").save(str(legacy))
    return {"tiny-mlm": mlm, "tiny-dense": dense, "tiny-splade": splade, "tiny-splade-sum": legacy}


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_folders(tmp_path_factory.mktemp("sparse-models"))


def _served(folders: dict[str, Path]) -> list[Served]:
    return [
        Served("tiny-splade", str(folders["tiny-splade"])),
        Served("tiny-splade-sum", str(folders["tiny-splade-sum"])),
        Served("tiny-mlm", str(folders["tiny-mlm"]), pooling_type="splade"),
        Served("tiny-mlm-chunk", str(folders["tiny-mlm"]), "splade", long_input="chunk"),
        Served("tiny-mlm-dense", str(folders["tiny-mlm"])),
    ]


@pytest.fixture(scope="module")
def server(
    folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ServerProcess]:
    args = [*server_args(_served(folders)), "--dtype", "float32"]
    yield from running_server(args, tmp_path_factory.mktemp("sparse-logs"))


# `client` and `stub`: tests/conftest.py's, on this module's server.


class References:
    """sentence-transformers' SparseEncoder per folder, loaded once."""

    def __init__(self, folders: dict[str, Path]) -> None:
        self.folders = folders
        self._encoders: dict[str, SparseEncoder] = {}

    def encoder(self, name: str) -> SparseEncoder:
        # --pooling-type splade on the plain folder is the max/relu SparseEncoder.
        folder = "tiny-splade" if name.startswith("tiny-mlm") else name
        if folder not in self._encoders:
            self._encoders[folder] = SparseEncoder(str(self.folders[folder]), device="cpu")
        return self._encoders[folder]

    def dense(self, name: str, texts: list[str], **kwargs: Any) -> np.ndarray:
        embeddings = self.encoder(name).encode(texts, convert_to_tensor=True, **kwargs)
        return embeddings.to_dense().float().numpy()


@pytest.fixture(scope="module")
def refs(folders: dict[str, Path]) -> References:
    return References(folders)


def to_dense(indices: list[int], values: list[float], size: int = 30522) -> np.ndarray:
    dense = np.zeros(size, dtype=np.float32)
    dense[indices] = values
    return dense


def check_order(indices: list[int], values: list[float]) -> None:
    """By decreasing weight, ties by index; every weight non-zero; no index twice."""
    assert len(indices) == len(values) == len(set(indices))
    assert all(v > 0 for v in values)
    pairs = list(zip(values, indices, strict=True))
    assert pairs == sorted(pairs, key=lambda p: (-p[0], p[1]))


@pytest.mark.parametrize("name", ["tiny-splade", "tiny-splade-sum", "tiny-mlm"])
def test_parity_with_sparse_encoder(client: PoolingClient, refs: References, name: str) -> None:
    outputs = client.embed_sparse(TEXTS, model=name)
    expected = refs.dense(name, TEXTS)
    assert len(outputs) == len(TEXTS)
    for output, reference in zip(outputs, expected, strict=True):
        sparse = output.outputs
        check_order(sparse.indices, sparse.values)
        assert sparse.tokens == []
        np.testing.assert_allclose(to_dense(sparse.indices, sparse.values), reference, atol=ATOL)
        assert 20 < len(sparse.indices) < 2000  # sparse, as a trained model's would be


def test_top_k_matches_max_active_dims(client: PoolingClient, refs: References) -> None:
    full = client.embed_sparse(TEXTS, model="tiny-splade")
    top = client.embed_sparse(TEXTS, model="tiny-splade", top_k=5)
    expected = refs.dense("tiny-splade", TEXTS, max_active_dims=5)
    for whole, kept, reference in zip(full, top, expected, strict=True):
        assert kept.outputs.indices == whole.outputs.indices[:5]
        assert kept.outputs.values == whole.outputs.values[:5]
        np.testing.assert_allclose(
            to_dense(kept.outputs.indices, kept.outputs.values), reference, atol=ATOL
        )
    # More than there are non-zero weights keeps them all.
    every = client.embed_sparse(TEXTS[:1], model="tiny-splade", top_k=30522)
    assert every[0].outputs.indices == full[0].outputs.indices


def test_return_tokens_decodes_like_sparse_encoder(client: PoolingClient, refs: References) -> None:
    outputs = client.embed_sparse(TEXTS, model="tiny-splade", top_k=8, return_tokens=True)
    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    encoder = refs.encoder("tiny-splade")
    references = encoder.encode(TEXTS, convert_to_tensor=True)
    for output, reference in zip(outputs, references, strict=True):
        sparse = output.outputs
        assert sparse.tokens == tokenizer.convert_ids_to_tokens(sparse.indices)
        decoded = encoder.decode(reference, top_k=8)
        assert [token for token, _ in sparse.decode()] == [token for token, _ in decoded]
        np.testing.assert_allclose(
            [w for _, w in sparse.decode()], [w for _, w in decoded], atol=ATOL
        )
        assert sparse.to_dict() == dict(zip(sparse.indices, sparse.values, strict=True))
    plain = client.embed_sparse(TEXTS[:1], model="tiny-splade")
    with pytest.raises(ValueError, match="return_tokens"):
        plain[0].outputs.decode()


def _max_relu_logits(folder: Path, text: str) -> np.ndarray:
    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForMaskedLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(**tokenizer(text, return_tensors="pt")).logits[0]
    return torch.relu(logits).amax(dim=0).numpy()


def test_use_activation_false_skips_the_log_saturation(
    client: PoolingClient, folders: dict[str, Path]
) -> None:
    text = TEXTS[2]
    raw = client.embed_sparse(text, model="tiny-splade", pooling_params=PoolingParams(False))
    saturated = client.embed_sparse(text, model="tiny-splade")
    kept, weights = raw[0].outputs, saturated[0].outputs
    assert kept.indices == weights.indices  # log1p is monotonic: same order
    np.testing.assert_allclose(np.log1p(kept.values), weights.values, atol=ATOL)
    expected = _max_relu_logits(folders["tiny-mlm"], text)
    np.testing.assert_allclose(to_dense(kept.indices, kept.values), expected, atol=ATOL)
    explicit = client.embed_sparse(text, model="tiny-splade", pooling_params=PoolingParams(True))
    assert explicit[0].outputs.indices == weights.indices
    np.testing.assert_allclose(explicit[0].outputs.values, weights.values, atol=ATOL)


def _splade_logits(folder: Path, ids: list[int]) -> np.ndarray:
    """max over tokens of log(1 + relu(logits)) of one unpadded sequence of token ids."""
    model = AutoModelForMaskedLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids])).logits[0]
    return torch.log1p(torch.relu(logits)).amax(dim=0).numpy()


def test_chunked_long_input_is_the_max_over_windows(
    client: PoolingClient, folders: dict[str, Path]
) -> None:
    tokenizer = AutoTokenizer.from_pretrained(MINILM)
    ids = tokenizer(LONG_TEXT, add_special_tokens=False)["input_ids"]
    window = MAX_POSITIONS - 2
    # Each window as the server builds it: [CLS] + up to 126 tokens + [SEP].
    pieces = [
        [tokenizer.cls_token_id, *ids[i : i + window], tokenizer.sep_token_id]
        for i in range(0, len(ids), window)
    ]
    assert len(pieces) == 3
    windows = [_splade_logits(folders["tiny-mlm"], piece) for piece in pieces]
    output = client.embed_sparse(LONG_TEXT, model="tiny-mlm-chunk")[0].outputs
    check_order(output.indices, output.values)
    expected = np.max(windows, axis=0)
    np.testing.assert_allclose(to_dense(output.indices, output.values), expected, atol=ATOL)
    # Without chunking: refused, or truncated to the first window.
    with pytest.raises(PoolingError) as refused:
        client.embed_sparse(LONG_TEXT, model="tiny-mlm")
    assert refused.value.reason == "INPUT_TOO_LONG"
    truncated = client.embed_sparse(LONG_TEXT, model="tiny-mlm", truncate_prompt_tokens=-1)
    sparse = truncated[0].outputs
    np.testing.assert_allclose(to_dense(sparse.indices, sparse.values), windows[0], atol=ATOL)


def test_streamed_chunks_keep_top_k_and_tokens(server: ServerProcess) -> None:
    """A job split over PoolStream carries SparseInput's options in every chunk."""
    texts = TEXTS * 6
    with PoolingClient(server.address, timeout=60, batch_size=4) as small:
        streamed = small.embed_sparse(texts, model="tiny-splade", top_k=3, return_tokens=True)
    with PoolingClient(server.address, timeout=60) as whole:
        unary = whole.embed_sparse(texts, model="tiny-splade", top_k=3, return_tokens=True)
    assert len(streamed) == len(unary) == len(texts)
    for one, other in zip(streamed, unary, strict=True):  # batched differently: float noise
        assert (one.outputs.indices, one.outputs.tokens) == (
            other.outputs.indices,
            other.outputs.tokens,
        )
        np.testing.assert_allclose(one.outputs.values, other.outputs.values, atol=ATOL)
        assert len(one.outputs.indices) == 3 == len(one.outputs.tokens)
    assert [o.request_id.rsplit("-", 1)[1] for o in streamed] == [str(i) for i in range(len(texts))]


def test_async_client(server: ServerProcess, client: PoolingClient) -> None:
    async def run() -> Any:
        async with AsyncPoolingClient(server.address, timeout=60) as async_client:
            return await async_client.embed_sparse(
                TEXTS, model="tiny-splade", top_k=4, return_tokens=True
            )

    outputs = asyncio.run(run())
    expected = client.embed_sparse(TEXTS, model="tiny-splade", top_k=4, return_tokens=True)
    assert len(outputs) == len(TEXTS)
    for one, other in zip(outputs, expected, strict=True):
        assert (one.outputs.indices, one.outputs.tokens) == (
            other.outputs.indices,
            other.outputs.tokens,
        )
        np.testing.assert_allclose(one.outputs.values, other.outputs.values, atol=ATOL)


def _error(stub: pooling_pb2_grpc.PoolingServiceStub, request: pb.PoolRequest) -> Any:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Pool(request, timeout=30)
    return decode_rpc_error(caught.value)


def test_validation(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    def sparse(model: str = "tiny-splade", **fields: Any) -> pb.PoolRequest:
        params = fields.pop("params", None)
        fields.setdefault("texts", ["a"])
        return pb.PoolRequest(model=model, params=params, embed_sparse=pb.SparseInput(**fields))

    error = _error(stub, sparse(top_k=-1))
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "TOP_K_INVALID")
    assert error.fields == ["embed_sparse.top_k"]

    error = _error(stub, sparse(params=pb.PoolingParams(dimensions=8)))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.reason, error.fields) == ("PARAM_NOT_SUPPORTED_FOR_TASK", ["params.dimensions"])

    error = _error(stub, sparse("tiny-splade-sum", params=pb.PoolingParams(use_activation=False)))
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert (error.reason, error.fields) == (
        "USE_ACTIVATION_NOT_SUPPORTED",
        ["params.use_activation"],
    )

    error = _error(stub, sparse(params=pb.PoolingParams(task=pb.POOLING_TASK_EMBED)))
    assert (error.reason, error.fields) == ("TASK_MISMATCH", ["params.task"])

    error = _error(stub, sparse(texts=[]))  # SparseInput with no texts
    assert (error.reason, error.fields) == ("EMPTY_INPUT", ["embed_sparse.texts"])

    # A dense model does not run embed_sparse, and a sparse one runs nothing else.
    error = _error(stub, sparse("tiny-mlm-dense"))
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "TASK_NOT_SUPPORTED")
    assert error.fields == ["embed_sparse"]
    error = _error(stub, pb.PoolRequest(model="tiny-splade", embed=pb.TextInput(texts=["a"])))
    assert (error.code, error.reason) == (grpc.StatusCode.FAILED_PRECONDITION, "TASK_NOT_SUPPORTED")

    ok = stub.Pool(sparse(params=pb.PoolingParams(task=pb.POOLING_TASK_EMBED_SPARSE)), timeout=30)
    assert ok.WhichOneof("output") == "embed_sparse" and len(ok.embed_sparse.embeddings) == 1


def test_client_checks(client: PoolingClient) -> None:
    with pytest.raises(ValueError, match="top_k"):
        client.embed_sparse("a", model="tiny-splade", top_k=-1)
    with pytest.raises(TypeError, match="top_k"):
        client.embed_sparse("a", model="tiny-splade", top_k=2.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dimensions"):
        client.embed_sparse("a", model="tiny-splade", pooling_params=PoolingParams(dimensions=4))


def test_list_models_shows_the_task(client: PoolingClient) -> None:
    infos = {info.name: info for info in client.models()}
    for name in ("tiny-splade", "tiny-splade-sum", "tiny-mlm", "tiny-mlm-chunk"):
        info = infos[name]
        assert (info.tasks, info.pooling_type) == (["embed_sparse"], "splade")
        assert info.architecture == "BertForMaskedLM"
        assert info.default_use_activation is True
        assert info.labels == []
    dense = infos["tiny-mlm-dense"]
    assert "embed_sparse" not in dense.tasks and dense.pooling_type == "cls"


def test_splade_needs_a_masked_lm(folders: dict[str, Path]) -> None:
    spec = ModelSpec(str(folders["tiny-dense"]), pooling_type=PoolingType.SPLADE)
    with pytest.raises(ValueError, match="masked-LM"):
        load_model(spec, device=torch.device("cpu"), dtype=torch.float32)


def test_engine_process_front_end(
    folders: dict[str, Path], refs: References, tmp_path: Path
) -> None:
    """With an engine process, vocabulary vectors cross to the front end, which finishes
    (saturation, order, top_k, tokens) with a tokenizer rebuilt from the engine's spec."""
    args = [*server_args(_served(folders)[:2]), "--dtype", "float32", "--frontends", "1"]
    process = start_server(args, tmp_path, name="frontend")
    try:
        with PoolingClient(process.address, timeout=60) as remote:
            outputs = remote.embed_sparse(TEXTS, model="tiny-splade", return_tokens=True)
            summed = remote.embed_sparse(TEXTS, model="tiny-splade-sum", top_k=10)
            infos = {info.name: info for info in remote.models()}
    finally:
        process.stop(signal.SIGTERM)
    assert infos["tiny-splade"].tasks == ["embed_sparse"]
    for output, reference in zip(outputs, refs.dense("tiny-splade", TEXTS), strict=True):
        sparse = output.outputs
        np.testing.assert_allclose(to_dense(sparse.indices, sparse.values), reference, atol=ATOL)
        assert len(sparse.tokens) == len(sparse.indices)
    expected = refs.dense("tiny-splade-sum", TEXTS, max_active_dims=10)
    for output, reference in zip(summed, expected, strict=True):
        sparse = output.outputs
        np.testing.assert_allclose(to_dense(sparse.indices, sparse.values), reference, atol=ATOL)
