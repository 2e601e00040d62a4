"""The asyncio side of the client's I/O: channels and calls on grpc.aio.

Everything else the clients do is one implementation: async_client.py, from which
client.py is generated (scripts/unasync_client.py) against _io_sync.py, this module's twin.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import grpc

from pooling_client import _chunking
from pooling_client._progress import Progress
from pooling_client.errors import PoolingError


def open_channel(
    target: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]],
    compression: grpc.Compression | None,
) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(target, options, compression)
    return grpc.aio.secure_channel(target, credentials, options, compression)


async def unary(method: Any, request: Any, timeout: float | None, metadata: Any) -> tuple[Any, Any]:
    """The response and the trailing metadata (the server's timings) of a unary call."""
    try:
        call = method(request, timeout=timeout, metadata=metadata)
        return await call, await call.trailing_metadata()
    except grpc.RpcError as error:
        raise PoolingError.from_rpc_error(error) from error


async def stream_job(
    stub: Any, job: _chunking.ChunkedJob, timeout: float | None, metadata: Any, bar: Progress
) -> list[Any]:
    """Run a chunked job over one PoolStream, never more than ``job.window`` unanswered."""
    call = stub.PoolStream(timeout=timeout, metadata=metadata)
    try:
        await _send(call, job)
        while (response := await call.read()) is not grpc.aio.EOF:
            bar.update(job.accept(response))
            await _send(call, job)
    except grpc.RpcError as error:
        raise PoolingError.from_rpc_error(error) from error
    finally:
        call.cancel()  # a no-op once the stream has ended; stops it after a failure
    return job.outputs()


async def _send(call: Any, job: _chunking.ChunkedJob) -> None:
    """Write the chunks the job has room for; half-close once the last one is out."""
    try:
        for request in job.fill():
            await call.write(request)
        if job.exhausted:
            await call.done_writing()  # idempotent
    except asyncio.InvalidStateError:
        pass  # the call already ended; the next read reports how
