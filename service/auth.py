"""Bearer-token auth for PoolingService only; health and reflection stay open for probes.

A call without a valid key is refused before its message is read.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import grpc

PROTECTED_PREFIX = "/pooling.v1.PoolingService/"


async def _refuse(requests: object, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or invalid credentials")
    yield  # pragma: no cover - makes this an async generator


# Registered as a streaming handler whatever the method's shape: grpcio reads (inflates and
# parses) a unary request before calling its handler, but never reads a stream nobody pulls,
# so a refused call costs no more than its headers. The wire format is the same, so a unary
# client simply receives the status.
_REFUSAL = grpc.stream_stream_rpc_method_handler(_refuse)


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
        return _REFUSAL
