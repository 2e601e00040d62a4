"""Unit tests for the pooling_client package: no model and no real pooling server needed.

The in-process gRPC tests use a tiny fake servicer, so they check the client's wire behaviour
(request shape, metadata, rich error decoding) rather than any pooling maths.
"""

from __future__ import annotations

import asyncio
import json
import pickle
import threading
import time
from collections.abc import Iterator
from typing import Any

import grpc
import numpy as np
import pytest
from google.protobuf import any_pb2, duration_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2

from pooling_client import (
    AsyncPoolingClient,
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    FieldViolation,
    ModelInfo,
    PoolingClient,
    PoolingError,
    PoolingParams,
    PoolingRequestOutput,
    ScoringRequestOutput,
    _channel,
    _requests,
    outputs,
)
from pooling_client.v1 import pooling_pb2, pooling_pb2_grpc
from tests.client.in_process import serve_in_process

# ---------------------------------------------------------------------------------------------
# PoolingParams
# ---------------------------------------------------------------------------------------------

ALLOWED = {
    "embed": {"use_activation", "dimensions", "truncate_prompt_tokens"},
    "token_embed": {"use_activation", "dimensions", "truncate_prompt_tokens"},
    "classify": {"use_activation", "truncate_prompt_tokens"},
    "score": {"use_activation", "truncate_prompt_tokens"},
    "token_classify": {"use_activation", "truncate_prompt_tokens"},
}
VALUES: dict[str, Any] = {"use_activation": False, "dimensions": 8, "truncate_prompt_tokens": 16}


@pytest.mark.parametrize("task", sorted(ALLOWED))
@pytest.mark.parametrize("name", sorted(VALUES))
def test_verify_follows_task_table(task: str, name: str) -> None:
    params = PoolingParams(**{name: VALUES[name]})
    if name in ALLOWED[task]:
        params.verify(task)
    else:
        with pytest.raises(ValueError, match=name):
            params.verify(task)


def test_verify_rejects_task_mismatch_and_unknown_tasks() -> None:
    PoolingParams(task="embed").verify("embed")
    with pytest.raises(ValueError, match="overwrite"):
        PoolingParams(task="classify").verify("embed")
    with pytest.raises(ValueError, match="Unknown pooling task"):
        PoolingParams().verify("generate")
    with pytest.raises(ValueError, match="Unknown pooling task"):
        PoolingParams(task="reward").verify("embed")


@pytest.mark.parametrize(
    ("params", "ok"),
    [
        (PoolingParams(dimensions=1), True),
        (PoolingParams(dimensions=0), False),
        (PoolingParams(dimensions=-3), False),
        (PoolingParams(truncate_prompt_tokens=-1), True),
        (PoolingParams(truncate_prompt_tokens=1), True),
        (PoolingParams(truncate_prompt_tokens=0), False),
        (PoolingParams(truncate_prompt_tokens=-2), False),
    ],
)
def test_verify_checks_ranges(params: PoolingParams, ok: bool) -> None:
    if ok:
        params.verify("embed")
    else:
        with pytest.raises(ValueError):
            params.verify("embed")


def test_verify_does_not_mutate_params() -> None:
    params = PoolingParams(use_activation=True)
    params.verify("embed")
    params.verify("classify")
    assert params.task is None


def test_to_proto_sets_only_given_fields() -> None:
    message = PoolingParams(dimensions=32, truncate_prompt_tokens=-1).to_proto("embed")
    assert message.task == pooling_pb2.POOLING_TASK_EMBED
    assert message.dimensions == 32
    assert message.truncate_prompt_tokens == -1
    assert not message.HasField("use_activation")

    message = PoolingParams(use_activation=False).to_proto("token_classify")
    assert message.task == pooling_pb2.POOLING_TASK_TOKEN_CLASSIFY
    assert message.HasField("use_activation")
    assert message.use_activation is False
    assert not message.HasField("dimensions")
    assert not message.HasField("truncate_prompt_tokens")


def test_to_proto_keeps_own_task_and_rejects_unknown() -> None:
    message = PoolingParams(task="score").to_proto("score")
    assert message.task == pooling_pb2.POOLING_TASK_SCORE
    with pytest.raises(ValueError):
        PoolingParams().to_proto("nope")


def test_truncate_kwarg_merges_into_params_and_is_verified() -> None:
    base = PoolingParams(use_activation=True, truncate_prompt_tokens=4)
    merged = _requests.resolve_params("classify", base, 10)
    assert merged.truncate_prompt_tokens == 10
    assert merged.use_activation is True
    assert base.truncate_prompt_tokens == 4  # the caller's object is untouched
    with pytest.raises(ValueError):
        _requests.resolve_params("embed", None, 0)
    with pytest.raises(ValueError, match="dimensions"):
        _requests.resolve_params("classify", PoolingParams(dimensions=4), None)


# ---------------------------------------------------------------------------------------------
# Request building
# ---------------------------------------------------------------------------------------------


def test_score_splits_sep_strings() -> None:
    text_1, text_2 = _requests.score_texts(
        ["what is a cat? [SEP] A small feline.", "a[SEP]b"], None
    )
    assert text_1 == ["what is a cat?", "a"]
    assert text_2 == ["A small feline.", "b"]
    # Only the first [SEP] splits.
    assert _requests.split_sep("q [SEP] d [SEP] e") == ("q", "d [SEP] e")


def test_score_accepts_tuples_and_lists() -> None:
    text_1, text_2 = _requests.score_texts([("q1", "d1"), ["q2", "d2"]], None)
    assert (text_1, text_2) == (["q1", "q2"], ["d1", "d2"])


def test_score_forwards_1_to_n_and_n_to_n() -> None:
    assert _requests.score_texts("q", ["d1", "d2"]) == (["q"], ["d1", "d2"])
    assert _requests.score_texts(["q1", "q2"], ["d1", "d2"]) == (["q1", "q2"], ["d1", "d2"])
    assert _requests.score_texts("q", "d") == (["q"], ["d"])


def test_score_input_errors() -> None:
    with pytest.raises(ValueError, match=r"\[SEP\]"):
        _requests.score_texts(["no separator here"], None)
    with pytest.raises(ValueError, match="pair"):
        _requests.score_texts([("a", "b", "c")], None)
    with pytest.raises(TypeError):
        _requests.score_texts([42], None)
    with pytest.raises(TypeError):
        _requests.score_texts(["q"], [1, 2])


def test_pool_request_uses_task_input_case() -> None:
    for task in ("embed", "classify", "token_embed", "token_classify"):
        request = _requests.pool_request(task, ["a", "b"], model="m", request_id="r")
        assert request.WhichOneof("input") == task
        assert list(getattr(request, task).texts) == ["a", "b"]
        assert request.params.task == PoolingParams().to_proto(task).task
        assert (request.model, request.request_id) == ("m", "r")

    request = _requests.pool_request("score", (["q"], ["d1", "d2"]), truncate_prompt_tokens=-1)
    assert request.WhichOneof("input") == "score"
    assert list(request.score.text_1) == ["q"]
    assert list(request.score.text_2) == ["d1", "d2"]
    assert request.params.truncate_prompt_tokens == -1
    assert request.model == ""
    assert request.request_id  # generated
    assert _requests.expected_outputs(request) == 2


def test_prompts_must_be_strings() -> None:
    assert _requests.as_texts("one") == ["one"]
    with pytest.raises(TypeError, match=r"prompts\[1\]"):
        _requests.as_texts(["ok", b"bytes"])  # type: ignore[list-item]


def test_encode_task_check() -> None:
    for task in ("token_embed", "token_classify", "embed", "classify"):
        _requests.check_encode_task(task)
    for task in ("score", "generate"):
        with pytest.raises(ValueError):
            _requests.check_encode_task(task)


# ---------------------------------------------------------------------------------------------
# PoolingError
# ---------------------------------------------------------------------------------------------


def _packed(message: Any) -> any_pb2.Any:
    packed = any_pb2.Any()
    packed.Pack(message)
    return packed


def _rich_status() -> status_pb2.Status:
    info = error_details_pb2.ErrorInfo(
        reason="DIMENSIONS_NOT_SUPPORTED", domain="pooling.v1", metadata={"model": "mini"}
    )
    bad = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(
                field="params.dimensions", description="model is not matryoshka", reason="BAD_DIM"
            )
        ]
    )
    retry = error_details_pb2.RetryInfo(
        retry_delay=duration_pb2.Duration(seconds=1, nanos=500_000_000)
    )
    return status_pb2.Status(
        code=code_pb2.INVALID_ARGUMENT,
        message="dimensions not supported",
        details=[_packed(info), _packed(bad), _packed(retry)],
    )


def test_from_status_decodes_details() -> None:
    error = PoolingError.from_status(_rich_status())
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == "dimensions not supported"
    assert error.reason == "DIMENSIONS_NOT_SUPPORTED"
    assert error.domain == "pooling.v1"
    assert error.metadata == {"model": "mini"}
    assert error.field_violations == [
        FieldViolation("params.dimensions", "model is not matryoshka", "BAD_DIM")
    ]
    assert error.retry_delay == pytest.approx(1.5)
    text = str(error)
    assert "INVALID_ARGUMENT" in text
    assert "DIMENSIONS_NOT_SUPPORTED" in text
    assert "params.dimensions" in text


def test_from_status_without_details() -> None:
    error = PoolingError.from_status(status_pb2.Status(code=code_pb2.UNAVAILABLE, message="down"))
    assert error.code is grpc.StatusCode.UNAVAILABLE
    assert (error.reason, error.domain, error.retry_delay) == (None, None, None)
    assert error.field_violations == []
    assert str(error) == "UNAVAILABLE: down"


def test_pooling_error_pickles() -> None:
    error = pickle.loads(pickle.dumps(PoolingError.from_status(_rich_status())))
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == "DIMENSIONS_NOT_SUPPORTED"
    assert error.field_violations[0].field == "params.dimensions"


# ---------------------------------------------------------------------------------------------
# Response conversion
# ---------------------------------------------------------------------------------------------


def test_embed_response_conversion() -> None:
    response = pooling_pb2.PoolResponse(
        request_id="r",
        embed=pooling_pb2.EmbedOutput(
            embeddings=[
                pooling_pb2.Embedding(values=[0.5, 0.25]),
                pooling_pb2.Embedding(values=[1]),
            ]
        ),
    )
    result = outputs.embedding_request_outputs(response)
    assert [type(r) for r in result] == [EmbeddingRequestOutput] * 2
    assert [r.request_id for r in result] == ["r-0", "r-1"]
    assert result[0].outputs.embedding == [0.5, 0.25]
    assert result[0].outputs.hidden_size == 2
    assert result[1].outputs.embedding == [1.0]


def test_classify_response_conversion() -> None:
    response = pooling_pb2.PoolResponse(
        request_id="c",
        classify=pooling_pb2.ClassifyOutput(
            classifications=[
                pooling_pb2.Classification(probs=[0.25, 0.75], label_id=1, label="POSITIVE")
            ]
        ),
    )
    (result,) = outputs.classification_request_outputs(response)
    assert isinstance(result, ClassificationRequestOutput)
    assert result.request_id == "c-0"
    assert result.outputs.probs == [0.25, 0.75]
    assert (result.outputs.label_id, result.outputs.label) == (1, "POSITIVE")
    assert result.outputs.num_classes == 2


def test_score_response_conversion() -> None:
    response = pooling_pb2.PoolResponse(
        request_id="s", score=pooling_pb2.ScoreOutput(scores=[0.5, 0.125, 1.0])
    )
    result = outputs.scoring_request_outputs(response)
    assert all(isinstance(r, ScoringRequestOutput) for r in result)
    assert [r.outputs.score for r in result] == [0.5, 0.125, 1.0]
    assert result[2].request_id == "s-2"


def _matrix(rows: int, cols: int, **extra: Any) -> pooling_pb2.TokenMatrix:
    return pooling_pb2.TokenMatrix(
        rows=rows,
        cols=cols,
        values=[float(v) for v in range(rows * cols)],
        token_ids=list(range(100, 100 + rows)),
        offsets=[pooling_pb2.TokenSpan(start=i, end=i + 1) for i in range(rows)],
        special_tokens_mask=[i in (0, rows - 1) for i in range(rows)],
        **extra,
    )


def test_token_embed_response_conversion() -> None:
    response = pooling_pb2.PoolResponse(
        request_id="t",
        token_embed=pooling_pb2.TokenEmbedOutput(items=[_matrix(3, 4), _matrix(2, 4)]),
    )
    result = outputs.pooling_request_outputs(response)
    assert all(isinstance(r, PoolingRequestOutput) for r in result)
    first = result[0].outputs
    assert isinstance(first.data, np.ndarray)
    assert first.data.dtype == np.float32
    assert first.data.shape == (3, 4)
    assert first.data[1].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert first.token_ids == [100, 101, 102]
    assert first.offsets == [(0, 1), (1, 2), (2, 3)]
    assert first.special_tokens_mask == [True, False, True]
    assert first.label_ids == [] and first.labels == []
    assert result[1].outputs.data.shape == (2, 4)


def test_token_classify_response_conversion() -> None:
    matrix = _matrix(2, 3, label_ids=[2, 0], labels=["B-LOC", "O"])
    response = pooling_pb2.PoolResponse(
        request_id="tc", token_classify=pooling_pb2.TokenClassifyOutput(items=[matrix])
    )
    (result,) = outputs.pooling_request_outputs(response)
    assert result.request_id == "tc-0"
    assert result.outputs.data.shape == (2, 3)
    assert result.outputs.label_ids == [2, 0]
    assert result.outputs.labels == ["B-LOC", "O"]


def test_token_matrix_without_numpy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(outputs, "np", None)
    data = outputs._matrix_data(_matrix(2, 3))
    assert data == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]


def test_conversion_rejects_mismatched_responses() -> None:
    response = pooling_pb2.PoolResponse(request_id="x", score=pooling_pb2.ScoreOutput(scores=[1]))
    with pytest.raises(ValueError, match="expected embed"):
        outputs.embedding_request_outputs(response)
    bad = pooling_pb2.TokenMatrix(rows=2, cols=2, values=[1.0])
    with pytest.raises(ValueError, match="rows"):
        outputs._matrix_data(bad)
    request = _requests.pool_request("score", (["q"], ["d1", "d2"]))
    with pytest.raises(ValueError, match="expected 2"):
        _requests.pool_outputs("score", request, response)


def test_model_info_from_card() -> None:
    card = pooling_pb2.ModelCard(
        name="mini",
        tasks=[pooling_pb2.POOLING_TASK_EMBED, pooling_pb2.POOLING_TASK_TOKEN_EMBED],
        hidden_size=384,
        max_input_tokens=512,
        is_matryoshka=True,
        matryoshka_dimensions=[128, 256],
        pooling_type=pooling_pb2.POOLING_TYPE_MEAN,
        default_use_activation=True,
        is_default=True,
        architecture="BertModel",
        truncation_side="right",
        long_input="reject",
    )
    info = ModelInfo.from_proto(card)
    assert info.tasks == ["embed", "token_embed"]
    assert info.pooling_type == "mean"
    assert info.matryoshka_dimensions == [128, 256]
    assert (info.hidden_size, info.max_input_tokens, info.is_default) == (384, 512, True)
    assert ModelInfo.from_proto(pooling_pb2.ModelCard(name="x")).pooling_type is None


# ---------------------------------------------------------------------------------------------
# In-process gRPC server
# ---------------------------------------------------------------------------------------------


class _AbortStatus(grpc.Status):
    """A grpc.Status carrying a google.rpc.Status in the details trailer, as the server sends."""

    def __init__(self, status: status_pb2.Status) -> None:
        self.code = {c.value[0]: c for c in grpc.StatusCode}[status.code]
        self.details = status.message
        self.trailing_metadata = (("grpc-status-details-bin", status.SerializeToString()),)


class FakePoolingServicer(pooling_pb2_grpc.PoolingServiceServicer):
    """Answers embed with [len(text), index].

    request_id "bad" fails, "slow" sleeps; one starting "cancel-once" is cancelled by the
    server the first time it comes, as grpcio does to a call reaching a stopping server.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: list[Any] = []
        self.metadata: list[dict[str, str]] = []

    def _record(self, request: Any, context: grpc.ServicerContext) -> None:
        with self.lock:
            self.requests.append(request)
            self.metadata.append(dict(context.invocation_metadata()))

    def Pool(self, request: pooling_pb2.PoolRequest, context: grpc.ServicerContext) -> Any:
        self._record(request, context)
        if request.request_id == "bad":
            context.abort_with_status(_AbortStatus(_rich_status()))
        if request.request_id == "slow":
            time.sleep(1.0)
        if request.request_id.startswith("cancel-once"):
            with self.lock:
                seen = sum(r.request_id == request.request_id for r in self.requests)
            if seen == 1:
                context.abort(grpc.StatusCode.CANCELLED, "server stopping")
        embeddings = [
            pooling_pb2.Embedding(values=[len(text), i])
            for i, text in enumerate(request.embed.texts)
        ]
        return pooling_pb2.PoolResponse(
            request_id=request.request_id,
            model=request.model or "mini",
            embed=pooling_pb2.EmbedOutput(embeddings=embeddings),
        )

    def ListModels(self, request: Any, context: grpc.ServicerContext) -> Any:
        self._record(request, context)
        card = pooling_pb2.ModelCard(name="mini", tasks=[pooling_pb2.POOLING_TASK_EMBED])
        return pooling_pb2.ListModelsResponse(models=[card])

    def Tokenize(self, request: pooling_pb2.TokenizeRequest, context: grpc.ServicerContext) -> Any:
        self._record(request, context)
        items = [
            pooling_pb2.TokenizedText(
                token_ids=[101, 7, 102],
                tokens=["[CLS]", text, "[SEP]"],
                offsets=[
                    pooling_pb2.TokenSpan(),
                    pooling_pb2.TokenSpan(start=0, end=len(text)),
                    pooling_pb2.TokenSpan(),
                ],
            )
            for text in request.texts
        ]
        return pooling_pb2.TokenizeResponse(model="mini", items=items, max_input_tokens=512)


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, FakePoolingServicer]]:
    servicer = FakePoolingServicer()
    with serve_in_process(servicer, workers=4) as address:
        yield address, servicer


def _assert_rich_error(error: PoolingError) -> None:
    assert error.code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.message == "dimensions not supported"
    assert error.reason == "DIMENSIONS_NOT_SUPPORTED"
    assert error.domain == "pooling.v1"
    assert [v.field for v in error.field_violations] == ["params.dimensions"]
    assert error.retry_delay == pytest.approx(1.5)
    assert isinstance(error.__cause__, grpc.RpcError)


def test_client_embed_round_trip(fake_server: tuple[str, FakePoolingServicer]) -> None:
    target, servicer = fake_server
    with PoolingClient(target, model="mini", timeout=10) as client:
        result = client.embed(
            ["hi", "hello"], pooling_params=PoolingParams(use_activation=True), request_id="ok"
        )
    assert [r.outputs.embedding for r in result] == [[2.0, 0.0], [5.0, 1.0]]
    assert [r.request_id for r in result] == ["ok-0", "ok-1"]
    sent = servicer.requests[-1]
    assert sent.model == "mini"
    assert sent.params.use_activation is True
    assert sent.params.task == pooling_pb2.POOLING_TASK_EMBED


def test_client_raises_rich_pooling_error(fake_server: tuple[str, FakePoolingServicer]) -> None:
    target, _ = fake_server
    with PoolingClient(target) as client, pytest.raises(PoolingError) as caught:
        client.embed("x", request_id="bad")
    _assert_rich_error(caught.value)


def test_client_verifies_params_before_sending(
    fake_server: tuple[str, FakePoolingServicer],
) -> None:
    target, servicer = fake_server
    before = len(servicer.requests)
    with PoolingClient(target) as client, pytest.raises(ValueError, match="dimensions"):
        client.classify("x", pooling_params=PoolingParams(dimensions=8))
    assert len(servicer.requests) == before


def test_client_timeout_maps_to_deadline_exceeded(
    fake_server: tuple[str, FakePoolingServicer],
) -> None:
    target, _ = fake_server
    with PoolingClient(target, timeout=30) as client, pytest.raises(PoolingError) as caught:
        client.embed("x", request_id="slow", timeout=0.05)
    assert caught.value.code is grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_call_the_server_cancelled_is_retried(
    fake_server: tuple[str, FakePoolingServicer],
) -> None:
    target, servicer = fake_server
    with PoolingClient(target, timeout=10) as client:
        [result] = client.embed("abc", request_id="cancel-once-sync")
    assert result.outputs.embedding == [3.0, 0.0]
    assert [r.request_id for r in servicer.requests].count("cancel-once-sync") == 2


def test_a_call_the_client_cancelled_is_not_retried(
    fake_server: tuple[str, FakePoolingServicer],
) -> None:
    target, servicer = fake_server

    async def main() -> None:
        async with AsyncPoolingClient(target, timeout=10) as client:
            call = asyncio.ensure_future(client.embed("x", request_id="slow"))
            await asyncio.sleep(0.3)
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            await asyncio.sleep(1.5)  # the server's handler ends; a retry would come now

    before = [r.request_id for r in servicer.requests].count("slow")
    asyncio.run(main())
    assert [r.request_id for r in servicer.requests].count("slow") == before + 1


def test_client_sends_api_key_and_metadata(fake_server: tuple[str, FakePoolingServicer]) -> None:
    target, servicer = fake_server
    calls = iter(range(100))
    with PoolingClient(
        target, api_key="sekret", metadata=lambda: [("x-call", str(next(calls)))]
    ) as client:
        client.embed("a")
        client.models()
    first, second = servicer.metadata[-2:]
    assert first["authorization"] == "Bearer sekret"
    assert (first["x-call"], second["x-call"]) == ("0", "1")

    with PoolingClient(target, metadata=[("x-team", "search")]) as client:
        client.embed("a")
    assert servicer.metadata[-1]["x-team"] == "search"
    assert "authorization" not in servicer.metadata[-1]


def test_client_models_and_tokenize(fake_server: tuple[str, FakePoolingServicer]) -> None:
    target, servicer = fake_server
    with PoolingClient(target) as client:
        (info,) = client.models()
        tokenized = client.tokenize(["hey"], add_special_tokens=False)
    assert (info.name, info.tasks) == ("mini", ["embed"])
    assert servicer.requests[-1].add_special_tokens is False
    assert tokenized[0].tokens == ["[CLS]", "hey", "[SEP]"]
    assert tokenized[0].offsets == [(0, 0), (0, 3), (0, 0)]


def test_async_client(fake_server: tuple[str, FakePoolingServicer]) -> None:
    target, servicer = fake_server

    async def main() -> None:
        async with AsyncPoolingClient(target, api_key="k", timeout=10) as client:
            result = await client.encode(["abc"], pooling_task="embed", request_id="a")
            assert result[0].outputs.embedding == [3.0, 0.0]
            assert servicer.metadata[-1]["authorization"] == "Bearer k"
            with pytest.raises(PoolingError) as caught:
                await client.embed("x", request_id="bad")
            _assert_rich_error(caught.value)
            (info,) = await client.models()
            assert info.name == "mini"

    asyncio.run(main())


def test_from_bare_rpc_error() -> None:
    error = PoolingError.from_rpc_error(grpc.RpcError("boom"))
    assert error.code is grpc.StatusCode.UNKNOWN
    assert error.message == "boom"


def test_channel_settings() -> None:
    assert _channel.channel_credentials(None, None, None, None) is None
    creds = _channel.channel_credentials(None, b"root-pem", None, None)
    assert isinstance(creds, grpc.ChannelCredentials)
    with pytest.raises(ValueError):
        _channel.channel_credentials(creds, b"root-pem", None, None)
    assert _channel.channel_options(None) == list(_channel.DEFAULT_OPTIONS)
    assert ("grpc.max_receive_message_length", -1) in _channel.DEFAULT_OPTIONS
    overridden = _channel.channel_options([("grpc.max_receive_message_length", 1024)])
    assert overridden[0] == ("grpc.max_receive_message_length", 1024)
    assert ("grpc.max_receive_message_length", -1) not in overridden
    config_json = dict(_channel.DEFAULT_OPTIONS)["grpc.service_config"]
    assert json.loads(config_json)["loadBalancingConfig"] == [{"round_robin": {}}]


def test_channel_targets() -> None:
    assert _channel.channel_target("localhost:50051") == "localhost:50051"
    assert _channel.channel_target(["10.0.0.1:1"]) == "10.0.0.1:1"
    assert _channel.channel_target(["127.0.0.1:1", "127.0.0.2:2"]) == "ipv4:127.0.0.1:1,127.0.0.2:2"
    assert _channel.channel_target(["[::1]:1", "[::1]:2"]) == "ipv6:[::1]:1,[::1]:2"
    with pytest.raises(ValueError):
        _channel.channel_target(["a.example:1", "b.example:2"])
    with pytest.raises(ValueError):
        _channel.channel_target(["127.0.0.1:1", "[::1]:2"])
    config = _channel.ClientConfig(model="m", timeout=5.0)
    assert (config.model_for(None), config.model_for("x")) == ("m", "x")
    assert (config.timeout_for(None), config.timeout_for(1.0)) == (5.0, 1.0)
    assert config.call_metadata() == ()
