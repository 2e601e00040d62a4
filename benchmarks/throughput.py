"""Throughput and latency of the server against the in-process sentence-transformers limit.

One run measures, side by side on this machine, each part in its own process so that no
measurement pays for another's threads:
  1. sentence-transformers `encode` in-process, at its best batch size and at batch 1;
  2. the server on a free port, C concurrent closed-loop clients (asyncio, spread over
     --load-procs processes) sending one text per request through unary Pool and PoolStream;
  3. a mixed-length workload (5..256 tokens), reporting the padded-token efficiency
     (real tokens / computed tokens) from the server's Prometheus metrics.

On a GPU the reference runs in the dtype the server picks (bfloat16 where supported).

--load h2load drives unary Pool with h2load (C, not Python: the load generator no longer
competes with the server for the CPU) and measures, in the same run, the in-process
reference, a bare grpc.aio "floor" server that does no work (benchmarks/floor_server.py), a
"loop-bound" server on a 1-layer hidden-32 BERT whose forward pass costs next to nothing (its
rate is the server's own per-request cost), and the server on the real model. --profile adds
where the loop-bound server's CPU goes per request (per thread, and per function by py-spy).
These rows run the whole server in one process (--frontends 0), loop-bound behind grpcio's
door (--grpc-door grpcio). loop-bound-node, -node-f1 and -node-f2 run the loop-bound server
behind the Node.js gRPC door (--grpc-door node, what the default `auto` picks where Node.js is
on PATH), in one process, in the default layout (--frontends 1) and with two front ends. The
MiniLM and stand-in rows take the default door.

The split server (issue 12), by --only (the group `frontends` runs them all):
  - minilm-f1: the default layout (--frontends 1: a supervisor, an engine process, a front
    end) on MiniLM, against `minilm` (--frontends 0) and the in-process reference;
  - stand-in-f0/f1/f2: the server with --frontends 0, 1 and 2 in front of a stand-in device
    (benchmarks/stand_in.py: --stand-in-batch-ms per batch of up to 256, sleeping), so the
    rate is what the front ends can answer; the split rows give each process's CPU;
  - memory: resident memory over the process tree of --frontends N against N whole
    single-process servers on their own ports, N = 1, 2, on MiniLM.

CPU per call (issue 36), by --only call-cpu: the floors, then the loop-bound model in the
default layout (--frontends 1) on each door, call-cpu-node and call-cpu-grpcio, side by side:
calls/s, the ratio to the faster floor, and CPU per call of each process and summed over the
processes that serve calls (the front end and its Node.js door child; not the supervisor or
the engine).

The command line is here; each role is a module of its own: reference.py (in-process
sentence-transformers), python_load.py and h2load.py (the load drivers), rows.py (what each
row starts and measures), report.py (what is printed), processes.py (which process is which,
and what CPU it used).

Run: .venv/bin/python -m benchmarks.throughput [--json] [--duration 8] [--model PATH]
     .venv/bin/python -m benchmarks.throughput --load h2load [--only floor,loop-bound]
         [--duration 10] [--profile] [--json-out FILE]
     .venv/bin/python -m benchmarks.throughput --load h2load --only frontends --concurrency 64
         [--stand-in-concurrency 64,256] [--duration 5]
     .venv/bin/python -m benchmarks.throughput --load h2load --only call-cpu --concurrency 64
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks import loop_bound, report, rows


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument(
        "--load",
        choices=["python", "h2load"],
        default="python",
        help="python: asyncio clients, unary and stream; h2load: unary Pool driven by h2load, "
        "with the floor and loop-bound rows",
    )
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per load level")
    parser.add_argument(
        "--concurrency",
        help="concurrent calls to run (default: python 1,16,64,256; h2load 64,1)",
    )
    parser.add_argument("--server-arg", action="append", default=[], help="extra server flag")
    parser.add_argument("--model", help="model folder (default: the embedded all-MiniLM-L6-v2)")
    parser.add_argument(
        "--load-procs", type=int, default=0, help="load processes (default: 1, 4 on > 4 cores)"
    )
    h2 = parser.add_argument_group("--load h2load")
    h2.add_argument(
        "--only",
        help=f"comma-separated rows out of {','.join(rows.H2LOAD_ROWS)}, or the groups "
        + "; ".join(f"{k} ({','.join(v)})" for k, v in rows.ROW_GROUPS.items())
        + ". Default: reference,floor,loop-bound,loop-bound-node(-f1,-f2),minilm",
    )
    h2.add_argument("--warmup", type=float, default=2.0, help="h2load warm-up seconds per level")
    h2.add_argument(
        "--h2load-connections",
        type=int,
        default=8,
        help="at most this many connections, C/connections streams on each",
    )
    h2.add_argument("--floor-dims", type=int, default=loop_bound.HIDDEN, help="floor's floats")
    h2.add_argument(
        "--profile", action="store_true", help="where the --profile-row server's CPU goes"
    )
    h2.add_argument("--profile-row", default="loop-bound", choices=rows.PROFILE_ROWS)
    h2.add_argument("--profile-rate", type=int, default=250, help="py-spy samples per second")
    h2.add_argument(
        "--profile-native",
        action="store_true",
        help="py-spy --native: C and Cython frames too, but it pauses the server per sample",
    )
    h2.add_argument(
        "--profile-gil",
        action="store_true",
        help="py-spy --gil: only the thread holding the GIL, so the figures are GIL time",
    )
    h2.add_argument(
        "--wait-quiet",
        type=float,
        default=0.0,
        help="before each run wait up to this many seconds for the machine to go idle",
    )
    h2.add_argument(
        "--max-other-cores",
        type=float,
        default=None,
        help="measure a row again when other processes used more cores than this meanwhile",
    )
    h2.add_argument("--retries", type=int, default=2, help="at most this many re-measurements")
    h2.add_argument("--json-out", help="also write the JSON result to this file")
    h2.add_argument(
        "--stand-in-batch-ms",
        type=float,
        default=2.0,
        help="the stand-in device's time per batch (of up to 256 items)",
    )
    h2.add_argument(
        "--stand-in-concurrency",
        default="64,256",
        help="concurrent calls for the stand-in rows",
    )
    h2.add_argument(
        "--memory-load",
        type=float,
        default=2.0,
        help="seconds of C=64 load on each server before its memory is read (memory row)",
    )
    parser.add_argument(
        "--backends",
        action="store_true",
        help="the backend rows instead (benchmarks/backends.py): MiniLM on torch, onnx and "
        "openvino, fp32 and int8, in-process and through the server with h2load",
    )
    parser.add_argument(
        "--backend-seconds", type=float, default=4.0, help="seconds per in-process backend row"
    )
    parser.add_argument(
        "--shared-channel", action="store_true", help="all clients of a load process share one"
    )
    return parser


def main() -> None:
    parser = build_parser()
    args = parser.parse_args()
    if args.backends:
        from benchmarks import backends

        args.work_dir = tempfile.mkdtemp(prefix="bench-backends-")
        result = backends.run(args)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(
            json.dumps(result, indent=2, default=str) if args.json else backends.format_rows(result)
        )
    elif args.load == "h2load":
        result = rows.run_h2load(args, report.code_version())
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(
            json.dumps(result, indent=2, default=str) if args.json else report.format_h2load(result)
        )
    else:
        if args.only or args.profile:
            parser.error("--only and --profile go with --load h2load")
        result = rows.run_python(args)
        if args.json:
            print(json.dumps({"summary": result["summary"], "rows": result["rows"]}, indent=2))
        else:
            print(report.format_python(result))


if __name__ == "__main__":
    main()
