"""The result cache (docs/cache.md, issue 47) against no cache, on the shipped MiniLM.

Three rows, each printed side by side:

1. Calls/s over a corpus where half the texts repeat (--unique texts, each sent twice in
   a shuffled order, --texts-per-call texts a call, --concurrency calls in flight): the
   server without the cache and with --cache-mb, both up, in alternating rounds. Target: 1.8x
   (2x is the most it can reach: half the calls still compute).
2. The cached server's CPU per item (every process of it, psutil) over calls that all
   miss (new texts), then over the same calls again, all hits.
3. The shared tier's hit cost on a redis-server on loopback: a look-up of one key, and of
   32 keys in one round trip (ResultCache.find with no memory tier), median and p99.
   Target: at most 1 ms a hit.

The host is shared and noisy (other work runs beside it): each row says how busy the
machine was, and figures should be read side by side, not against other runs.

Run: python -m benchmarks.cache [--unique 1000] [--concurrency 16] [--rounds 3]
     [--texts-per-call 1]
     [--out benchmarks/results/cache.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.processes import ProcessCpu, wait_quiet
from benchmarks.servers import Target, start_project_server
from benchmarks.workload import _default_model_path, sentences

DIMS = 384


async def _drive(address: str, texts: list[str], concurrency: int, per_call: int = 1) -> float:
    """Send the texts as embed calls of `per_call` texts, `concurrency` in flight; the
    seconds it took."""
    import grpc

    from pooling_client.v1 import pooling_pb2 as pb
    from pooling_client.v1 import pooling_pb2_grpc

    queue = [texts[i : i + per_call] for i in range(0, len(texts), per_call)][::-1]
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pooling_pb2_grpc.PoolingServiceStub(channel)

        async def worker() -> None:
            while queue:
                call = queue.pop()
                answer = await stub.Pool(pb.PoolRequest(embed=pb.TextInput(texts=call)))
                assert [len(e.values) for e in answer.embed.embeddings] == [DIMS] * len(call)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started


def drive(target: Target, texts: list[str], concurrency: int, per_call: int = 1) -> float:
    return asyncio.run(_drive(target.address, texts, concurrency, per_call))


def half_repeating(unique: int, seed: int) -> list[str]:
    texts = sentences(unique, seed)
    corpus = texts + texts
    random.Random(seed).shuffle(corpus)
    return corpus


def calls_row(model: Path, logs: Path, args: argparse.Namespace) -> dict[str, Any]:
    """Both servers up at once, each idle while the other runs; each round a fresh corpus
    (new texts, so the cache starts the round cold) goes to one then the other, the order
    swapped every round, and the ratio is the median of the rounds' ratios."""
    warm = sentences(64, seed=99)
    servers = {}
    try:
        for name, flags in (("no cache", []), ("cache", ["--cache-mb", str(args.cache_mb)])):
            servers[name] = start_project_server("minilm", str(model), DIMS, flags, logs)
            drive(servers[name], warm, args.concurrency)
        rounds: list[dict[str, Any]] = []
        for index in range(args.rounds):
            corpus = half_repeating(args.unique, seed=1000 * (index + 1))
            order = list(servers) if index % 2 == 0 else list(reversed(servers))
            this: dict[str, Any] = {}
            for name in order:
                busy = wait_quiet(10)  # the busy cores seen last, before the burst
                seconds = drive(servers[name], corpus, args.concurrency, args.texts_per_call)
                calls = -(-len(corpus) // args.texts_per_call)
                this[name] = {"calls_per_s": round(calls / seconds, 1), "busy": busy}
            this["ratio"] = round(this["cache"]["calls_per_s"] / this["no cache"]["calls_per_s"], 2)
            rounds.append(this)
    finally:
        for target in servers.values():
            target.stop()
    calls = -(-2 * args.unique // args.texts_per_call)
    row: dict[str, Any] = {"calls": calls, "unique": args.unique, "rounds": rounds}
    row["texts_per_call"] = args.texts_per_call
    for name in ("no cache", "cache"):
        row[name] = {
            "calls_per_s": statistics.median(r[name]["calls_per_s"] for r in rounds),
            "machine_busy": max(r[name]["busy"] for r in rounds),
        }
    row["ratio"] = statistics.median(r["ratio"] for r in rounds)
    return row


def cpu_row(model: Path, logs: Path, args: argparse.Namespace) -> dict[str, Any]:
    texts = sentences(args.unique, seed=2)
    flags = ["--cache-mb", str(args.cache_mb)]
    target = start_project_server("minilm", str(model), DIMS, flags, logs)
    row: dict[str, Any] = {"items": len(texts)}
    try:
        drive(target, sentences(64, seed=98), args.concurrency)
        for name in ("miss", "hit"):  # the same texts: all new, then all seen
            wait_quiet(10)
            cpu = ProcessCpu(pids={"server": target.pid})
            cpu.start()
            drive(target, texts, args.concurrency)
            cpu.stop()
            used = cpu.used()["server"]
            row[name] = {
                "cpu_us_per_item": round(used / len(texts) * 1e6, 1),
                "calls_per_s": round(len(texts) / cpu.seconds, 1),
            }
    finally:
        target.stop()
    row["hit_over_miss"] = round(row["hit"]["cpu_us_per_item"] / row["miss"]["cpu_us_per_item"], 3)
    return row


def redis_row(args: argparse.Namespace) -> dict[str, Any]:
    binary = shutil.which("redis-server")
    if binary is None:
        return {"skipped": "redis-server is not installed"}
    from pooling_server.engine.caching.cache import CacheSettings, ResultCache
    from tests.server_process import free_port

    folder = Path(tempfile.mkdtemp(prefix="cache-bench-redis-"))
    port = free_port()
    command = [binary, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder)]
    redis = subprocess.Popen([*command, "--save", ""], stdout=subprocess.DEVNULL)
    try:
        import redis as redis_py

        client = redis_py.Redis(port=port)
        deadline = time.monotonic() + 20
        while True:
            try:
                client.ping()
                break
            except redis_py.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        cache = ResultCache(
            CacheSettings(redis_url=f"redis://127.0.0.1:{port}/0", redis_timeout_ms=50)
        )
        rng = np.random.default_rng(0)
        keys = [rng.bytes(20) for _ in range(args.redis_keys)]
        for key in keys:
            cache.store(key, rng.random(DIMS, dtype=np.float32))
        while client.dbsize() < len(keys):  # the writer thread's writes
            time.sleep(0.01)
        row: dict[str, Any] = {"entry_bytes": len(client.get(b"pooling:cache:v1:" + keys[0]))}
        for batch in (1, 32):
            times = []
            for start in range(0, len(keys) - batch + 1, batch):
                wanted = keys[start : start + batch]
                began = time.perf_counter()
                found = cache.find(wanted)
                times.append(time.perf_counter() - began)
                assert all(value is not None for value in found)
            times.sort()
            row[f"{batch} key(s)"] = {
                "median_us": round(statistics.median(times) * 1e6, 1),
                "p99_us": round(times[int(len(times) * 0.99)] * 1e6, 1),
                "median_us_per_hit": round(statistics.median(times) * 1e6 / batch, 1),
            }
        row["errors"] = cache.redis.errors if cache.redis is not None else 0
        cache.close()
        return row
    finally:
        redis.kill()
        redis.wait()
        shutil.rmtree(folder, ignore_errors=True)


def report(results: dict[str, Any]) -> str:
    calls, cpu, redis = results["calls"], results["cpu"], results["redis"]
    lines = [
        f"result cache vs none, MiniLM (shipped) (shared, noisy host: {results['cores']} cores)",
        f"1. half-repeating corpus, {calls['calls']} calls of {calls['texts_per_call']} "
        f"text(s) ({calls['unique']} unique texts), C={results['concurrency']}:",
        f"   no cache {calls['no cache']['calls_per_s']:>8} calls/s "
        f"(other work: {calls['no cache']['machine_busy']:.2f} cores busy before)",
        f"   cache    {calls['cache']['calls_per_s']:>8} calls/s "
        f"(other work: {calls['cache']['machine_busy']:.2f} cores busy before)",
        f"   ratio {calls['ratio']}x (target >= 1.8x), median of {len(calls['rounds'])} "
        "alternating rounds: " + ", ".join(f"{r['ratio']}x" for r in calls["rounds"]),
        f"2. server CPU per item, {cpu['items']} items: miss {cpu['miss']['cpu_us_per_item']} us, "
        f"hit {cpu['hit']['cpu_us_per_item']} us (hit/miss {cpu['hit_over_miss']})",
    ]
    if "skipped" in redis:
        lines.append(f"3. Redis tier: skipped, {redis['skipped']}")
    else:
        one, many = redis["1 key(s)"], redis["32 key(s)"]
        lines += [
            f"3. Redis on loopback, a hit ({redis['entry_bytes']} B entries): one key "
            f"median {one['median_us']} us, p99 {one['p99_us']} us; 32 keys a round trip "
            f"median {many['median_us']} us ({many['median_us_per_hit']} us a hit) "
            "(target <= 1000 us)",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unique", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of row 1")
    parser.add_argument("--texts-per-call", type=int, default=1, help="row 1's texts a call")
    parser.add_argument("--cache-mb", type=int, default=256)
    parser.add_argument("--redis-keys", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
    import os

    model = _default_model_path()
    logs = Path(tempfile.mkdtemp(prefix="cache-bench-"))
    results = {
        "cores": os.cpu_count(),
        "concurrency": args.concurrency,
        "calls": calls_row(model, logs, args),
        "cpu": cpu_row(model, logs, args),
        "redis": redis_row(args),
    }
    text = report(results)
    print(text)
    if args.out is not None:
        args.out.write_text(json.dumps(results, indent=2) + "\n")
        args.out.with_suffix(".txt").write_text(text + "\n")


if __name__ == "__main__":
    main()
