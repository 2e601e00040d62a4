"""Bearer-token auth for PoolingService only; health and reflection stay open for probes."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path

import grpc

PROTECTED_PREFIX = "/pooling.v1.PoolingService/"


def load_keys(keys: Iterable[str], key_file: str | None) -> list[str]:
    """Keys from the command line and from a file of one key per line (# comments allowed)."""
    found = [key for key in keys if key]
    if key_file:
        for line in Path(key_file).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                found.append(line)
    return found


def _abort_handler(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same shape that refuses the call, saying nothing about why."""

    async def refuse(request: object, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid credentials")

    async def refuse_stream(request: object, context: grpc.aio.ServicerContext):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid credentials")
        yield  # pragma: no cover - makes this an async generator

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    shape = (handler.request_streaming, handler.response_streaming)
    behaviour = refuse_stream if handler.response_streaming else refuse
    return kinds[shape](
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [key.encode() for key in keys]

    def _authorized(self, metadata: Iterable[tuple[str, str | bytes]]) -> bool:
        for key, value in metadata:
            if key == "authorization" and isinstance(value, str):
                scheme, _, token = value.partition(" ")
                if scheme.lower() == "bearer":
                    return any(hmac.compare_digest(token.encode(), k) for k in self._keys)
        return False

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or not method.startswith(PROTECTED_PREFIX):
            return handler
        if self._authorized(handler_call_details.invocation_metadata or ()):
            return handler
        return _abort_handler(handler)
