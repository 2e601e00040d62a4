"""The Python load driver: C closed-loop grpc.aio clients sending one text per call through
unary `Pool` or `PoolStream`, spread over load processes.

It spends 0.25-0.4 ms of CPU per call, which a small machine's server cannot spare; h2load
(benchmarks/h2load.py) is the lighter driver, this one speaks real gRPC and streams. Each load
process runs `python -m benchmarks.python_load ADDRESS MODE C SECONDS [--mixed]
[--shared-channel]` and prints its latencies as one line of JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from benchmarks import processes
from benchmarks.workload import sentences


def mixed_sentences(count: int, seed: int) -> list[str]:
    """Lengths spread over 5..256 tokens (a word here is one token)."""
    return sentences(count, seed, min_words=3, max_words=250)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _unary(stubs, texts: list[str], concurrency: int, stop: float, lat: list[float]) -> None:
    from pooling_client.v1 import pooling_pb2 as pb

    async def worker(i: int) -> None:
        stub = stubs[i % len(stubs)]
        while time.perf_counter() < stop:
            request = pb.PoolRequest(embed=pb.TextInput(texts=[texts[i % len(texts)]]))
            started = time.perf_counter()
            await stub.Pool(request)
            lat.append(time.perf_counter() - started)
            i += concurrency

    await asyncio.gather(*(worker(c) for c in range(concurrency)))


async def _stream(stubs, texts: list[str], concurrency: int, stop: float, lat: list[float]) -> None:
    """C streams, each a closed loop with one request in flight."""
    from pooling_client.v1 import pooling_pb2 as pb

    async def worker(i: int) -> None:
        call = stubs[i % len(stubs)].PoolStream()
        while time.perf_counter() < stop:
            request = pb.PoolRequest(
                request_id=str(i), embed=pb.TextInput(texts=[texts[i % len(texts)]])
            )
            started = time.perf_counter()
            await call.write(pb.PoolStreamRequest(request=request))
            await call.read()
            lat.append(time.perf_counter() - started)
            i += concurrency
        await call.done_writing()
        await call.read()

    await asyncio.gather(*(worker(c) for c in range(concurrency)))


def run_load(
    address: str, mode: str, concurrency: int, duration: float, mixed: bool, shared_channel: bool
) -> dict[str, Any]:
    """One load process: its clients' latencies and how long they ran."""
    import grpc

    from pooling_client.v1 import pooling_pb2_grpc

    texts = mixed_sentences(1024, seed=2) if mixed else sentences(2048, seed=1)
    latencies: list[float] = []

    async def go() -> float:
        # Each client its own connection, as separate callers would be (and as the kernel
        # needs to spread them over --frontends processes); --shared-channel: one for all.
        channels = [
            grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(1 if shared_channel else concurrency)
        ]
        stubs = [pooling_pb2_grpc.PoolingServiceStub(channel) for channel in channels]
        load = _unary if mode == "unary" else _stream
        try:
            await asyncio.gather(*(channel.channel_ready() for channel in channels))
            started = time.perf_counter()
            await load(stubs, texts, concurrency, started + duration, latencies)
            return time.perf_counter() - started
        finally:
            await asyncio.gather(*(channel.close() for channel in channels))

    elapsed = asyncio.run(go())
    return {"elapsed_s": elapsed, "latencies": latencies}


def load(
    address: str, mode: str, concurrency: int, duration: str, procs: int, *flags: str
) -> dict[str, float]:
    """C clients split over `procs` load processes; their latencies merged."""
    shares = [concurrency // procs + (k < concurrency % procs) for k in range(procs)]
    parts = processes.side_by_side(
        [
            ("benchmarks.python_load", address, mode, str(share), duration, *flags)
            for share in shares
            if share
        ]
    )
    latencies = [x for part in parts for x in part["latencies"]]
    return {
        "sentences_per_s": sum(len(p["latencies"]) / p["elapsed_s"] for p in parts),
        "p50_ms": 1000 * percentile(latencies, 0.5),
        "p99_ms": 1000 * percentile(latencies, 0.99),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("address")
    parser.add_argument("mode", choices=("unary", "stream"))
    parser.add_argument("concurrency", type=int)
    parser.add_argument("duration", type=float)
    parser.add_argument("--mixed", action="store_true", help="texts of 5..256 tokens")
    parser.add_argument("--shared-channel", action="store_true", help="one channel for all")
    args = parser.parse_args()
    result = run_load(
        args.address, args.mode, args.concurrency, args.duration, args.mixed, args.shared_channel
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
