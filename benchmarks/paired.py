"""What the side-by-side benchmarks (two ways of doing the same work, timed back to back in
each round) share: the rounds themselves, the milliseconds summary, the result's header
and the command line, so each benchmark says only what it compares and how it reports."""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.report import code_version


def time_pair(
    first: Callable[[], object],
    second: Callable[[], object],
    rounds: int,
    warmup: int,
    sync: Callable[[], None] = lambda: None,
) -> tuple[list[float], list[float]]:
    """`warmup` untimed rounds, then `rounds` rounds timing `first` then `second` (seconds).
    `sync` runs before and after `first` (a CUDA synchronize when `first` runs on this
    process's GPU), so its time includes the device's work."""
    for _ in range(warmup):
        first()
        second()
    firsts, seconds = [], []
    for _ in range(rounds):
        sync()
        started = time.perf_counter()
        first()
        sync()
        firsts.append(time.perf_counter() - started)
        started = time.perf_counter()
        second()
        seconds.append(time.perf_counter() - started)
    return firsts, seconds


def milliseconds(times: list[float]) -> dict[str, float]:
    """The median and the fastest of `times` (seconds), in milliseconds."""
    return {"median": 1000 * statistics.median(times), "min": 1000 * min(times)}


def header(benchmark: str, device: Any, dtype: Any) -> dict[str, Any]:
    """The fields every result starts with: what ran, on which code, where and how."""
    import torch

    return {
        "benchmark": benchmark,
        "code": code_version(),
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "torch_threads": torch.get_num_threads(),
    }


def parser(description: str) -> argparse.ArgumentParser:
    """The flags both sides share (rounds, warm-up, the model's folder, extra server flags,
    the JSON output); a benchmark adds its own."""
    parsed = argparse.ArgumentParser(description=description)
    parsed.add_argument("--rounds", type=int, default=20)
    parsed.add_argument("--warmup", type=int, default=3)
    parsed.add_argument("--folder", help="where the model is built (kept); default: a temp dir")
    parsed.add_argument(
        "--server-arg", action="append", default=[], help="an extra server flag (repeatable)"
    )
    parsed.add_argument("--output", help="also write the result as JSON here")
    return parsed


def run_and_report(
    args: argparse.Namespace,
    run: Callable[[argparse.Namespace], dict[str, Any]],
    format_result: Callable[[dict[str, Any]], str],
) -> None:
    """Run, print the summary, and write the result as JSON where --output says."""
    result = run(args)
    print(format_result(result))
    if args.output:
        Path(args.output).write_text(json.dumps(result, indent=2) + "\n")
