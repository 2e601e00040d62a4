"""Requests whose bytes do not parse get INVALID_ARGUMENT, not grpcio's default INTERNAL.

grpcio answers a failed deserialization with INTERNAL ("Exception deserializing
request"), which tells a client nothing and looks like a server bug. This interceptor
makes deserialization total: a bad message becomes a marker that the handler rejects
with INVALID_ARGUMENT and reason MALFORMED_REQUEST.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from engine.errors import ErrorKind, PoolingError
from service.errors import to_grpc_status

SERVICE_PREFIX = "/pooling.v1.PoolingService/"


@dataclass(frozen=True)
class Malformed:
    problem: str


def _tolerant(deserialize: Callable[[bytes], Any] | None) -> Callable[[bytes], Any]:
    def parse(data: bytes) -> Any:
        try:
            return deserialize(data) if deserialize else data
        except Exception as exc:  # any parse failure is the client's
            return Malformed(str(exc) or type(exc).__name__)

    return parse


async def _reject(context: grpc.aio.ServicerContext, bad: Malformed) -> None:
    error = PoolingError(
        ErrorKind.INVALID_ARGUMENT,
        "MALFORMED_REQUEST",
        f"the request message could not be parsed as protobuf: {bad.problem}",
    )
    await context.abort_with_status(to_grpc_status(error))


def _checked_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    parse = _tolerant(handler.request_deserializer)
    serialize = handler.response_serializer
    if handler.unary_unary:
        inner = handler.unary_unary

        async def unary_unary(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, Malformed):
                await _reject(context, request)
            return await inner(request, context)

        return grpc.unary_unary_rpc_method_handler(unary_unary, parse, serialize)
    if handler.stream_stream:
        inner_stream = handler.stream_stream

        async def stream_stream(
            requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            async def checked() -> AsyncIterator[Any]:
                async for request in requests:
                    if isinstance(request, Malformed):
                        await _reject(context, request)
                    yield request

            async for response in inner_stream(checked(), context):
                yield response

        return grpc.stream_stream_rpc_method_handler(stream_stream, parse, serialize)
    return handler  # PoolingService has no other shapes


class MalformedRequestInterceptor(grpc.aio.ServerInterceptor):
    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not (handler_call_details.method or "").startswith(SERVICE_PREFIX):
            return handler
        return _checked_handler(handler)
