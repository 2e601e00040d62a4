"""Two server configurations side by side, measured in alternating short h2load bursts.

This machine's speed moves by up to 2x within minutes, more than most changes are worth,
so two whole benchmark runs compared say little. Here both servers run at once, each idle
while the other is measured, and the bursts go A, B, A, B: each round's ratio B/A comes
from bursts seconds apart, and the figure is the median of the rounds' ratios, with how
many rounds B led. A and B differ in their server flags, their source tree (another
checkout, e.g. `git worktree add /tmp/before HEAD~1`, sharing this one's .venv), or both.

Run: .venv/bin/python -m benchmarks.alternate --a "--frontends 0" --b "--frontends 1"
     .venv/bin/python -m benchmarks.alternate --a-tree /tmp/before [--concurrency 1,64]
         [--rounds 8] [--burst 4] [--texts 1] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import statistics
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
POOL_PATH = "/pooling.v1.PoolingService/Pool"


def _burst(server: Any, body: bytes, concurrency: int, seconds: float, work: Path) -> dict:
    from benchmarks import h2load

    row = h2load.run(
        f"http://{server.address}{POOL_PATH}",
        body,
        concurrency=concurrency,
        duration_s=seconds,
        warmup_s=0.5,
        max_connections=8,
        work_dir=work,
    )
    return {"calls_per_s": row["requests_per_s"], "mean_ms": row.get("mean_ms")}


def run(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks import h2load
    from benchmarks.servers import start_project_server
    from benchmarks.workload import _default_model_path, sentences
    from pooling_client.v1 import pooling_pb2 as pb

    name, _, path = (args.model or f"minilm={_default_model_path()}").partition("=")
    texts = sentences(args.texts, seed=2 if args.texts == 1 else 3)[: args.texts]
    body = h2load.grpc_body(pb.PoolRequest(embed=pb.TextInput(texts=texts)))
    work = Path(tempfile.mkdtemp(prefix="alternate-"))
    sides = {
        "a": (Path(args.a_tree or ROOT), shlex.split(args.a)),
        "b": (Path(args.b_tree or ROOT), shlex.split(args.b)),
    }
    servers: dict[str, Any] = {}
    result: dict[str, Any] = {
        "a": {"tree": str(sides["a"][0]), "flags": args.a},
        "b": {"tree": str(sides["b"][0]), "flags": args.b},
        "levels": {},
    }
    try:
        for label, (tree, flags) in sides.items():
            servers[label] = start_project_server(name, path, 0, flags, work, tree=tree)
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            for server in servers.values():  # warm both at this level
                _burst(server, body, concurrency, 2.0, work)
            rounds = []
            for _ in range(args.rounds):
                a = _burst(servers["a"], body, concurrency, args.burst, work)
                b = _burst(servers["b"], body, concurrency, args.burst, work)
                rounds.append({"a": a, "b": b, "b_over_a": b["calls_per_s"] / a["calls_per_s"]})
            ratios = [r["b_over_a"] for r in rounds]
            result["levels"][str(concurrency)] = {
                "rounds": rounds,
                "median_b_over_a": statistics.median(ratios),
                "b_ahead": sum(ratio > 1 for ratio in ratios),
            }
    finally:
        for server in servers.values():
            server.stop(signal.SIGTERM)
    return result


def format_result(result: dict[str, Any]) -> str:
    lines = [
        f"A: {result['a']['tree']} {result['a']['flags']}",
        f"B: {result['b']['tree']} {result['b']['flags']}",
    ]
    for concurrency, level in result["levels"].items():
        lines.append(f"C={concurrency}   A calls/s (mean ms)   B calls/s (mean ms)   B/A")
        for r in level["rounds"]:
            a, b = r["a"], r["b"]
            lines.append(
                f"  {a['calls_per_s']:8.1f} ({a['mean_ms']:7.2f})    "
                f"{b['calls_per_s']:8.1f} ({b['mean_ms']:7.2f})    {r['b_over_a']:.3f}"
            )
        lines.append(
            f"  median B/A {level['median_b_over_a']:.3f}; "
            f"B ahead in {level['b_ahead']} of {len(level['rounds'])} rounds"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--a", default="", help="server flags of A (one string)")
    parser.add_argument("--b", default="", help="server flags of B (one string)")
    parser.add_argument("--a-tree", help="source tree of A (default: this one)")
    parser.add_argument("--b-tree", help="source tree of B (default: this one)")
    parser.add_argument("--model", help="NAME=PATH (default: the embedded MiniLM)")
    parser.add_argument("--concurrency", default="1,64")
    parser.add_argument("--texts", type=int, default=1, help="texts per call (32: C=8 x 32)")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--burst", type=float, default=4.0, help="seconds per burst")
    parser.add_argument("--json-out", help="also write the result as JSON here")
    args = parser.parse_args()
    if args.a == args.b and args.a_tree == args.b_tree:
        parser.error("A and B are the same: give other --a/--b flags or another --a-tree")
    result = run(args)
    print(format_result(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
