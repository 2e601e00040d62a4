"""A fake PoolingService on a real loopback port, for client tests that need no model."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc

from pooling_client.v1 import pooling_pb2_grpc


@contextmanager
def serve_in_process(
    servicer: pooling_pb2_grpc.PoolingServiceServicer, workers: int = 4
) -> Iterator[str]:
    """Serve `servicer` in this process; yields its "host:port"."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers))
    pooling_pb2_grpc.add_PoolingServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.stop(None)
