"""PoolingService registered with deserializers that never raise.

grpcio answers a message that fails to deserialize with INTERNAL ("Exception
deserializing request"), which tells a client nothing and looks like a server bug.
Here each method's deserializer turns bad bytes into a `Malformed` marker instead, and
the servicer answers it with INVALID_ARGUMENT and reason MALFORMED_REQUEST. The handlers
are built once at startup, so a call pays nothing beyond its own parse (an interceptor
would rebuild each call's handler).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message

from engine.errors import ErrorKind, FieldViolation, PoolingError
from pooling_client.v1 import pooling_pb2 as pb

SERVICE = pb.DESCRIPTOR.services_by_name["PoolingService"]


@dataclass(frozen=True, slots=True)
class Malformed:
    problem: str

    def error(self, field: str | None = None) -> PoolingError:
        """`field`: which message it was, where a call carries several (a stream)."""
        message = f"the request message could not be parsed as protobuf: {self.problem}"
        violations = (FieldViolation(field, message, "MALFORMED_REQUEST"),) if field else ()
        return PoolingError(ErrorKind.INVALID_ARGUMENT, "MALFORMED_REQUEST", message, violations)


def tolerant(message_class: type[Message]) -> Callable[[bytes], Message | Malformed]:
    parse = message_class.FromString

    def deserialize(data: bytes) -> Message | Malformed:
        try:
            return parse(data)
        except Exception as exc:  # any parse failure is the client's
            return Malformed(str(exc) or type(exc).__name__)

    return deserialize


_HANDLER_KINDS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def add_pooling_service(servicer: Any, server: grpc.aio.Server) -> None:
    """Register every method of the service's descriptor on `servicer`'s same-named method."""
    handlers = {}
    for method in SERVICE.methods:
        request_class = getattr(pb, method.input_type.name)
        response_class = getattr(pb, method.output_type.name)
        kind = _HANDLER_KINDS[(method.client_streaming, method.server_streaming)]
        handlers[method.name] = kind(
            getattr(servicer, method.name),
            request_deserializer=tolerant(request_class),
            response_serializer=response_class.SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE.full_name, handlers),)
    )
    server.add_registered_method_handlers(SERVICE.full_name, handlers)
