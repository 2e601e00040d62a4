"""CPU per one-text call of several source trees, measured in turns within one window.

`--only call-cpu` starts one server at a time, so two trees measured one after another meet
different neighbours on a shared host, which moves CPU per call by more than most changes
do (issue 45: 234-310 us for the same code). Here the loop-bound server of every tree runs
at once in the default layout (--frontends 1, the Node door), idle while not measured, and
rounds of h2load at C=64 go to each in turn, the order reversed every other round. Each
window reads every process's CPU, so a tree is compared with the others under the same
neighbours. It prints each window and the medians, and writes them as JSON.

A tree is a checkout whose `pooling_server` imports from itself: a `pooling_server/` folder
beside `engine/` and `service/` with links to them, as `git archive` of a commit plus
`ln -s ../engine ../service pooling_server/` gives, and `service/grpc/node_modules`.

Run: .venv/bin/python -m benchmarks.call_cpu_pairs --tree base=/tmp/a --tree new=/tmp/b
         [--rounds 10] [--seconds 8] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks import h2load, processes
from benchmarks.servers import _pool_request
from tests.server_process import ServerProcess, free_port

TEXT = "the quick brown fox jumps over the lazy dog"
ROLES = {"frontend": "frontend 0", "node": "node of frontend 0", "engine": "engine 0"}


def start(label: str, tree: str, model: Path, work: Path) -> ServerProcess:
    """`tree`'s server on the loop-bound model, serving; its log in `work`."""
    port = free_port()
    log_path = work / f"{label}-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "pooling_server.service.launch", "--port", str(port)),
                *("--model", f"loop-bound={model}", "--metrics-port", str(free_port())),
                *("--frontends", "1", "--grpc-door", "node"),
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=tree,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )
    server = ServerProcess(process, port, log_path)
    server.wait_serving()
    return server


def window(server: ServerProcess, body: bytes, seconds: float, work: Path) -> dict[str, Any]:
    """One h2load run at C=64: calls/s, each role's CPU per call, and the neighbours' cores."""
    roles = processes.RoleCpu(roles_of=server.process.pid)
    out = h2load.run(
        f"http://127.0.0.1:{server.port}/pooling.v1.PoolingService/Pool",
        body,
        concurrency=64,
        duration_s=seconds,
        warmup_s=2,
        max_connections=8,
        work_dir=work,
        watch={"server": server.process.pid},  # so that other_cores leaves it out
        probes=[roles],
    )
    by_role = out["probes"][0]
    row = {"calls_per_s": out["requests_per_s"], "other_cores": out["other_cores"]}
    for name, role in ROLES.items():
        row[f"{name}_us"] = (by_role.get(role) or {}).get("cpu_us_per_request") or 0.0
    row["serving_us"] = row["frontend_us"] + row["node_us"]
    return row


def summary(rows: list[dict[str, Any]]) -> dict[str, float]:
    serving = [row["serving_us"] for row in rows]
    return {
        "serving_us_median": statistics.median(serving),
        "serving_us_min": min(serving),
        "serving_us_max": max(serving),
        "frontend_us_median": statistics.median(row["frontend_us"] for row in rows),
        "node_us_median": statistics.median(row["node_us"] for row in rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", required=True, help="LABEL=PATH")
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--json-out")
    args = parser.parse_args()
    trees = dict(entry.split("=", 1) for entry in args.tree)
    work = Path(tempfile.mkdtemp(prefix="call-cpu-pairs-"))
    model = work / "loop-bound"
    subprocess.run([sys.executable, "-m", "benchmarks.loop_bound", str(model)], check=True)
    body = h2load.grpc_body(_pool_request(TEXT))
    servers: dict[str, ServerProcess] = {}
    rows: dict[str, list[dict[str, Any]]] = {label: [] for label in trees}
    try:
        for label, tree in trees.items():
            servers[label] = start(label, tree, model, work)
        for turn in range(args.rounds):
            order = list(trees) if turn % 2 == 0 else list(reversed(trees))
            for label in order:
                row = {"round": turn, **window(servers[label], body, args.seconds, work / "h2")}
                rows[label].append(row)
                print(
                    f"{time.strftime('%H:%M:%S')} {label:8} round {turn}: "
                    f"{row['calls_per_s']:7.0f} calls/s, front end + Node {row['serving_us']:4.0f}"
                    f" us (front end {row['frontend_us']:3.0f}, Node {row['node_us']:3.0f}), "
                    f"engine {row['engine_us']:3.0f}, others {row['other_cores']:.2f} cores",
                    flush=True,
                )
    finally:
        for server in servers.values():
            server.stop()
    result = {"trees": trees, "rounds": rows, "summary": {k: summary(v) for k, v in rows.items()}}
    print("front end + Node, us a call: median [min-max] (front end; Node)")
    for label, figures in result["summary"].items():
        print(
            f"{label:8} {figures['serving_us_median']:4.0f} [{figures['serving_us_min']:.0f}-"
            f"{figures['serving_us_max']:.0f}] ({figures['frontend_us_median']:.0f}; "
            f"{figures['node_us_median']:.0f})"
        )
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
