"""The result cache (docs/cache.md, issue 47) against no cache, on the shipped MiniLM.

Three rows, each printed side by side:

1. Calls/s over a corpus where half the texts repeat (--unique texts, each sent twice in
   a shuffled order, --texts-per-call texts a call, --concurrency calls in flight): the
   server without the cache and with --cache-mb, both up, in alternating rounds; a row
   for each --texts-per-call. Target: 1.8x (2x is the most it can reach: half the texts
   still compute). Each row also gives the CPU of a call by process and the ratio that
   CPU allows: a hit still pays the doors, the front end and this client, which share the
   cores with the engine, so with one text a call they bound it below the target.
2. The cached server's CPU per item (every process of it, psutil) over calls that all
   miss (new texts), then over the same calls again, all hits.
3. The shared tier's hit cost on a redis-server on loopback: a look-up of one key, and of
   32 keys in one round trip (ResultCache.find with no memory tier), median and p99.
   Target: at most 1 ms a hit.

The host is shared and noisy (other work runs beside it): each row says how busy the
machine was, and figures should be read side by side, not against other runs.

Run: python -m benchmarks.cache [--unique 1000] [--concurrency 16] [--rounds 3]
     [--texts-per-call 1,8]
     [--out benchmarks/results/cache.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from benchmarks.processes import ProcessCpu, role_kind, wait_quiet
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
    swapped every round, and the ratio is the median of the rounds' ratios. Done for each
    --texts-per-call, on the same two servers.

    Each drive also counts the CPU of every process (the engine's apart, and this client's)
    per call: the engine's is what the cache saves, the rest (doors, front end, client) is
    paid by every call, hit or miss, and bounds the ratio below 2x."""
    warm = sentences(64, seed=99)
    servers = {}
    rows: dict[str, Any] = {}
    try:
        for name, flags in (("no cache", []), ("cache", ["--cache-mb", str(args.cache_mb)])):
            servers[name] = start_project_server("minilm", str(model), DIMS, flags, logs)
            drive(servers[name], warm, args.concurrency)
        for per_call in args.texts_per_call:
            rounds: list[dict[str, Any]] = []
            for index in range(args.rounds):
                corpus = half_repeating(args.unique, seed=1000 * (index + 1) + per_call)
                order = list(servers) if index % 2 == 0 else list(reversed(servers))
                this: dict[str, Any] = {}
                for name in order:
                    busy = wait_quiet(10)  # the busy cores seen last, before the burst
                    cpu = ProcessCpu(roles_of=servers[name].pid)
                    cpu.start()
                    client = _own_cpu()
                    seconds = drive(servers[name], corpus, args.concurrency, per_call)
                    client = _own_cpu() - client
                    cpu.stop()
                    calls = -(-len(corpus) // per_call)
                    used = {"client": client}
                    for role, value in cpu.used().items():
                        used[role_kind(role)] = used.get(role_kind(role), 0.0) + value
                    this[name] = {
                        "calls_per_s": round(calls / seconds, 1),
                        "busy": busy,
                        "cpu_us_per_call": {k: round(v / calls * 1e6) for k, v in used.items()},
                    }
                ratio = this["cache"]["calls_per_s"] / this["no cache"]["calls_per_s"]
                this["ratio"] = round(ratio, 2)
                rounds.append(this)
            rows[str(per_call)] = _calls_summary(rounds, args.unique, per_call)
    finally:
        for target in servers.values():
            target.stop()
    return rows


def _own_cpu() -> float:
    """This process's CPU seconds alone (the servers are its children)."""
    times = psutil.Process().cpu_times()
    return times.user + times.system


def _calls_summary(rounds: list[dict[str, Any]], unique: int, per_call: int) -> dict[str, Any]:
    """The rounds' medians, and the bound the per-call CPU puts on the ratio: with the
    machine's cores busy throughout, calls/s goes as 1 / CPU per call, and the cache can
    save only the engine's share of the misses it answers (half of them)."""
    row: dict[str, Any] = {"calls": -(-2 * unique // per_call), "unique": unique}
    row["texts_per_call"] = per_call
    row["rounds"] = rounds
    for name in ("no cache", "cache"):
        cpu = {
            part: statistics.median(r[name]["cpu_us_per_call"].get(part, 0) for r in rounds)
            for part in rounds[0][name]["cpu_us_per_call"]
        }
        row[name] = {
            "calls_per_s": statistics.median(r[name]["calls_per_s"] for r in rounds),
            "machine_busy": max(r[name]["busy"] for r in rounds),
            "cpu_us_per_call": cpu,
        }
    row["ratio"] = statistics.median(r["ratio"] for r in rounds)
    plain = row["no cache"]["cpu_us_per_call"]
    engine = plain.get("engine", 0) + plain.get("server", 0)
    rest = sum(plain.values()) - engine
    row["no_cache_engine_us"], row["no_cache_rest_us"] = engine, rest
    row["bound"] = round((engine + rest) / (engine / 2 + rest), 2) if engine else None
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
    rows, cpu, redis = results["calls"], results["cpu"], results["redis"]
    lines = [
        f"result cache vs none, MiniLM (shipped) ({results['cores']} cores, this client on "
        "them too)",
    ]
    for calls in rows.values():
        plain, cached = calls["no cache"], calls["cache"]
        lines += [
            f"1. half-repeating corpus, {calls['calls']} calls of {calls['texts_per_call']} "
            f"text(s) ({calls['unique']} unique texts), C={results['concurrency']}:",
            f"   no cache {plain['calls_per_s']:>8} calls/s "
            f"(other work: {plain['machine_busy']:.2f} cores busy before); CPU us a call: "
            + _parts(plain["cpu_us_per_call"]),
            f"   cache    {cached['calls_per_s']:>8} calls/s "
            f"(other work: {cached['machine_busy']:.2f} cores busy before); CPU us a call: "
            + _parts(cached["cpu_us_per_call"]),
            f"   ratio {calls['ratio']}x (target >= 1.8x), median of {len(calls['rounds'])} "
            "alternating rounds: " + ", ".join(f"{r['ratio']}x" for r in calls["rounds"]),
            f"   bound from CPU a call: (engine {calls['no_cache_engine_us']} + rest "
            f"{calls['no_cache_rest_us']}) / (engine / 2 + rest) = {calls['bound']}x",
        ]
    lines.append(
        f"2. server CPU per item, {cpu['items']} items: miss {cpu['miss']['cpu_us_per_item']} "
        f"us, hit {cpu['hit']['cpu_us_per_item']} us (hit/miss {cpu['hit_over_miss']})"
    )
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


def _parts(cpu: dict[str, float]) -> str:
    return ", ".join(f"{part} {value:.0f}" for part, value in sorted(cpu.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--unique", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds of row 1")
    parser.add_argument(
        "--texts-per-call",
        type=lambda text: [int(n) for n in text.split(",")],
        default=[1, 8],
        help="row 1's texts a call, comma-separated: a row for each (default 1,8)",
    )
    parser.add_argument("--cache-mb", type=int, default=256)
    parser.add_argument("--redis-keys", type=int, default=2048)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    args = parser.parse_args()
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
