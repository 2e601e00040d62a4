"""Bytes that are not a protobuf message get INVALID_ARGUMENT / MALFORMED_REQUEST on every
method of the service (read from its descriptor, so a new method is covered); on a stream
the answer is in band, naming the message, and the stream goes on. Serving goes on."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from pooling_client import PoolingClient
from pooling_client.v1 import pooling_pb2 as pb
from tests.rpc_errors import decode_rpc_error, decode_status
from tests.server_process import ServerProcess

SERVICE = pb.DESCRIPTOR.services_by_name["PoolingService"]
GARBAGE = [b"\xff\xff\xff\x07garbage", b"\x0a\xff\xff\xff\xff\x0f", b"\x08" + b"\xff" * 12]


def identity(data: bytes) -> bytes:
    return data


def test_the_descriptor_lists_the_known_methods() -> None:
    names = {method.name for method in SERVICE.methods}
    assert {"Pool", "PoolStream", "ListModels", "Tokenize"} <= names


@pytest.mark.parametrize("payload", GARBAGE, ids=["bad-tag", "truncated", "long-varint"])
@pytest.mark.parametrize("method", list(SERVICE.methods), ids=lambda m: m.name)
def test_malformed_bytes_on_every_method(
    server: ServerProcess, method: Any, payload: bytes
) -> None:
    path = f"/{SERVICE.full_name}/{method.name}"
    with grpc.insecure_channel(server.address) as channel:
        if method.client_streaming:
            call = channel.stream_stream(path, identity, pb.PoolStreamResponse.FromString)
            answers = call(iter([payload]), timeout=10)
            [answer] = list(answers)
            assert answers.code() == grpc.StatusCode.OK
            assert answer.request_id == ""
            error = decode_status(answer.error)
            assert error.fields == ["messages[0]"]
        else:
            with pytest.raises(grpc.RpcError) as caught:
                channel.unary_unary(path, identity, identity)(payload, timeout=10)
            error = decode_rpc_error(caught.value)
    assert (error.code, error.reason) == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST")


def test_malformed_bytes_between_good_ones_on_a_stream(server: ServerProcess) -> None:
    good = pb.PoolStreamRequest(request=pb.PoolRequest(request_id="good", embed={"texts": ["a"]}))
    data = good.SerializeToString()
    payloads = [data, GARBAGE[0], data.replace(b"good", b"next")]
    with grpc.insecure_channel(server.address) as channel:
        call = channel.stream_stream(
            f"/{SERVICE.full_name}/PoolStream", identity, pb.PoolStreamResponse.FromString
        )
        answers = call(iter(payloads), timeout=10)
        received = list(answers)
        assert answers.code() == grpc.StatusCode.OK
    assert sorted(a.request_id for a in received if a.HasField("response")) == ["good", "next"]
    [bad] = [a for a in received if a.HasField("error")]
    assert (bad.request_id, decode_status(bad.error).fields) == ("", ["messages[1]"])


def test_serving_goes_on(server: ServerProcess, client: PoolingClient) -> None:
    assert server.health() == 1
    assert len(client.embed(["after garbage"])[0].outputs.embedding) == 384
