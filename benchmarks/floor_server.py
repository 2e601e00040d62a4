"""The floor: a bare grpc.aio server on the project's proto that does no work at all.

Every `Pool` call gets one prebuilt PoolResponse with one embedding of --dims floats (32, the
hidden size of the benchmark's loop-bound model, so the response is the same size): no model,
no queue, no tokenizer, no interceptors, no metrics. Its throughput under the same load is the
most any Python grpc.aio server could answer on this machine, which is what the real server's
per-request overhead is measured against. A benchmark tool only; never part of the product.

Run: python -m benchmarks.floor_server --port P [--dims N] [--event-loop auto|uvloop|asyncio]
"""

from __future__ import annotations

import argparse
import asyncio
import signal

import grpc

from pooling_client.v1 import pooling_pb2 as pb
from pooling_client.v1 import pooling_pb2_grpc
from pooling_server.service.ops import event_loop


class FloorServicer(pooling_pb2_grpc.PoolingServiceServicer):
    """Answers every Pool with the same response object: no per-call Python beyond the return."""

    def __init__(self, dims: int) -> None:
        self._response = pb.PoolResponse(
            request_id="floor",
            model="floor",
            usage=pb.Usage(prompt_tokens=20, total_tokens=20),
            embed=pb.EmbedOutput(embeddings=[pb.Embedding(values=[0.125] * dims)]),
        )

    async def Pool(  # the gRPC method's name
        self, request: pb.PoolRequest, context: grpc.aio.ServicerContext
    ) -> pb.PoolResponse:
        return self._response


async def serve(host: str, port: int, dims: int) -> None:
    server = grpc.aio.server()
    pooling_pb2_grpc.add_PoolingServiceServicer_to_server(FloorServicer(dims), server)
    bound = server.add_insecure_port(f"{host}:{port}")
    await server.start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    # The parent waits for this line before it loads the server.
    print(f"floor server ready on {host}:{bound} dims={dims}", flush=True)
    await stop.wait()
    await server.stop(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True, help="0: any free port")
    parser.add_argument("--dims", type=int, default=32, help="floats in the one embedding")
    parser.add_argument(
        "--event-loop", default="auto", choices=event_loop.CHOICES, help="as the server's flag"
    )
    args = parser.parse_args()
    event_loop.run(serve(args.host, args.port, args.dims), args.event_loop)


if __name__ == "__main__":
    main()
