"""client.rerank on the sync and async Python clients: against the real server (rankings
agree with the client's own score() results), and request building and response checks
without one."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from pooling_client import (
    AsyncPoolingClient,
    PoolingClient,
    PoolingError,
    PoolingParams,
    RerankOutput,
    RerankRequestOutput,
    Usage,
    _requests,
    outputs,
)
from pooling_client.v1 import pooling_pb2
from tests.server_process import ServerProcess

QUERY = "what is the capital of france?"
DOCUMENTS = [
    "Berlin is a city in Germany.",
    "Paris is the capital of France.",
    "Cooking pasta al dente takes ten minutes.",
    "France's capital is Paris, on the Seine.",
    "",
]
MODELS = ["tiny-cross-encoder", "tiny-st-mean"]


ATOL = 5e-7  # the tiny cross-encoder's scores lie near 0.5, the closest two 1.2e-6 apart


def expected_order(client: PoolingClient, model: str) -> tuple[list[int], list[float]]:
    """Document indices by decreasing score() result (ties in document order), and the
    scores."""
    scores = [o.outputs.score for o in client.score(QUERY, DOCUMENTS, model=model)]
    return sorted(range(len(scores)), key=lambda i: (-scores[i], i)), scores


def check(
    result: RerankRequestOutput, order: list[int], scores: list[float], top_n: int | None
) -> None:
    """The ranking is score()'s order, but for documents whose scores differ by float noise,
    which may swap: every result has its score() score, in order, and nothing left out
    scores above the last one kept."""
    count = min(top_n, len(DOCUMENTS)) if top_n else len(DOCUMENTS)
    assert len(result) == count and result[0] is result.results[0]
    got = [r.relevance_score for r in result]
    assert [(-s, r.index) for s, r in zip(got, result, strict=True)] == sorted(
        (-s, r.index) for s, r in zip(got, result, strict=True)
    )
    for r, expected in zip(result, order, strict=False):
        assert r.relevance_score == pytest.approx(scores[r.index], abs=ATOL)
        assert scores[r.index] == pytest.approx(scores[expected], abs=ATOL)
    left_out = set(range(len(DOCUMENTS))) - {r.index for r in result}
    assert all(scores[i] <= got[-1] + ATOL for i in left_out)
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("top_n", [None, 0, 2, 99])
def test_sync_rerank(client: PoolingClient, model: str, top_n: int | None) -> None:
    order, scores = expected_order(client, model)
    result = client.rerank(QUERY, DOCUMENTS, top_n=top_n, model=model, request_id="sync")
    assert isinstance(result, RerankRequestOutput)
    assert (result.request_id, result.model) == ("sync", model)
    check(result, order, scores, top_n)
    assert all(r.document is None for r in result)


@pytest.mark.parametrize("model", MODELS)
def test_async_rerank(server: ServerProcess, client: PoolingClient, model: str) -> None:
    order, scores = expected_order(client, model)

    async def run() -> RerankRequestOutput:
        async with AsyncPoolingClient(server.address, timeout=60, model=model) as aclient:
            return await aclient.rerank(QUERY, DOCUMENTS, top_n=3, return_documents=True)

    result = asyncio.run(run())
    check(result, order, scores, 3)
    assert result.model == model
    assert [r.document for r in result] == [DOCUMENTS[r.index] for r in result]


def test_return_documents(client: PoolingClient) -> None:
    result = client.rerank(QUERY, DOCUMENTS, return_documents=True, model="tiny-cross-encoder")
    assert [r.document for r in result] == [DOCUMENTS[r.index] for r in result]


def test_params_as_for_score(client: PoolingClient) -> None:
    raw = PoolingParams(use_activation=False)
    model = "tiny-cross-encoder"
    expected = [
        o.outputs.score for o in client.score(QUERY, DOCUMENTS, pooling_params=raw, model=model)
    ]
    result = client.rerank(QUERY, DOCUMENTS, pooling_params=raw, model=model)
    for r in result:
        assert r.relevance_score == pytest.approx(expected[r.index], abs=ATOL)
    truncated = client.rerank(QUERY, ["word " * 300], truncate_prompt_tokens=-1, model=model)
    assert truncated.usage.prompt_tokens == 128


def test_server_errors_carry_reason_and_field(client: PoolingClient) -> None:
    with pytest.raises(PoolingError) as caught:
        client.rerank(QUERY, [], model="tiny-cross-encoder")
    assert caught.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.reason == "EMPTY_INPUT"
    assert [v.field for v in caught.value.field_violations] == ["documents"]
    with pytest.raises(PoolingError) as caught:
        client.rerank(QUERY, DOCUMENTS, model="tiny-classifier")
    assert (caught.value.code, caught.value.reason) == (
        grpc.StatusCode.FAILED_PRECONDITION,
        "TASK_NOT_SUPPORTED",
    )


def test_async_server_errors(server: ServerProcess) -> None:
    async def run() -> None:
        async with AsyncPoolingClient(server.address, timeout=60) as aclient:
            await aclient.rerank(QUERY, DOCUMENTS, model="no-such-model")

    with pytest.raises(PoolingError) as caught:
        asyncio.run(run())
    assert (caught.value.code, caught.value.reason) == (
        grpc.StatusCode.NOT_FOUND,
        "MODEL_NOT_FOUND",
    )


# ---------------------------------------------------------------------------------------------
# Without a server
# ---------------------------------------------------------------------------------------------


def test_request_building() -> None:
    request = _requests.rerank_request(
        QUERY,
        DOCUMENTS,
        top_n=2,
        return_documents=True,
        pooling_params=PoolingParams(use_activation=False),
        truncate_prompt_tokens=16,
        model="m",
        request_id="r",
    )
    assert (request.request_id, request.model, request.query) == ("r", "m", QUERY)
    assert list(request.documents) == DOCUMENTS
    assert (request.top_n, request.return_documents) == (2, True)
    assert request.params.use_activation is False
    assert request.params.truncate_prompt_tokens == 16
    assert request.params.task == pooling_pb2.POOLING_TASK_SCORE
    defaults = _requests.rerank_request(QUERY, "one document")
    assert list(defaults.documents) == ["one document"]
    assert (defaults.top_n, defaults.return_documents, defaults.model) == (0, False, "")
    assert defaults.request_id


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"top_n": -1}, ValueError),
        ({"top_n": 1.5}, TypeError),
        ({"top_n": True}, TypeError),
        ({"pooling_params": PoolingParams(dimensions=8)}, ValueError),
        ({"pooling_params": PoolingParams(task="embed")}, ValueError),
        ({"documents": ["ok", 3]}, TypeError),
        ({"query": ["not", "a", "str"]}, TypeError),
    ],
)
def test_obvious_mistakes_fail_before_sending(kwargs: dict[str, object], error: type) -> None:
    arguments: dict[str, object] = {"query": QUERY, "documents": DOCUMENTS, **kwargs}
    query, documents = arguments.pop("query"), arguments.pop("documents")
    with pytest.raises(error):
        _requests.rerank_request(query, documents, **arguments)  # type: ignore[arg-type]


def response(*indices: int, document: str | None = None) -> pooling_pb2.RerankResponse:
    message = pooling_pb2.RerankResponse(
        request_id="r", model="m", usage=pooling_pb2.Usage(prompt_tokens=9, total_tokens=9)
    )
    for k, i in enumerate(indices):
        item = message.results.add(index=i, relevance_score=1.0 - k / 10)
        if document is not None:
            item.document = document
    return message


def test_response_conversion() -> None:
    result = outputs.rerank_request_output(response(2, 0, document=""), 3, 2)
    assert result == RerankRequestOutput(
        "r",
        "m",
        [RerankOutput(2, 1.0, ""), RerankOutput(0, pytest.approx(0.9), "")],  # type: ignore[arg-type]
        Usage(9, 9),
    )
    assert [r.document for r in outputs.rerank_request_output(response(1, 0), 2, 0)] == [None] * 2


@pytest.mark.parametrize(
    ("indices", "documents", "top_n"),
    [((0,), 2, 0), ((0, 0), 2, 0), ((0, 2), 2, 0), ((0, 1), 3, 1), ((-1,), 1, 0)],
)
def test_responses_that_do_not_answer_the_request(
    indices: tuple[int, ...], documents: int, top_n: int
) -> None:
    with pytest.raises(ValueError, match="does not rank"):
        outputs.rerank_request_output(response(*indices), documents, top_n)
