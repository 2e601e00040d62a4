"""The request path without a door: CPU per call through the runner, in-process.

C coroutines each parse a PoolRequest from protobuf, run it through the request runner (the
engine's validation, tokenizer thread, batching queue and forward workers, telemetry) and
render the protobuf answer, in a loop on the server's event loop, for --seconds after a
warm-up. It prints calls/s, the process's CPU per call (`time.process_time`) and its cores.

Through h2load the same path sits behind grpc.aio, whose share and this host's swings
(2x within minutes) hide a cut of a few percent; here a change to the per-call Python shows
in the CPU per call, which moves far less with the host. The default model is the benchmark's
loop-bound model (a 1-layer, hidden-32 BERT: its forward pass costs next to nothing), built
in a temporary folder. Compare two trees by running this module from each, alternately.

Run: .venv/bin/python -m benchmarks.runner_path [--concurrency 64] [--seconds 5]
         [--rounds 3] [--backend auto] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

TEXT = "the quick brown fox jumps over the lazy dog near the river bank"


async def measure(args: argparse.Namespace, folder: str) -> list[dict[str, float]]:
    from pooling_server.engine.backends import BackendKind, BackendOptions
    from pooling_server.engine.models.model_spec import ModelSpec
    from pooling_server.service.grpc import convert
    from pooling_server.service.loading import load_engine
    from pooling_server.service.ops.config import ServerConfig
    from pooling_server.service.ops.metrics import Metrics
    from pooling_server.service.ops.telemetry import Telemetry
    from pooling_server.service.proto import pooling_pb2 as pb
    from pooling_server.service.runner import Call, RequestRunner

    spec = ModelSpec(folder, name="model", backend=BackendOptions(BackendKind(args.backend)))
    engine = await asyncio.to_thread(load_engine, ServerConfig(models=[spec], device="cpu"))
    await engine.start()
    runner = RequestRunner(Telemetry(Metrics()))
    runner.engine = engine
    call = Call(protocol="grpc", rpc="Pool", client="runner-path")
    wire = pb.PoolRequest(embed=pb.TextInput(texts=[TEXT])).SerializeToString()
    done, running = 0, True

    async def client() -> None:
        nonlocal done
        while running:
            request = convert.request_from_proto(pb.PoolRequest.FromString(wire))
            ran = await runner.pool(request, call, convert.response_to_proto)
            ran.result.SerializeToString()
            done += 1

    clients = [asyncio.create_task(client()) for _ in range(args.concurrency)]
    rounds = []
    try:
        await asyncio.sleep(args.warmup)
        for _ in range(args.rounds):
            calls, cpu, wall = done, time.process_time(), time.perf_counter()
            await asyncio.sleep(args.seconds)
            calls, cpu, wall = done - calls, time.process_time() - cpu, time.perf_counter() - wall
            rounds.append(
                {
                    "calls_per_s": calls / wall,
                    "cpu_us_per_call": 1e6 * cpu / calls,
                    "cores": cpu / wall,
                }
            )
    finally:
        running = False
        await asyncio.gather(*clients)
        await engine.stop()
    return rounds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=5.0, help="per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=2.0)
    parser.add_argument("--backend", default="auto", help="as the server's --backend")
    parser.add_argument("--model", help="a model folder (default: the loop-bound model)")
    parser.add_argument("--event-loop", default="auto", help="as the server's --event-loop")
    parser.add_argument("--json", action="store_true", help="print the rounds as JSON")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)

    from benchmarks import loop_bound
    from pooling_server.service.ops import event_loop

    with tempfile.TemporaryDirectory(prefix="runner-path-") as work:
        folder = args.model or loop_bound.build(str(Path(work) / "model"))["folder"]
        rounds = event_loop.run(measure(args, folder), args.event_loop)
    if args.json:
        print(json.dumps(rounds, indent=1))
        return
    for r in rounds:
        print(
            f"C={args.concurrency} calls/s {r['calls_per_s']:.0f}  "
            f"CPU {r['cpu_us_per_call']:.0f} us/call  cores {r['cores']:.2f}"
        )
    median: dict[str, Any] = {k: statistics.median(r[k] for r in rounds) for k in rounds[0]}
    print(
        f"median: calls/s {median['calls_per_s']:.0f}, CPU {median['cpu_us_per_call']:.0f} us/call"
    )


if __name__ == "__main__":
    main()
