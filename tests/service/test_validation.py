"""One test per validation rule, over the real server: status code, reason and field path."""

from __future__ import annotations

import grpc
import pytest
from grpc_health.v1 import health_pb2

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.conftest import DEFAULT_MODEL, MAX_CLIENT_BATCH_SIZE
from tests.rpc_errors import DecodedError, decode_rpc_error
from tests.server_process import ServerProcess

INVALID = grpc.StatusCode.INVALID_ARGUMENT


def fail(stub: pooling_pb2_grpc.PoolingServiceStub, request: pb.PoolRequest) -> DecodedError:
    with pytest.raises(grpc.RpcError) as caught:
        stub.Pool(request, timeout=30)
    error = decode_rpc_error(caught.value)
    assert error.info is not None and error.info.domain == "pooling.v1"
    return error


def expect(
    stub: pooling_pb2_grpc.PoolingServiceStub,
    request: pb.PoolRequest,
    code: grpc.StatusCode,
    reason: str,
    field: str,
) -> DecodedError:
    error = fail(stub, request)
    assert (error.code, error.reason) == (code, reason), error.message
    assert field in error.fields, error.fields
    return error


def embed(*texts: str, **params: object) -> pb.PoolRequest:
    return pb.PoolRequest(embed=pb.TextInput(texts=texts), params=pb.PoolingParams(**params))


def test_no_input_case(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    expect(stub, pb.PoolRequest(), INVALID, "INPUT_MISSING", "input")


@pytest.mark.parametrize("case", ["embed", "classify", "token_embed", "token_classify"])
def test_empty_texts(stub: pooling_pb2_grpc.PoolingServiceStub, case: str) -> None:
    request = pb.PoolRequest(**{case: pb.TextInput()})
    expect(stub, request, INVALID, "EMPTY_INPUT", f"{case}.texts")


@pytest.mark.parametrize(
    ("text_1", "text_2", "reason", "field"),
    [
        ([], ["doc"], "EMPTY_INPUT", "score.text_1"),
        (["query"], [], "EMPTY_INPUT", "score.text_2"),
        (["q1", "q2"], ["d1", "d2", "d3"], "SCORE_SHAPE_MISMATCH", "score.text_2"),
        (["q1", "q2"], ["d1"], "SCORE_SHAPE_MISMATCH", "score.text_2"),
    ],
)
def test_score_shapes(
    stub: pooling_pb2_grpc.PoolingServiceStub,
    text_1: list[str],
    text_2: list[str],
    reason: str,
    field: str,
) -> None:
    request = pb.PoolRequest(score=pb.ScoreInput(text_1=text_1, text_2=text_2))
    expect(stub, request, INVALID, reason, field)


def test_score_shapes_that_are_valid(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    for text_1, text_2, count in (
        (["q"], ["d"], 1),
        (["q"], ["a", "b", "c"], 3),
        (["x", "y"], ["a", "b"], 2),
    ):
        response = stub.Pool(pb.PoolRequest(score=pb.ScoreInput(text_1=text_1, text_2=text_2)))
        assert len(response.score.scores) == count


@pytest.mark.parametrize(
    ("case", "field"),
    [
        ("classify", "params.dimensions"),
        ("score", "params.dimensions"),
        ("token_classify", "params.dimensions"),
    ],
)
def test_param_not_valid_for_task(
    stub: pooling_pb2_grpc.PoolingServiceStub, case: str, field: str
) -> None:
    model = {"classify": "tiny-classifier", "score": DEFAULT_MODEL, "token_classify": "tiny-ner"}
    if case == "score":
        request = pb.PoolRequest(score=pb.ScoreInput(text_1=["a"], text_2=["b"]))
    else:
        request = pb.PoolRequest(**{case: pb.TextInput(texts=["a"])})
    request.model = model[case]
    request.params.dimensions = 8
    error = expect(stub, request, INVALID, "PARAM_NOT_SUPPORTED_FOR_TASK", field)
    assert "use_activation" in error.description(field)


def test_declared_task_disagrees_with_input(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    request = embed("a", task=pb.POOLING_TASK_CLASSIFY)
    expect(stub, request, INVALID, "TASK_MISMATCH", "params.task")


def test_declared_task_that_agrees_is_accepted(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    assert len(stub.Pool(embed("a", task=pb.POOLING_TASK_EMBED)).embed.embeddings) == 1


def test_unknown_task_enum_value(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    expect(stub, embed("a", task=42), INVALID, "TASK_UNKNOWN", "params.task")


def test_dimensions_on_a_model_that_is_not_matryoshka(
    stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    error = expect(
        stub, embed("a", dimensions=64), INVALID, "DIMENSIONS_NOT_SUPPORTED", "params.dimensions"
    )
    assert "matryoshka" in error.description("params.dimensions")


@pytest.mark.parametrize("dimensions", [0, -3, 385])
def test_dimensions_out_of_range(
    stub: pooling_pb2_grpc.PoolingServiceStub, dimensions: int
) -> None:
    request = embed("a", dimensions=dimensions)
    request.model = "minilm-matryoshka"
    error = expect(stub, request, INVALID, "DIMENSIONS_OUT_OF_RANGE", "params.dimensions")
    assert "384" in error.description("params.dimensions")


def test_dimensions_not_in_the_model_list(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    request = embed("a", dimensions=100)
    request.model = "minilm-dims"
    error = expect(stub, request, INVALID, "DIMENSIONS_NOT_SUPPORTED", "params.dimensions")
    assert "128, 256" in error.description("params.dimensions")


@pytest.mark.parametrize("value", [-2, 0, 257])
def test_truncate_prompt_tokens_invalid(
    stub: pooling_pb2_grpc.PoolingServiceStub, value: int
) -> None:
    request = embed("a", truncate_prompt_tokens=value)
    error = expect(
        stub, request, INVALID, "TRUNCATE_PROMPT_TOKENS_INVALID", "params.truncate_prompt_tokens"
    )
    assert "256" in error.description("params.truncate_prompt_tokens")


def test_text_over_max_length_without_truncation(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    long_text = "word " * 300  # 300 tokens + [CLS] + [SEP]
    error = expect(stub, embed("short", long_text), INVALID, "INPUT_TOO_LONG", "embed.texts[1]")
    description = error.description("embed.texts[1]")
    assert "302" in description and "256" in description
    assert error.fields == ["embed.texts[1]"]


def test_long_text_with_truncation_is_accepted(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    response = stub.Pool(embed("word " * 300, truncate_prompt_tokens=-1))
    assert response.usage.prompt_tokens == 256


def test_too_many_texts(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    request = embed(*(["a"] * (MAX_CLIENT_BATCH_SIZE + 1)))
    error = expect(stub, request, INVALID, "TOO_MANY_INPUTS", "embed.texts")
    assert str(MAX_CLIENT_BATCH_SIZE) in error.description("embed.texts")


def test_unknown_model(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    request = embed("a")
    request.model = "no-such-model"
    error = expect(stub, request, grpc.StatusCode.NOT_FOUND, "MODEL_NOT_FOUND", "model")
    assert DEFAULT_MODEL in error.message and "tiny-bert" in error.message


def test_task_the_model_cannot_do(stub: pooling_pb2_grpc.PoolingServiceStub) -> None:
    request = pb.PoolRequest(classify=pb.TextInput(texts=["a"]))
    error = expect(
        stub, request, grpc.StatusCode.FAILED_PRECONDITION, "TASK_NOT_SUPPORTED", "classify"
    )
    assert "embed" in error.message


def test_several_violations_are_reported_together(
    stub: pooling_pb2_grpc.PoolingServiceStub,
) -> None:
    request = pb.PoolRequest(
        classify=pb.TextInput(texts=["a"]),
        model="tiny-classifier",
        params=pb.PoolingParams(dimensions=4, truncate_prompt_tokens=0),
    )
    error = fail(stub, request)
    assert set(error.fields) == {"params.dimensions", "params.truncate_prompt_tokens"}


def test_server_still_serves_after_bad_requests(
    stub: pooling_pb2_grpc.PoolingServiceStub, server: ServerProcess
) -> None:
    for request in (pb.PoolRequest(), embed(), embed("a", dimensions=-1)):
        with pytest.raises(grpc.RpcError):
            stub.Pool(request)
    assert server.health() == health_pb2.HealthCheckResponse.SERVING
    assert len(stub.Pool(embed("still fine")).embed.embeddings) == 1
