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
