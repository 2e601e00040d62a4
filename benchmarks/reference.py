"""The in-process reference: sentence-transformers' own `encode` of the same texts, on the
same machine, the figure the server's rates are held against (at its best batch size, and at
batch 1 for latency). On a GPU it runs in the dtype the server picks (bfloat16 where
supported).

It runs in a process of its own (`python -m benchmarks.reference MODEL` prints one line of
JSON), so that torch's threads share the machine with nothing of the benchmark's.
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from benchmarks import processes
from benchmarks.workload import sentences


def best_encode_rate(model: Any, texts: list[str], batches: tuple[int, ...]) -> tuple[float, int]:
    """sentence-transformers' encode of `texts` at each batch size: (best texts/s, its batch)."""
    best, best_batch = 0.0, 0
    for batch in batches:
        started = time.perf_counter()
        model.encode(texts, batch_size=batch)
        rate = len(texts) / (time.perf_counter() - started)
        if rate > best:
            best, best_batch = rate, batch
    return best, best_batch


def run_reference(model_path: str) -> dict[str, Any]:
    from sentence_transformers import SentenceTransformer

    from pooling_server.engine.models.loader import resolve_device, resolve_dtype

    device = resolve_device("auto")
    dtype = resolve_dtype("auto", device)
    batches = (32, 64, 128) if device.type == "cpu" else (64, 128, 256, 512)
    texts = sentences(2048 if device.type == "cpu" else 16384, seed=1)
    model = SentenceTransformer(model_path, device=str(device), model_kwargs={"dtype": dtype})
    model.encode(texts[:1024], batch_size=64)
    best, best_batch = best_encode_rate(model, texts, batches)
    latencies = []
    for text in texts[:300]:
        started = time.perf_counter()
        model.encode([text], batch_size=1)
        latencies.append(time.perf_counter() - started)
    return {
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "best_sentences_per_s": best,
        "best_batch": best_batch,
        "batch1_sentences_per_s": 1 / statistics.mean(latencies),
        "batch1_mean_ms": 1000 * statistics.mean(latencies),
        "batch1_p50_ms": 1000 * statistics.median(latencies),
    }


def in_own_process(model: str) -> dict[str, Any]:
    (reference,) = processes.side_by_side([("benchmarks.reference", model)])
    return reference


def measure(model: str, wait_quiet: float) -> dict[str, Any]:
    """The reference in its own process, with what the rest of the machine used meanwhile."""
    if wait_quiet:
        processes.wait_quiet(wait_quiet)
    busy, children = processes.machine_busy(), processes.children_cpu()
    started = time.perf_counter()
    reference = in_own_process(model)
    seconds = time.perf_counter() - started
    # The reference uses every core; whatever else ran took cores from it.
    reference["other_cores"] = (
        processes.machine_busy() - busy - (processes.children_cpu() - children)
    ) / seconds
    return reference


if __name__ == "__main__":
    import json

    print(json.dumps(run_reference(sys.argv[1])))
