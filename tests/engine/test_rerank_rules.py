"""Rerank in the engine, without a model: the ranking (order, ties, top_n) and the rules,
which are score's rules on the 1:N score request, with paths named as RerankRequest names
its fields."""

from __future__ import annotations

import pytest

from pooling_server.engine.errors import ErrorKind, FieldViolation, PoolingError
from pooling_server.engine.models.model_info import Activation, HeadKind, ModelInfo, PoolingType
from pooling_server.engine.requests.outputs import PoolResult, Score
from pooling_server.engine.requests.params import PoolingParams, Task
from pooling_server.engine.requests.request import RerankRequest
from pooling_server.engine.requests.resolved import Limits
from pooling_server.engine.requests.validation import rerank_error, validate_rerank
from pooling_server.engine.scheduling.engine import _ranking
from tests.model_infos import embedder_info

EMBEDDER = embedder_info(name="embedder", max_input_chars=20)
CLASSIFIER = ModelInfo(
    name="classifier",
    family="cross_encoder",
    architecture="BertForSequenceClassification",
    head=HeadKind.SEQUENCE,
    tasks=(Task.CLASSIFY,),
    hidden_size=32,
    max_input_tokens=128,
    num_special_tokens=2,
    pooling_type=PoolingType.CLS,
    default_normalize=False,
    activation=Activation.SOFTMAX,
)
LIMITS = Limits(max_client_batch_size=4, max_request_chars=50)


def ranked(scores: list[float], top_n: int = 0) -> list[tuple[int, float]]:
    request = RerankRequest("q", tuple(f"d{i}" for i in range(len(scores))), top_n=top_n)
    result = PoolResult("id", "m", Task.SCORE, 7, [Score(s) for s in scores])
    ranking = _ranking(request, result)
    assert (ranking.request_id, ranking.model, ranking.prompt_tokens) == ("id", "m", 7)
    return [(r.index, r.score) for r in ranking.ranking]


def test_ranking_is_by_decreasing_score_with_ties_in_input_order() -> None:
    scores = [0.25, 0.75, -0.5, 0.75, 0.0, 0.25]
    assert [i for i, _ in ranked(scores)] == [1, 3, 0, 5, 4, 2]
    assert [s for _, s in ranked(scores)] == sorted(scores, reverse=True)


@pytest.mark.parametrize(
    ("top_n", "expected"), [(0, [2, 0, 1]), (1, [2]), (2, [2, 0]), (9, [2, 0, 1])]
)
def test_top_n(top_n: int, expected: list[int]) -> None:
    assert [i for i, _ in ranked([0.5, 0.1, 0.9], top_n)] == expected


def test_nan_scores_rank_last() -> None:
    assert [i for i, _ in ranked([float("nan"), 0.1, 0.2])] == [2, 1, 0]


def rerank(
    query: str = "q",
    documents: tuple[str, ...] = ("a", "b"),
    info: ModelInfo = EMBEDDER,
    **fields: object,
) -> PoolingError:
    with pytest.raises(PoolingError) as caught:
        validate_rerank(RerankRequest(query, documents, **fields), info, LIMITS)  # type: ignore[arg-type]
    return caught.value


def paths(error: PoolingError) -> list[tuple[str, str]]:
    return [(v.field, v.reason) for v in error.violations]


def test_a_valid_request_passes() -> None:
    validate_rerank(RerankRequest("q", ("a", "b"), top_n=5), EMBEDDER, LIMITS)


@pytest.mark.parametrize(
    ("request_fields", "expected"),
    [
        ({"documents": ()}, [("documents", "EMPTY_INPUT")]),
        ({"documents": ("d",) * 5}, [("documents", "TOO_MANY_INPUTS")]),
        ({"top_n": -1}, [("top_n", "TOP_N_INVALID")]),
        ({"query": "q" * 21}, [("query", "INPUT_TOO_LONG")]),
        ({"documents": ("ok", "d" * 21)}, [("documents[1]", "INPUT_TOO_LONG")]),
        ({"documents": ("d" * 20,) * 3}, [("documents", "REQUEST_TOO_LARGE")]),
        ({"request_id": "r" * 257}, [("request_id", "REQUEST_ID_TOO_LONG")]),
        ({"declared_task": Task.EMBED}, [("params.task", "TASK_MISMATCH")]),
        (
            {"params": PoolingParams(dimensions=8)},
            [("params.dimensions", "PARAM_NOT_SUPPORTED_FOR_TASK")],
        ),
        (
            {"params": PoolingParams(truncate_prompt_tokens=1)},
            [("params.truncate_prompt_tokens", "TRUNCATE_PROMPT_TOKENS_INVALID")],
        ),
        (
            {"documents": (), "top_n": -2},
            [("top_n", "TOP_N_INVALID"), ("documents", "EMPTY_INPUT")],
        ),
    ],
)
def test_rules_with_rerank_paths(
    request_fields: dict[str, object], expected: list[tuple[str, str]]
) -> None:
    error = rerank(**request_fields)  # type: ignore[arg-type]
    assert error.kind is ErrorKind.INVALID_ARGUMENT
    assert paths(error) == expected
    assert "score." not in error.message


def test_a_model_without_score_names_the_model() -> None:
    error = rerank(info=CLASSIFIER)
    assert error.kind is ErrorKind.FAILED_PRECONDITION
    assert paths(error) == [("model", "TASK_NOT_SUPPORTED")]
    assert "rerank needs the score task" in error.message and "classify" in error.message


def test_plan_errors_are_renamed() -> None:
    """Token lengths are checked while planning the score request: its paths are renamed."""
    error = PoolingError.invalid(
        [
            FieldViolation("score.text_2[3]", "has 300 tokens", "INPUT_TOO_LONG"),
            FieldViolation("score.text_1[0]", "has 400 tokens", "INPUT_TOO_LONG"),
        ]
    )
    renamed = rerank_error(error)
    assert paths(renamed) == [("documents[3]", "INPUT_TOO_LONG"), ("query", "INPUT_TOO_LONG")]
    assert renamed.message == "documents[3]: has 300 tokens; query: has 400 tokens"
    late = PoolingError(ErrorKind.DEADLINE_EXCEEDED, "DEADLINE_EXCEEDED", "too late")
    assert rerank_error(late) is late
