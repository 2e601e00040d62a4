"""Bearer-token auth: the one check every door makes (BearerKeys), and gRPC's interceptor.

gRPC guards PoolingService only, and the HTTP door (service/http/app.py's middleware)
every route but /health: health and reflection stay open for probes. A call without a
valid key is refused before its message is read.
"""

from __future__ import annotations

import hmac
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable

import grpc

PROTECTED_PREFIX = "/pooling.v1.PoolingService/"


class BearerKeys:
    """The accepted API keys, and whether an Authorization value names one of them.

    The scheme is "Bearer", in any case. The token is compared as the bytes the client
    sent, in constant time against every key, so neither a wrong key's length nor its
    first differing byte shows in the time taken. A value that is not UTF-8 comes from
    aiohttp decoded with surrogates for its bad bytes: those bytes are compared (and
    never match a key), rather than failing to encode.
    """

    def __init__(self, keys: Iterable[str]) -> None:
        self._keys = [key.encode() for key in keys if key]

    def __bool__(self) -> bool:
        return bool(self._keys)

    def allow(self, authorization: str | bytes | None) -> bool:
        if authorization is None:
            return False
        if isinstance(authorization, str):
            try:
                authorization = authorization.encode("utf-8", "surrogateescape")
            except UnicodeEncodeError:  # a lone surrogate no decoder produced
                return False
        scheme, _, token = authorization.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        # Every key is compared, matched or not, so the time says nothing of which.
        matched = False
        for key in self._keys:
            matched |= hmac.compare_digest(token, key)
        return matched

    def allow_metadata(self, metadata: Iterable[tuple[str, str | bytes]]) -> bool:
        """gRPC's metadata: the first Bearer authorization entry decides."""
        for key, value in metadata:
            if key == "authorization" and isinstance(value, str):
                scheme, _, _ = value.partition(" ")
                if scheme.lower() == "bearer":
                    return self.allow(value)
        return False


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
        self.keys = BearerKeys(keys)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or not method.startswith(PROTECTED_PREFIX):
            return handler
        if self.keys.allow_metadata(handler_call_details.invocation_metadata or ()):
            return handler
        return _REFUSAL
