"""Loading MiniLM at run time against starting a server with it (issue 46's benchmark).

Three figures, each the median of --rounds:

- cold start: `pooling-server --model minilm=MINILM` from launch to SERVING;
- run-time load: a ModelRepositoryService Load of MiniLM under a second name on a server
  already serving (answered once loaded and warm), and its Unload;
- on demand: the first call naming MiniLM in --model-repository (its load included), and
  the next call.

    python -m benchmarks.model_loading --rounds 3
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pooling_client import PoolingClient
from tests.fixture_models import MINILM
from tests.server_process import free_port

ADMIN = "bench-admin"
SERVER = [sys.executable, "-m", "pooling_server.service.launch"]
FLAGS = ["--backend", "torch", "--dtype", "float32", "--frontends", "1"]


def serve(args: list[str], log: Path) -> tuple[subprocess.Popen[bytes], str, float]:
    """A server started and waited for: (its process, its address, seconds to SERVING)."""
    port = free_port()
    started = time.perf_counter()
    with log.open("ab") as out:
        process = subprocess.Popen([*SERVER, "--port", str(port), *args], stdout=out, stderr=out)
    address = f"127.0.0.1:{port}"
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                answer = health.Check(health_pb2.HealthCheckRequest(), timeout=1)
                if answer.status == health_pb2.HealthCheckResponse.SERVING:
                    return process, address, time.perf_counter() - started
            except grpc.RpcError:
                pass
            if process.poll() is not None:
                raise SystemExit(f"the server exited: see {log}")
            time.sleep(0.05)


def stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    process.wait(60)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="model-loading-"))
    repository = work / "repository.json"
    entry = {"source": str(MINILM), "options": {"backend": "torch"}}
    repository.write_text(json.dumps({"minilm-demand": entry}))
    log = work / "servers.log"
    cold, loads, unloads, first, second = [], [], [], [], []
    for _ in range(args.rounds):
        process, _, seconds = serve(["--model", f"minilm={MINILM}", *FLAGS], log)
        cold.append(seconds)
        stop(process)
    admin_flags = ["--admin-key", ADMIN, "--model-repository", str(repository)]
    process, address, _ = serve(["--model", f"minilm={MINILM}", *FLAGS, *admin_flags], log)
    try:
        with PoolingClient(address, timeout=600, admin_key=ADMIN) as client:
            client.embed(["warm"], model="minilm")
            for _ in range(args.rounds):
                started = time.perf_counter()
                client.load_model("minilm-2", str(MINILM), options={"backend": "torch"})
                loads.append(time.perf_counter() - started)
                started = time.perf_counter()
                client.unload_model("minilm-2")
                unloads.append(time.perf_counter() - started)
            for _ in range(args.rounds):
                started = time.perf_counter()
                client.embed(["the first call loads it"], model="minilm-demand")
                first.append(time.perf_counter() - started)
                started = time.perf_counter()
                client.embed(["the next call"], model="minilm-demand")
                second.append(time.perf_counter() - started)
                client.unload_model("minilm-demand")
    finally:
        stop(process)
    for label, values in (
        ("cold server start to SERVING", cold),
        ("run-time Load (answered once warm)", loads),
        ("run-time Unload", unloads),
        ("on demand: first call, load included", first),
        ("on demand: the next call", second),
    ):
        print(f"{label:40s} median {statistics.median(values):7.3f} s  ({len(values)} rounds)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
