"""The blocking side of the client's I/O: channels and calls on grpc's sync API.

The twin of _io_async.py, with the same functions; client.py, generated from
async_client.py, calls these.
"""

from __future__ import annotations

import queue
from collections.abc import Sequence
from typing import Any

import grpc

from pooling_client import _chunking
from pooling_client._progress import Progress
from pooling_client.errors import PoolingError
from pooling_client.v1 import pooling_pb2


def open_channel(
    target: str,
    credentials: grpc.ChannelCredentials | None,
    options: Sequence[tuple[str, Any]],
    compression: grpc.Compression | None,
) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(target, options, compression)
    return grpc.secure_channel(target, credentials, options, compression)


def unary(method: Any, request: Any, timeout: float | None, metadata: Any) -> tuple[Any, Any]:
    """The response and the trailing metadata (the server's timings) of a unary call."""
    try:
        response, call = method.with_call(request, timeout=timeout, metadata=metadata)
    except grpc.RpcError as error:
        raise PoolingError.from_rpc_error(error) from error
    return response, call.trailing_metadata()


def stream_job(
    stub: Any, job: _chunking.ChunkedJob, timeout: float | None, metadata: Any, bar: Progress
) -> list[Any]:
    """Run a chunked job over one PoolStream, never more than ``job.window`` unanswered.

    gRPC pulls requests from its own thread; it reads them from a queue that this thread
    fills only as answers come back, so the window holds however fast gRPC pulls.
    """
    outbox: queue.SimpleQueue[pooling_pb2.PoolStreamRequest | None] = queue.SimpleQueue()
    closed = False

    def send() -> None:
        nonlocal closed
        for request in job.fill():
            outbox.put(request)
        if job.exhausted and not closed:
            closed = True
            outbox.put(None)  # ends the request iterator: half-closes the stream

    call = stub.PoolStream(iter(outbox.get, None), timeout=timeout, metadata=metadata)
    try:
        send()
        for response in call:
            bar.update(job.accept(response))
            send()
    except grpc.RpcError as error:
        raise PoolingError.from_rpc_error(error) from error
    finally:
        outbox.put(None)  # release gRPC's request thread if it is still waiting
        call.cancel()  # a no-op once the stream has ended; stops it after a failure
    return job.outputs()
