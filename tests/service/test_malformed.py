"""Bytes that are not a protobuf message get INVALID_ARGUMENT on every method; serving goes on."""

from __future__ import annotations

import grpc
import pytest

from pooling_client import PoolingClient
from tests.rpc_errors import decode_rpc_error
from tests.server_process import ServerProcess

GARBAGE = [b"\xff\xff\xff\x07garbage", b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\xff" * 12]


@pytest.mark.parametrize("method", ["Pool", "ListModels", "Tokenize"])
@pytest.mark.parametrize("payload", GARBAGE)
def test_unary_garbage(server: ServerProcess, method: str, payload: bytes) -> None:
    with grpc.insecure_channel(server.address) as channel:
        call = channel.unary_unary(f"/pooling.v1.PoolingService/{method}")
        with pytest.raises(grpc.RpcError) as caught:
            call(payload, timeout=10)
    error = decode_rpc_error(caught.value)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == "MALFORMED_REQUEST"


@pytest.mark.parametrize("payload", GARBAGE)
def test_stream_garbage(server: ServerProcess, payload: bytes) -> None:
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream("/pooling.v1.PoolingService/PoolStream")
        with pytest.raises(grpc.RpcError) as caught:
            list(call(iter([payload]), timeout=10))
    error = decode_rpc_error(caught.value)
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST")


def test_serving_goes_on(server: ServerProcess, client: PoolingClient) -> None:
    assert server.health() == 1
    assert len(client.embed(["after garbage"])[0].outputs.embedding) == 384
