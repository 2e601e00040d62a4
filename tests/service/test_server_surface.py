"""Health, reflection, ListModels and Tokenize on the real server."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from transformers import AutoTokenizer

from pooling_client import PoolingClient
from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from tests.conftest import DEFAULT_MODEL, Served
from tests.fixture_models import MINILM
from tests.rpc_errors import decode_rpc_error
from tests.server_process import ServerProcess


def test_health_serving_overall_and_per_service(server: ServerProcess) -> None:
    assert server.health("") == health_pb2.HealthCheckResponse.SERVING
    assert server.health("pooling.v1.PoolingService") == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_the_services(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(list_services="")
        response = next(stub.ServerReflectionInfo(iter([request])))
    names = {service.name for service in response.list_services_response.service}
    assert {"pooling.v1.PoolingService", "grpc.health.v1.Health"} <= names


def test_list_models_in_order_with_the_default_first(
    stub: pooling_pb2_grpc.PoolingServiceStub, served: dict[str, Served]
) -> None:
    cards = stub.ListModels(pb.ListModelsRequest()).models
    assert [card.name for card in cards] == list(served)
    default = cards[0]
    assert default.name == DEFAULT_MODEL and default.is_default
    assert not any(card.is_default for card in cards[1:])
    assert list(default.tasks) == [
        pb.POOLING_TASK_EMBED,
        pb.POOLING_TASK_TOKEN_EMBED,
        pb.POOLING_TASK_SCORE,
    ]
    assert (default.hidden_size, default.max_input_tokens) == (384, 256)
    assert default.pooling_type == pb.POOLING_TYPE_MEAN and default.default_use_activation


def test_tokenize_matches_the_tokenizer(client: PoolingClient) -> None:
    texts = ["Hello world", "naïve café 🙂", ""]
    reference = AutoTokenizer.from_pretrained(MINILM)
    for text, item in zip(texts, client.tokenize(texts), strict=True):
        encoded = reference(text, return_offsets_mapping=True)
        assert item.token_ids == encoded["input_ids"]
        assert item.tokens == reference.convert_ids_to_tokens(encoded["input_ids"])
        assert [tuple(span) for span in item.offsets] == [
            tuple(s) for s in encoded["offset_mapping"]
        ]
    without = client.tokenize(["Hello world"], add_special_tokens=False)[0]
    assert without.token_ids == reference("Hello world", add_special_tokens=False)["input_ids"]


def test_tokenize_without_texts_is_empty_input_as_pool_is(server: ServerProcess) -> None:
    with grpc.insecure_channel(server.address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)
        for call in (
            lambda: stub.Tokenize(pb.TokenizeRequest(), timeout=30),
            lambda: stub.Pool(pb.PoolRequest(embed=pb.TextInput()), timeout=30),
        ):
            try:
                call()
            except grpc.RpcError as error:
                decoded = decode_rpc_error(error)
                assert decoded.code == grpc.StatusCode.INVALID_ARGUMENT, decoded
                assert decoded.info is not None and decoded.info.reason == "EMPTY_INPUT"
            else:
                raise AssertionError("a request without texts was answered")


def test_reflection_describes_the_schema_well_enough_to_call_it(server: ServerProcess) -> None:
    """What grpcurl does: fetch the descriptors by symbol, build a request, call Pool."""
    from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

    with grpc.insecure_channel(server.address) as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        request = reflection_pb2.ServerReflectionRequest(
            file_containing_symbol="pooling.v1.PoolingService"
        )
        response = next(stub.ServerReflectionInfo(iter([request])))
        pool = descriptor_pool.DescriptorPool()
        files = [
            descriptor_pb2.FileDescriptorProto.FromString(raw)
            for raw in response.file_descriptor_response.file_descriptor_proto
        ]
        names = {f.name for f in files}
        assert "pooling/v1/pooling.proto" in names
        pending = list(files)
        while pending:  # add each file once its dependencies are in the pool
            ready = [p for p in pending if all(_has_file(pool, d) for d in p.dependency)]
            assert ready, f"reflection left out a dependency of {[p.name for p in pending]}"
            for proto in ready:
                pool.Add(proto)
                pending.remove(proto)
        service = pool.FindServiceByName("pooling.v1.PoolingService")
        assert [m.name for m in service.methods] == [
            "Pool",
            "PoolStream",
            "ListModels",
            "Tokenize",
            "Rerank",
        ]
        request_class = message_factory.GetMessageClass(
            pool.FindMessageTypeByName("pooling.v1.PoolRequest")
        )
        response_class = message_factory.GetMessageClass(
            pool.FindMessageTypeByName("pooling.v1.PoolResponse")
        )
        dynamic = request_class()
        dynamic.embed.texts.append("reflection")
        call = channel.unary_unary(
            "/pooling.v1.PoolingService/Pool",
            request_serializer=lambda m: m.SerializeToString(),
            response_deserializer=response_class.FromString,
        )
        answer = call(dynamic, timeout=30)
    assert len(answer.embed.embeddings[0].values) == 384


def _has_file(pool: object, name: str) -> bool:
    try:
        pool.FindFileByName(name)  # type: ignore[attr-defined]
    except KeyError:
        return False
    return True
