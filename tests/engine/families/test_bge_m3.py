"""bge-m3 multi-output models on a tiny random-weight folder in bge-m3's layout (an
XLM-RoBERTa body, and a BERT one): dense, sparse (lexical weights) and multi (ColBERT)
outputs equal to the model card's formulas computed here straight from transformers'
output on the same folder; one forward pass for all three; the weighted score; mixed
batches with ordinary embed requests; every refusal."""

from __future__ import annotations

import json
import shutil
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

from pooling_server.engine.backends import BackendKind, BackendOptions
from pooling_server.engine.errors import PoolingError
from pooling_server.engine.families.bge_m3.multi_output import MultiOutputSettings
from pooling_server.engine.models.loader import LoadedModel
from pooling_server.engine.requests.outputs import (
    Embedding,
    MultiVector,
    Score,
    SparseEmbedding,
    TextOutputs,
)
from pooling_server.engine.requests.params import (
    Output,
    OutputEncoding,
    OutputWeights,
    PoolingParams,
    Task,
)
from pooling_server.engine.requests.plans import plan_request
from pooling_server.engine.requests.request import (
    ChunkRule,
    LateChunking,
    PoolRequest,
    RerankRequest,
)
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.requests.validation import validate_request, validate_rerank
from tests.bge_m3_reference import Reference, expected_score
from tests.engine.planned import load, run_all
from tests.fixture_models import BGE_M3_COLBERT_DIM, tiny_bge_m3, tiny_colbert, tiny_mean_bert

ATOL = 1e-5
TEXTS = [
    "what is the capital of france? the capital, the capital!",
    "a",
    "BGE M3 gives dense, sparse and multi-vector outputs from one pass " * 2,
]
ALL = frozenset(Output)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("bge_m3")
    return {
        "xlm-roberta": tiny_bge_m3(root / "xlm-roberta"),
        "bert": tiny_bge_m3(root / "bert", body="bert"),
        "plain": tiny_mean_bert(root / "plain"),
    }


@pytest.fixture(scope="module")
def models(folders: dict[str, Path]) -> dict[str, LoadedModel]:
    return {name: load(folder) for name, folder in folders.items()}


@pytest.fixture(scope="module")
def references(folders: dict[str, Path]) -> dict[str, Reference]:
    return {name: Reference(folders[name]) for name in ("xlm-roberta", "bert")}


def outputs(texts: Sequence[str], wanted: frozenset[Output] = ALL, **fields: object) -> PoolRequest:
    return PoolRequest(
        task=Task.EMBED_OUTPUTS,
        texts=tuple(texts),
        outputs=wanted,
        **fields,  # type: ignore[arg-type]
    )


def as_dict(sparse: SparseEmbedding) -> dict[int, float]:
    return dict(zip(sparse.indices.tolist(), sparse.values.tolist(), strict=True))


def check_sparse(got: SparseEmbedding, expected: dict[int, float]) -> None:
    assert sorted(as_dict(got)) == sorted(expected)
    for token, weight in as_dict(got).items():
        assert weight == pytest.approx(expected[token], abs=ATOL)
    assert list(got.values) == sorted(got.values, reverse=True)  # by decreasing weight


BODIES = ["xlm-roberta", "bert"]


@pytest.mark.parametrize("name", BODIES)
def test_loads_as_a_multi_output_model(models: dict[str, LoadedModel], name: str) -> None:
    info = models[name].info
    assert info.tasks == (
        Task.EMBED,
        Task.EMBED_SPARSE,
        Task.EMBED_MULTI,
        Task.EMBED_OUTPUTS,
        Task.SCORE,
    )
    assert info.outputs == ("dense", "sparse", "multi")
    assert info.family == "bge_m3" and isinstance(info.settings, MultiOutputSettings)
    assert (info.settings.hidden, info.settings.multi_width) == (32, BGE_M3_COLBERT_DIM)
    assert info.hidden_size == 32 and info.backend == "torch"
    assert models["plain"].info.outputs == () and models["plain"].info.family == "encoder"


@pytest.mark.parametrize("name", BODIES)
def test_the_three_outputs_equal_the_model_card_formulas(
    models: dict[str, LoadedModel], references: dict[str, Reference], name: str
) -> None:
    (got,) = run_all(models[name], [outputs(TEXTS)])
    expected = references[name].encode(TEXTS)
    for output, reference in zip(got, expected, strict=True):
        assert isinstance(output, TextOutputs)
        assert output.dense is not None and output.sparse is not None and output.multi is not None
        np.testing.assert_allclose(output.dense.values, reference["dense"], atol=ATOL)
        check_sparse(output.sparse, reference["sparse"])  # type: ignore[arg-type]
        np.testing.assert_allclose(output.multi.values, reference["multi"], atol=ATOL)
    # The repeated words of the first text keep their largest weight, once.
    assert len(got[0].sparse.indices) == len(set(got[0].sparse.indices.tolist()))  # type: ignore[union-attr]


@pytest.mark.parametrize("name", BODIES)
def test_single_output_tasks_equal_embed_outputs(
    models: dict[str, LoadedModel], references: dict[str, Reference], name: str
) -> None:
    """embed, embed_sparse and embed_multi on such a model give its dense vector, lexical
    weights and ColBERT matrix, in one mixed batch."""
    expected = references[name].encode(TEXTS)
    dense, sparse, multi = run_all(
        models[name],
        [PoolRequest(task=task, texts=tuple(TEXTS)) for task in _OUTPUT_TASKS],
    )
    for i, reference in enumerate(expected):
        assert isinstance(dense[i], Embedding) and isinstance(sparse[i], SparseEmbedding)
        assert isinstance(multi[i], MultiVector)
        np.testing.assert_allclose(dense[i].values, reference["dense"], atol=ATOL)  # type: ignore[union-attr]
        check_sparse(sparse[i], reference["sparse"])  # type: ignore[arg-type]
        np.testing.assert_allclose(multi[i].values, reference["multi"], atol=ATOL)  # type: ignore[union-attr]


_OUTPUT_TASKS = (Task.EMBED, Task.EMBED_SPARSE, Task.EMBED_MULTI)


def test_one_forward_pass_gives_all_three(models: dict[str, LoadedModel]) -> None:
    model = models["xlm-roberta"]
    module = model.runner.module
    assert module is not None
    calls: list[int] = []
    hook = module.body.register_forward_hook(lambda *_: calls.append(1))
    try:
        (got,) = run_all(model, [outputs(TEXTS)])
    finally:
        hook.remove()
    assert len(calls) == 1
    assert all(o.dense is not None and o.sparse and o.multi for o in got)  # type: ignore[union-attr]


def test_only_the_asked_outputs_are_set(models: dict[str, LoadedModel]) -> None:
    model = models["xlm-roberta"]
    cases = [frozenset({Output.DENSE}), frozenset({Output.SPARSE, Output.MULTI})]
    dense_only, token_outputs = run_all(model, [outputs(TEXTS, wanted) for wanted in cases])
    for o in dense_only:
        assert isinstance(o, TextOutputs) and o.sparse is None and o.multi is None
        assert o.dense is not None
    for o in token_outputs:
        assert isinstance(o, TextOutputs) and o.dense is None
        assert o.sparse is not None and o.multi is not None


def test_dense_alone_ships_one_row_per_text(models: dict[str, LoadedModel]) -> None:
    """Dense-only work pools on the engine side (no token rows come back); token rows are
    as wide as the widest output, not all three side by side."""
    model, limits = models["xlm-roberta"], Limits()
    for request in (
        PoolRequest(task=Task.EMBED, texts=tuple(TEXTS)),
        outputs(TEXTS, frozenset({Output.DENSE})),
    ):
        plan = plan_request(validate_request(request, model.info, limits), model, limits)
        assert not any(keep for _, keep in plan.work)
    plan = plan_request(validate_request(outputs(TEXTS), model.info, limits), model, limits)
    assert all(keep for _, keep in plan.work)
    # Token rows hold the dense vector (row 0) or weight and ColBERT vector (the others):
    # max(32, 1 + 24) values, not 32 + 1 + 24.
    raws = model.runner.forward([s for s, _ in plan.work], [k for _, k in plan.work])
    assert [raw.shape for raw in raws] == [(len(s), 32) for s, _ in plan.work]


def test_use_activation_false_leaves_dense_unnormalised(
    models: dict[str, LoadedModel], references: dict[str, Reference]
) -> None:
    params = PoolingParams(use_activation=False)
    embed, both = run_all(
        models["xlm-roberta"],
        [
            PoolRequest(task=Task.EMBED, texts=tuple(TEXTS), params=params),
            outputs(TEXTS, frozenset({Output.DENSE, Output.MULTI}), params=params),
        ],
    )
    for i, reference in enumerate(references["xlm-roberta"].encode(TEXTS)):
        np.testing.assert_allclose(embed[i].values, reference["raw_dense"], atol=ATOL)  # type: ignore[union-attr]
        np.testing.assert_allclose(both[i].dense.values, reference["raw_dense"], atol=ATOL)  # type: ignore[union-attr]
        np.testing.assert_allclose(both[i].multi.values, reference["multi"], atol=ATOL)  # type: ignore[union-attr]


def test_sparse_top_k_and_tokens(models: dict[str, LoadedModel]) -> None:
    model = models["xlm-roberta"]
    full, top = run_all(
        model,
        [
            outputs(TEXTS[:1], frozenset({Output.SPARSE})),
            outputs(TEXTS[:1], frozenset({Output.SPARSE}), sparse_top_k=3, sparse_tokens=True),
        ],
    )
    whole, cut = full[0].sparse, top[0].sparse  # type: ignore[union-attr]
    assert whole is not None and cut is not None and len(whole.indices) > 3
    np.testing.assert_array_equal(cut.indices, whole.indices[:3])
    assert cut.tokens == model.tokenizer.tokens(cut.indices.tolist()) and not whole.tokens


def test_encodings_pack_dense_and_matrix(models: dict[str, LoadedModel]) -> None:
    model = models["xlm-roberta"]
    (got,) = run_all(model, [outputs(TEXTS, encoding=OutputEncoding.FLOAT16)])
    for o in got:
        assert isinstance(o, TextOutputs) and o.dense is not None and o.multi is not None
        assert o.multi.encoding is OutputEncoding.FLOAT16
        rows = np.frombuffer(o.multi.data, dtype="<f2").astype(np.float32)
        np.testing.assert_allclose(rows, o.multi.values.ravel(), atol=1e-3)
        dense = np.frombuffer(o.dense.data, dtype="<f2").astype(np.float32)
        np.testing.assert_allclose(dense, o.dense.values, atol=1e-3)


WEIGHTS = [None, OutputWeights(0.4, 0.2, 0.4), OutputWeights(0, 1, 0), OutputWeights(0, 0, 2)]


@pytest.mark.parametrize("weights", WEIGHTS)
def test_score_combines_the_weighted_outputs(
    models: dict[str, LoadedModel],
    references: dict[str, Reference],
    weights: OutputWeights | None,
) -> None:
    query, documents = "the capital of france", [TEXTS[0], "paris is the capital", "zebra"]
    request = PoolRequest(
        task=Task.SCORE,
        text_1=(query,),
        text_2=tuple(documents),
        params=PoolingParams(output_weights=weights),
    )
    (scores,) = run_all(models["xlm-roberta"], [request])
    q, *ds = references["xlm-roberta"].encode([query, *documents])
    for score, d in zip(scores, ds, strict=True):
        assert isinstance(score, Score)
        assert score.value == pytest.approx(expected_score(q, d, weights), abs=ATOL)


def test_rerank_carries_the_weights(models: dict[str, LoadedModel]) -> None:
    model, limits = models["xlm-roberta"], Limits()
    weights = OutputWeights(1, 1, 1)
    rerank = RerankRequest(
        query="capital", documents=(TEXTS[0], "a"), params=PoolingParams(output_weights=weights)
    )
    resolved = validate_rerank(rerank, model.info, limits)
    assert resolved.request.params.output_weights == weights
    plan = plan_request(resolved, model, limits)
    assert all(keep for _, keep in plan.work)  # sparse and multi need the token rows


def test_mixed_batch_with_ordinary_embed_requests(
    models: dict[str, LoadedModel], references: dict[str, Reference]
) -> None:
    """Dense-only embed (pooled rows) beside embed_outputs and a weighted score (token rows)
    in one forward pass: each as it is alone."""
    model = models["xlm-roberta"]
    weights = OutputWeights(1, 0.5, 0.5)
    requests = [
        PoolRequest(task=Task.EMBED, texts=(TEXTS[1],)),
        outputs(TEXTS),
        PoolRequest(task=Task.EMBED, texts=tuple(TEXTS[:2])),
        PoolRequest(
            task=Task.SCORE,
            text_1=(TEXTS[1],),
            text_2=(TEXTS[0],),
            params=PoolingParams(output_weights=weights),
        ),
    ]
    mixed = run_all(model, requests)
    alone = [run_all(model, [request])[0] for request in requests]
    expected = references["xlm-roberta"].encode(TEXTS)
    for together, single in zip(mixed, alone, strict=True):
        for a, b in zip(together, single, strict=True):
            if isinstance(a, Score):
                assert a.value == pytest.approx(b.value, abs=ATOL)  # type: ignore[union-attr]
            elif isinstance(a, Embedding):
                np.testing.assert_allclose(a.values, b.values, atol=ATOL)  # type: ignore[union-attr]
    np.testing.assert_allclose(mixed[0][0].values, expected[1]["dense"], atol=ATOL)  # type: ignore[union-attr]
    np.testing.assert_allclose(mixed[1][2].multi.values, expected[2]["multi"], atol=ATOL)  # type: ignore[union-attr]


def refusal(model: LoadedModel, request: PoolRequest) -> tuple[str, str]:
    """(kind, the violations as JSON) of the refusal."""
    with pytest.raises(PoolingError) as caught:
        limits = Limits()
        plan_request(validate_request(request, model.info, limits), model, limits)
    return str(caught.value.kind), json.dumps([v.__dict__ for v in caught.value.violations])


def weighted(weights: OutputWeights, task: Task = Task.SCORE) -> PoolRequest:
    params = PoolingParams(output_weights=weights)
    if task is Task.SCORE:
        return PoolRequest(task=task, text_1=("q",), text_2=("d",), params=params)
    return PoolRequest(task=task, texts=("q",), params=params)


def test_refusals(models: dict[str, LoadedModel]) -> None:
    model, plain = models["xlm-roberta"], models["plain"]
    kind, message = refusal(model, outputs(["x"], frozenset()))
    assert "OUTPUTS_NONE" in message and '"embed_outputs"' in message and kind == "INVALID_ARGUMENT"
    kind, message = refusal(plain, outputs(["x"]))
    assert "TASK_NOT_SUPPORTED" in message and kind == "FAILED_PRECONDITION"
    assert "sparse_linear.pt" in message and plain.info.name in message
    kind, message = refusal(plain, weighted(OutputWeights(1, 1, 1)))
    assert "OUTPUT_WEIGHTS_NOT_SUPPORTED" in message and "params.output_weights" in message
    assert kind == "FAILED_PRECONDITION" and plain.info.name in message
    for bad in (OutputWeights(1, -1, 0), OutputWeights(0, 0, 0), OutputWeights(float("nan"), 1, 1)):
        kind, message = refusal(model, weighted(bad))
        assert "OUTPUT_WEIGHTS_INVALID" in message and "params.output_weights" in message
    _, message = refusal(model, weighted(OutputWeights(1, 0, 0), Task.EMBED))
    assert "PARAM_NOT_SUPPORTED_FOR_TASK" in message and "params.output_weights" in message
    _, message = refusal(model, outputs(["x"], sparse_top_k=-1))
    assert "TOP_K_INVALID" in message and "embed_outputs.sparse_top_k" in message
    unsaturated = PoolRequest(
        task=Task.EMBED_SPARSE, texts=("x",), params=PoolingParams(use_activation=False)
    )
    assert "USE_ACTIVATION_NOT_SUPPORTED" in refusal(model, unsaturated)[1]
    assert "TASK_NOT_SUPPORTED" in refusal(model, PoolRequest(Task.TOKEN_EMBED, texts=("x",)))[1]
    chunked = PoolRequest(
        task=Task.EMBED, texts=("x y",), late_chunking=LateChunking(rule=ChunkRule.SENTENCES)
    )
    assert "LATE_CHUNKING_POOLING" in refusal(model, chunked)[1]
    assert (
        "CALIBRATION_RANGES_MISSING"
        in refusal(model, outputs(["x"], encoding=OutputEncoding.INT8))[1]
    )
    assert "INPUT_TOO_LONG" in refusal(model, outputs(["word " * 400]))[1]
    # bge-m3 has no query/document modes: those names are unknown prompts on embed_multi.
    query = PoolRequest(task=Task.EMBED_MULTI, texts=("x",), prompt_name="query")
    assert "PROMPT_NAME_UNKNOWN" in refusal(model, query)[1]


def test_refused_at_load(folders: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="multi-output \\(bge-m3\\) model runs on --backend torch"):
        load(folders["xlm-roberta"], backend=BackendOptions(kind=BackendKind.ONNX))
    half = tiny_bge_m3(tmp_path / "half")
    (half / "colbert_linear.pt").unlink()
    with pytest.raises(ValueError, match=r"colbert_linear\.pt is missing"):
        load(half)
    # bge-m3's heads beside a ColBERT layout: neither family guesses which was meant.
    both = tiny_colbert(tmp_path / "both")
    for name in ("sparse_linear.pt", "colbert_linear.pt"):
        shutil.copyfile(folders["xlm-roberta"] / name, both / name)
    with pytest.raises(ValueError, match="without ColBERT settings or Dense modules"):
        load(both)
