"""The ceiling a host puts on the MiniLM C=64 ratio: how fast each backend's forward pass alone
runs here, against in-process sentence-transformers, in one run.

The server's calls/s at C=64 cannot beat its backend's own forward rate at the batch sizes it
forms, so `auto`'s rate over sentence-transformers' best is the most the served ratio can
reach on this host. That ceiling moves with the CPU's vector units: OpenVINO infers in
bfloat16 where the CPU has AVX-512 BF16 and doubles its lead there, while on an AVX2-only
host both backends run float32 near the same FLOP roof. The matmul rows give that roof.

Run: .venv/bin/python -m benchmarks.roof [--seconds 2] [--rounds 5] [--json-out FILE]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.backends import _load, _rate, cpu
from benchmarks.report import code_version
from benchmarks.workload import _default_model_path, sentences

BATCHES = (32, 128)
CONFIGS = (("torch fp32", "torch"), ("openvino fp32", "openvino"), ("auto", "auto"))


def matmul_gflops(threads: int, seconds: float) -> float:
    """Float32 GFLOPS of a (512 x 384) @ (384 x 1536) product, MiniLM's feed-forward shape."""
    import torch

    torch.set_num_threads(threads)
    a, b = torch.randn(512, 384), torch.randn(384, 1536)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for _ in range(20):
            a @ b
        done += 20
    return 2 * 512 * 384 * 1536 * done / (time.perf_counter() - started) / 1e9


class _SentenceTransformers:
    """sentence-transformers' own encode, in the runner's shape so rounds treat both alike."""

    def __init__(self) -> None:
        from sentence_transformers import SentenceTransformer

        self.model = SentenceTransformer(str(_default_model_path()), device="cpu")

    def rate(self, texts: list[str], batch: int, seconds: float) -> float:
        done, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            self.model.encode(texts, batch_size=batch)
            done += len(texts)
        return done / (time.perf_counter() - started)


def run(seconds: float, rounds: int) -> dict[str, Any]:
    """Every model loaded first, then `rounds` rounds measuring each in turn, so a host
    whose speed drifts meets every row alike; each figure is the median of its rounds."""
    import torch

    logging.disable(logging.WARNING)
    threads = len(os.sched_getaffinity(0))
    texts = sentences(256, seed=1, min_words=6, max_words=10)
    result: dict[str, Any] = {"code": code_version(), "cpu": cpu(), "threads": threads}
    result["matmul_gflops"] = {n: matmul_gflops(n, seconds) for n in sorted({1, threads})}
    torch.set_num_threads(threads)
    cache = Path(tempfile.mkdtemp(prefix="bench-roof-cache-"))
    try:
        reference = _SentenceTransformers()
        rows: dict[str, Any] = {
            "sentence-transformers": lambda b: reference.rate(texts, b, seconds)
        }
        for name, kind in CONFIGS:
            model = _load(kind, "none", cache, threads)
            label = f"{name} ({model.info.backend} {model.info.precision})"
            rows[label] = lambda b, model=model: _rate(model, texts, b, seconds)
        samples: dict[str, dict[int, list[float]]] = {n: {b: [] for b in BATCHES} for n in rows}
        for index in range(rounds):
            order = list(rows) if index % 2 == 0 else list(reversed(rows))
            for name in order:
                for batch in BATCHES:
                    samples[name][batch].append(rows[name](batch))
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    rates = {n: {b: statistics.median(v) for b, v in by.items()} for n, by in samples.items()}
    best_st = max(rates["sentence-transformers"].values())
    result["rounds"] = rounds
    result["texts_per_s"] = rates
    result["ceiling_over_st_best"] = {n: max(by.values()) / best_st for n, by in rates.items()}
    return result


def format_result(result: dict[str, Any]) -> str:
    host = result["cpu"]
    lines = [
        f"host: {host['model']}, {host['cores']} cores, SIMD: {', '.join(host['simd'])}",
        "matmul float32: "
        + ", ".join(f"{n} thread(s) {g:.0f} GFLOPS" for n, g in result["matmul_gflops"].items()),
        f"{'forward alone':44s}" + "".join(f"  batch {b:>3}/s" for b in BATCHES) + "  best/ST best",
    ]
    for name, by_batch in result["texts_per_s"].items():
        cells = "".join(f"  {by_batch[b]:11.1f}" for b in BATCHES)
        lines.append(f"{name:44s}{cells}  {result['ceiling_over_st_best'][name]:12.2f}")
    lines.append(f"medians of {result['rounds']} rounds; code: {result['code']}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=2.0, help="seconds per measurement")
    parser.add_argument("--rounds", type=int, default=5, help="rounds over every row")
    parser.add_argument("--json-out", help="also write the result as JSON here")
    args = parser.parse_args()
    result = run(args.seconds, args.rounds)
    print(format_result(result))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()
