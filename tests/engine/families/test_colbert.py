"""ColBERT multi-vector models on a tiny random-weight BERT saved in PyLate's layout (and
re-saved by sentence-transformers in MultiVectorEncoder's): embed_multi in query and
document mode and MaxSim scores equal to MultiVectorEncoder's encode_query /
encode_document / similarity, in mixed batches, and every refusal."""

from __future__ import annotations

import dataclasses
import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
import torch
from sentence_transformers import MultiVectorEncoder

from pooling_server.engine.backends import BackendKind, BackendOptions
from pooling_server.engine.errors import PoolingError
from pooling_server.engine.families.colbert.multi_vector import MultiVectorSettings
from pooling_server.engine.models.loader import LoadedModel
from pooling_server.engine.requests.outputs import ItemOutput, MultiVector, Score
from pooling_server.engine.requests.params import OutputEncoding, PoolingParams, Task
from pooling_server.engine.requests.plans import plan_request
from pooling_server.engine.requests.request import PoolRequest, RerankRequest
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.requests.validation import validate_request, validate_rerank
from tests.engine.planned import load, run_all
from tests.fixture_models import COLBERT_DIM, MINILM, tiny_colbert

ATOL = 1e-5
QUERIES = ["what is the capital of france?", "a", "why, oh why, is the sky blue; really? " * 3]
DOCUMENTS = [
    "Paris is the capital of France.",
    "b!",
    "The sky is blue because of Rayleigh scattering, mostly. " * 4,  # past document_length
    "...",  # nothing but skiplist words between the specials
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("colbert")
    pylate = tiny_colbert(root / "pylate")
    attend = tiny_colbert(root / "attend", attend_to_expansion=True)
    unused = tiny_colbert(root / "unused", markers=("[unused0]", "[unused1]"))
    native = root / "native"
    MultiVectorEncoder(str(pylate), device="cpu").save(str(native))
    return {"pylate": pylate, "attend": attend, "native": native, "unused": unused}


@pytest.fixture(scope="module")
def models(folders: dict[str, Path]) -> dict[str, LoadedModel]:
    return {name: load(folder) for name, folder in folders.items()}


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]) -> dict[str, MultiVectorEncoder]:
    return {name: MultiVectorEncoder(str(f), device="cpu") for name, f in folders.items()}


def multi(texts: Sequence[str], mode: str | None, **fields: object) -> PoolRequest:
    return PoolRequest(
        task=Task.EMBED_MULTI,
        texts=tuple(texts),
        prompt_name=mode,
        **fields,  # type: ignore[arg-type]
    )


def matrices(outputs: list[ItemOutput]) -> list[np.ndarray]:
    assert all(isinstance(o, MultiVector) for o in outputs)
    return [o.values for o in outputs]  # type: ignore[union-attr]


def test_loads_as_a_multi_vector_model(models: dict[str, LoadedModel]) -> None:
    for name in ("pylate", "native"):
        info = models[name].info
        assert info.tasks == (Task.EMBED_MULTI, Task.SCORE)
        assert not info.is_cross_encoder
        assert info.hidden_size == COLBERT_DIM
        settings = info.settings
        assert info.family == "colbert" and isinstance(settings, MultiVectorSettings)
        assert (settings.query_prefix, settings.document_prefix) == ("[Q] ", "[D] ")
        assert (settings.query_length, settings.document_length) == (12, 20)
        assert settings.query_expansion and not settings.attend_to_expansion
        assert len(settings.skiplist_ids) == 6
        assert info.prompts == {"query": "[Q] ", "document": "[D] "}


@pytest.mark.parametrize("name", ["pylate", "attend", "native", "unused"])
def test_query_and_document_modes_equal_multi_vector_encoder(
    models: dict[str, LoadedModel], references: dict[str, MultiVectorEncoder], name: str
) -> None:
    """Queries and documents in one mixed forward pass, each as encode_query /
    encode_document gives it: expanded to query_length, documents cut and skiplisted."""
    reference = references[name]
    queries, documents = run_all(
        models[name], [multi(QUERIES, "query"), multi(DOCUMENTS, "document")]
    )
    expected_q = reference.encode_query(QUERIES, convert_to_numpy=True)
    expected_d = reference.encode_document(DOCUMENTS, convert_to_numpy=True)
    for got, want in zip(matrices(queries), expected_q, strict=True):
        assert got.shape == (12, COLBERT_DIM)
        np.testing.assert_allclose(got, np.asarray(want), atol=ATOL)
    for got, want in zip(matrices(documents), expected_d, strict=True):
        assert got.shape == tuple(np.asarray(want).shape)
        np.testing.assert_allclose(got, np.asarray(want), atol=ATOL)
    assert matrices(documents)[2].shape[0] <= 20
    assert matrices(documents)[3].shape[0] == 3  # [CLS] [D] [SEP]: the dots are skipped
    # The marker is one token, right after [CLS].
    marker = models[name].tokenizer.tokenize(["x"] if name != "unused" else ["[unused1]x"])
    assert name != "unused" or len(marker[0]) == 4


def test_attention_to_expansion_tokens_matters(models: dict[str, LoadedModel]) -> None:
    """The two folders share weights; only attend_to_expansion_tokens differs."""
    (hidden,) = run_all(models["pylate"], [multi(["a"], "query")])
    (attended,) = run_all(models["attend"], [multi(["a"], "query")])
    assert not np.allclose(matrices(hidden)[0], matrices(attended)[0], atol=1e-3)


def test_no_mode_is_document_mode(models: dict[str, LoadedModel]) -> None:
    unnamed, document = run_all(
        models["pylate"], [multi(DOCUMENTS, None), multi(DOCUMENTS, "document")]
    )
    for a, b in zip(matrices(unnamed), matrices(document), strict=True):
        np.testing.assert_array_equal(a, b)


def maxsim_reference(query: np.ndarray, document: np.ndarray) -> float:
    """The documented formula, written out: for each query row, the best cosine."""
    q = torch.nn.functional.normalize(torch.as_tensor(np.asarray(query)), dim=-1)
    d = torch.nn.functional.normalize(torch.as_tensor(np.asarray(document)), dim=-1)
    return float(sum((q[i] @ d.T).max() for i in range(len(q))))


@pytest.mark.parametrize("name", ["pylate", "native"])
def test_score_and_rerank_are_maxsim(
    models: dict[str, LoadedModel], references: dict[str, MultiVectorEncoder], name: str
) -> None:
    model, reference = models[name], references[name]
    query = QUERIES[0]
    q = reference.encode_query([query], convert_to_numpy=True)
    d = reference.encode_document(DOCUMENTS, convert_to_numpy=True)
    expected = reference.similarity(q, d).numpy()[0]
    by_formula = [maxsim_reference(q[0], doc) for doc in d]
    np.testing.assert_allclose(expected, by_formula, atol=1e-4)
    score = PoolRequest(task=Task.SCORE, text_1=(query,), text_2=tuple(DOCUMENTS))
    (outputs,) = run_all(model, [score])
    got = [o.value for o in outputs if isinstance(o, Score)]
    np.testing.assert_allclose(got, expected, atol=1e-4)
    # Rerank computes the same 1:N score request.
    rerank = RerankRequest(query=query, documents=tuple(DOCUMENTS))
    limits = Limits()
    plan = plan_request(validate_rerank(rerank, model.info, limits), model, limits)
    raws = model.runner.forward([s for s, _ in plan.work], [k for _, k in plan.work])
    ranked = [o.value for o in plan.finish(raws) if isinstance(o, Score)]
    np.testing.assert_allclose(ranked, expected, atol=1e-4)


def decode(data: bytes, encoding: OutputEncoding) -> np.ndarray:
    """The wire bytes read back, as a client would."""
    if encoding is OutputEncoding.BFLOAT16:
        halves = np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16
        return halves.view(np.float32)
    dtype = "<f2" if encoding is OutputEncoding.FLOAT16 else "<f4"
    return np.frombuffer(data, dtype=dtype).astype(np.float32)


def test_encodings_pack_the_matrix(models: dict[str, LoadedModel]) -> None:
    model = models["pylate"]
    requests = [
        multi(DOCUMENTS[:2], "document", encoding=encoding)
        for encoding in (OutputEncoding.FLOAT32, OutputEncoding.FLOAT16, OutputEncoding.BFLOAT16)
    ]
    for request, outputs in zip(requests, run_all(model, requests), strict=True):
        for output in outputs:
            assert isinstance(output, MultiVector) and output.encoding is request.encoding
            rows = decode(output.data, request.encoding)
            tolerance = {"float32": 0, "float16": 1e-3, "bfloat16": 1e-2}[request.encoding.value]
            np.testing.assert_allclose(rows, output.values.ravel(), atol=tolerance)


def test_truncate_prompt_tokens_cuts_documents(models: dict[str, LoadedModel]) -> None:
    request = multi([DOCUMENTS[2]], "document", params=PoolingParams(truncate_prompt_tokens=8))
    (outputs,) = run_all(models["pylate"], [request])
    assert matrices(outputs)[0].shape[0] <= 8


def refusal(model: LoadedModel, request: PoolRequest) -> str:
    with pytest.raises(PoolingError) as caught:
        limits = Limits()
        plan_request(validate_request(request, model.info, limits), model, limits)
    return json.dumps([v.__dict__ for v in caught.value.violations])


@pytest.fixture(scope="module")
def minilm() -> LoadedModel:
    return load(MINILM)


def test_embed_multi_on_a_single_vector_model_is_refused(minilm: LoadedModel) -> None:
    message = refusal(minilm, multi(["x"], None))
    assert "TASK_NOT_SUPPORTED" in message and "embed_multi" in message
    assert minilm.info.name in message and "multi-vector" in message


def test_single_vector_tasks_on_colbert_are_refused(models: dict[str, LoadedModel]) -> None:
    model = models["pylate"]
    for task in (Task.EMBED, Task.TOKEN_EMBED):
        message = refusal(model, PoolRequest(task=task, texts=("x",)))
        assert "TASK_NOT_SUPPORTED" in message and "embed_multi" in message


def test_bad_requests_are_refused(models: dict[str, LoadedModel]) -> None:
    model = models["pylate"]
    assert "PROMPT_NAME_UNKNOWN" in refusal(model, multi(["x"], "passage"))
    assert "CALIBRATION_RANGES_MISSING" in refusal(
        model, multi(["x"], "query", encoding=OutputEncoding.INT8)
    )
    dims = multi(["x"], "query", params=PoolingParams(dimensions=4))
    assert "PARAM_NOT_SUPPORTED_FOR_TASK" in refusal(model, dims)
    score = PoolRequest(task=Task.SCORE, text_1=("q",), text_2=("d",), prompt="Instruct")
    assert "PROMPT_NOT_SUPPORTED_FOR_TASK" in refusal(model, score)


def test_exported_backends_are_refused(folders: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="multi-vector model runs on --backend torch"):
        load(folders["pylate"], backend=BackendOptions(kind=BackendKind.ONNX))


def test_a_token_projection_without_colbert_settings_is_refused(
    folders: dict[str, Path], tmp_path: Path
) -> None:
    """The generic reading leaves a Dense on token states to the family that reads it; a
    folder no family reads so is refused by name, not served as a plain encoder."""
    folder = tmp_path / "unsettled"
    shutil.copytree(folders["pylate"], folder)
    settings = folder / "config_sentence_transformers.json"
    config = json.loads(settings.read_text())
    for key in ("model_type", "query_prefix", "document_prefix", "query_length"):
        config.pop(key)
    config.pop("do_query_expansion")
    settings.write_text(json.dumps(config))
    with pytest.raises(ValueError, match="a Dense module before pooling is not supported"):
        load(folder)


def test_a_default_prompt_name_picks_the_default_mode(models: dict[str, LoadedModel]) -> None:
    """A folder whose default_prompt_name is "query" encodes unnamed texts as queries."""
    model = models["pylate"]
    querying = LoadedModel(
        dataclasses.replace(model.info, default_prompt_name="query"), model.tokenizer, model.runner
    )
    unnamed, named = run_all(querying, [multi(["a"], None), multi(["a"], "query")])
    np.testing.assert_array_equal(matrices(unnamed)[0], matrices(named)[0])
    assert matrices(unnamed)[0].shape[0] == 12
