"""The servers under test: the project's server (or a stand-in wrapping it) and the bare
"floor" server on free ports, one real gRPC call that checks a server's answers, and one
h2load run against a server with the server's own count of answers by status.
benchmarks/throughput.py's rows and backends.py's server rows both use them.
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

POOL_PATH = "/pooling.v1.PoolingService/Pool"


@dataclass
class Target:
    """A server under test: where it listens, its process, what a correct answer looks like."""

    name: str
    address: str
    pid: int
    dims: int
    metrics_port: int | None
    stop: Callable[[], object]


def _pool_request(text: str) -> Any:
    from pooling_client.v1 import pooling_pb2 as pb

    return pb.PoolRequest(embed=pb.TextInput(texts=[text]))


def verify_pool(target: Target, text: str) -> None:
    """One real gRPC call: h2load would count a failing call (HTTP 200, grpc-status != 0) as
    a success, so a server that answers errors must not get as far as being measured."""
    import grpc

    from pooling_client.v1 import pooling_pb2_grpc

    with grpc.insecure_channel(target.address) as channel:
        response = pooling_pb2_grpc.PoolingServiceStub(channel).Pool(
            _pool_request(text), timeout=60
        )
    embeddings = response.embed.embeddings if response.WhichOneof("output") == "embed" else []
    values = list(embeddings[0].values) if len(embeddings) == 1 else []
    if len(values) != target.dims or not all(math.isfinite(v) for v in values):
        raise RuntimeError(f"{target.name}: unexpected Pool response {response}")


def start_floor(dims: int, event_loop: str = "auto") -> Target:
    from tests.server_process import free_port

    port = free_port()
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "benchmarks.floor_server", "--port", str(port)),
            *("--dims", str(dims), "--event-loop", event_loop),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None
    if "ready" not in process.stdout.readline():
        process.kill()
        raise RuntimeError(f"floor server did not start (exit {process.wait()})")

    def stop() -> None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    return Target(
        "floor" if event_loop == "auto" else f"floor-{event_loop}",
        f"127.0.0.1:{port}",
        process.pid,
        dims,
        None,
        stop,
    )


def start_project_server(
    name: str,
    model: str,
    dims: int,
    server_args: list[str],
    log_dir: Path,
    module: str = "pooling_server.service.launch",
    env: dict[str, str] | None = None,
    tree: Path | None = None,
) -> Target:
    """The project's server (or `module`, a stand-in wrapping it) on a free port, SERVING;
    `tree`: the source tree whose code it runs (`-m` imports from the working directory).

    As tests/server_process.start_server, which always runs pooling_server.service.launch."""
    from tests.server_process import ServerProcess, free_port

    port, metrics_port = free_port(), free_port()
    log_path = log_dir / f"{name}-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", module, "--port", str(port)),
                *("--model", f"{name}={model}", "--metrics-port", str(metrics_port)),
                *server_args,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})},
            cwd=tree,
        )
    server = ServerProcess(process, port, log_path)
    try:
        server.wait_serving()
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return Target(name, server.address, process.pid, dims, metrics_port, server.stop)


def _calls_by_code(target: Target) -> dict[str, float]:
    from tests.metrics_endpoint import scrape

    if target.metrics_port is None:
        return {}
    codes: dict[str, float] = {}
    for sample in scrape(target.metrics_port).get("pooling_requests_total", []):
        code = sample.labels.get("code", "?")
        codes[code] = codes.get(code, 0.0) + sample.value
    return codes


def _measure(
    target: Target,
    body: bytes,
    concurrency: int,
    args: argparse.Namespace,
    probes: list[Any],
    watch: bool = True,
) -> dict[str, Any]:
    """One h2load run against target, with the server's own count of answers by status."""
    from benchmarks import h2load, processes

    busy = processes.wait_quiet(args.wait_quiet) if args.wait_quiet else None
    before = _calls_by_code(target)
    row = h2load.run(
        f"http://{target.address}{POOL_PATH}",
        body,
        concurrency=concurrency,
        duration_s=args.duration,
        warmup_s=args.warmup,
        max_connections=args.h2load_connections,
        work_dir=Path(args.work_dir),
        watch={"server": target.pid} if watch else None,
        probes=probes,
    )
    row["machine_busy_cores_before"] = busy
    if target.metrics_port is not None:
        # Every call the server answered in this run, warm-up included: h2load cannot see
        # grpc-status, the server's own counter can.
        after = _calls_by_code(target)
        row["server_calls_by_code"] = {
            k: v - before.get(k, 0.0) for k, v in after.items() if v != before.get(k, 0.0)
        }
    return row
