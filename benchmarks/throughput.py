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

Run: .venv/bin/python -m benchmarks.throughput [--json] [--duration 8] [--model PATH]
     .venv/bin/python -m benchmarks.throughput --load h2load [--only floor,loop-bound]
         [--duration 10] [--profile] [--json-out FILE]
     .venv/bin/python -m benchmarks.throughput --load h2load --only frontends --concurrency 64
         [--stand-in-concurrency 64,256] [--duration 5]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from benchmarks.servers import (
    POOL_PATH,
    Target,
    _measure,
    _pool_request,
    start_floor,
    start_project_server,
    verify_pool,
)
from benchmarks.workload import _default_model_path, sentences


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
        # needs to spread them over --frontends processes); --shared-channel: one for all.
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


# The whole server in one process (the default is now a supervisor, an engine process and one
# front end); a later --server-arg=--frontends=N overrides it.
SINGLE_PROCESS = ("--frontends", "0")


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


def _tokens(port: int) -> tuple[float, float]:
    """Real and padded tokens computed (a split server: summed over its engines already)."""
    from tests.metrics_endpoint import metric_sum, scrape

    scraped = scrape(port)
    return (
        metric_sum(scraped, "pooling_batch_real_tokens_total"),
        metric_sum(scraped, "pooling_batch_padded_tokens_total"),
    )


def orchestrate(args: argparse.Namespace) -> None:
    from tests.server_process import free_port, start_server

    levels = [int(c) for c in (args.concurrency or "1,16,64,256").split(",")]
    model = args.model or str(_default_model_path())
    (reference,) = _roles([("reference", model)])
    best = reference["best_sentences_per_s"]
    metrics_port = free_port()
    # The single-process server unless --server-arg says otherwise (--frontends=N).
    server = start_server(
        [
            "--model",
            f"bench={model}",
            "--metrics-port",
            str(metrics_port),
            *SINGLE_PROCESS,
            *args.server_arg,
        ],
        Path(tempfile.mkdtemp()),
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
        real_before, padded_before = _tokens(metrics_port)
        mixed = _load(server.address, "unary", 64, seconds, procs, "--mixed", *shared)
        real_after, padded_after = _tokens(metrics_port)
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


# --- h2load mode -----------------------------------------------------------------------------

H2LOAD_ROWS = (
    "reference",
    "floor",
    "floor-asyncio",
    "loop-bound",
    "loop-bound-node",
    "loop-bound-node-f1",
    "loop-bound-node-f2",
    "minilm",
    "minilm-f1",
    "stand-in-f0",
    "stand-in-f1",
    "stand-in-f2",
    "memory",
)
STAND_IN_ROWS = ("stand-in-f0", "stand-in-f1", "stand-in-f2")
# --only also takes these names for several rows at once.
ROW_GROUPS = {
    # The floor on both loops (uvloop, as the server runs by default, and asyncio's own):
    # the loop-bound row is measured against the faster of the two at each C.
    "floor": ("floor", "floor-asyncio"),
    "stand-in": STAND_IN_ROWS,
    "frontends": ("reference", "minilm", "minilm-f1", *STAND_IN_ROWS, "memory"),
}
# Rows whose server is one process, which --profile can follow thread by thread.
PROFILE_ROWS = ("floor", "floor-asyncio", "loop-bound", "loop-bound-node", "minilm", "stand-in-f0")
# The loop-bound server behind the Node.js gRPC door: in one process, in the default layout
# and with two front ends.
NODE_DOOR = ("--grpc-door", "node")
GRPCIO_DOOR = ("--grpc-door", "grpcio")
NODE_ROWS = ("loop-bound-node", "loop-bound-node-f1", "loop-bound-node-f2")
LOOP_BOUND_HIDDEN = 32


def build_loop_bound_model(folder: str) -> dict[str, str]:
    """A 1-layer, hidden-32 BERT with random weights, MiniLM's tokenizer and pooling layout.

    Its forward pass costs next to nothing, so the server's rate on it is set by the server's
    own per-request work (gRPC, event loop, tokenize hand-off, batching), which is what
    changes to the server can move. Built here so no weight file has to be shipped.
    """
    from benchmarks.random_weights import sentence_transformers_bert

    sentence_transformers_bert(
        Path(folder), _default_model_path(), LOOP_BOUND_HIDDEN, 1, 2, intermediate=37
    )
    return {"folder": folder}


def process_role(process: Any) -> str:
    """supervisor, engine K or frontend K (from a split server's child command line),
    server (the whole server in one process), or `node of P`: process P's Node.js door."""
    command = process.cmdline()
    if process.name() == "node":
        return f"node of {process_role(process.parent())}"
    if "--role" in command:
        role = command[command.index("--role") + 1]
        index = command[command.index("--role-index") + 1] if "--role-index" in command else "0"
        return f"{role} {index}"
    split = any("--role" in child.cmdline() for child in process.children())
    return "supervisor" if split else "server"


def process_tree(pid: int) -> list[Any]:
    import psutil

    parent = psutil.Process(pid)
    return [parent, *parent.children(recursive=True)]


@dataclass
class RoleCpu:
    """An h2load probe: CPU of each process of a split server, by role, over the window (so
    one sees how SO_REUSEPORT spread the connections over the front ends)."""

    pid: int
    processes: dict[str, Any] | None = None
    before: dict[str, float] | None = None
    after: dict[str, float] | None = None
    window: list[float] | None = None

    def _cpu(self) -> dict[str, float]:
        import psutil

        out = {}
        for name, process in (self.processes or {}).items():
            try:
                times = process.cpu_times()
            except psutil.NoSuchProcess:
                continue
            out[name] = times.user + times.system
        return out

    def start(self) -> None:
        self.processes = {process_role(p): p for p in process_tree(self.pid)}
        self.window = [time.perf_counter()]
        self.before = self._cpu()

    def stop(self) -> None:
        self.after = self._cpu()
        assert self.window is not None
        self.window.append(time.perf_counter())

    def report(self, requests_per_s: float) -> dict[str, Any]:
        assert self.window is not None and self.before is not None and self.after is not None
        seconds = self.window[1] - self.window[0]
        requests = requests_per_s * seconds
        return {
            name: {
                "cores": (self.after[name] - self.before[name]) / seconds,
                "cpu_us_per_request": (
                    1e6 * (self.after[name] - self.before[name]) / requests if requests else None
                ),
            }
            for name in sorted(self.after)
            if name in self.before
        }


MB = 1024 * 1024


def tree_memory(pids: list[int]) -> dict[str, Any]:
    """Resident memory of the servers' processes, summed: RSS (shared pages counted once per
    process), PSS (shared pages split between their processes) and USS (private pages)."""
    import psutil

    total = {"processes": 0, "rss_mb": 0.0, "pss_mb": 0.0, "uss_mb": 0.0}
    by_process: dict[str, float] = {}
    for k, pid in enumerate(pids):
        for process in process_tree(pid):
            try:
                role = process_role(process)
                info = process.memory_full_info()
            except psutil.NoSuchProcess:
                continue
            total["processes"] += 1
            total["rss_mb"] += info.rss / MB
            total["pss_mb"] += getattr(info, "pss", math.nan) / MB
            total["uss_mb"] += info.uss / MB
            name = f"{role} of {k}" if len(pids) > 1 else role
            by_process[name] = info.rss / MB
    return {**total, "rss_mb_by_process": by_process}


def _code_version() -> str:
    """The commit measured (and whether the tree had changes), so results say what they are."""
    git = ["git", "-C", str(Path(__file__).resolve().parent.parent)]
    try:
        commit = subprocess.run(
            [*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True
        ).stdout.strip()
        dirty = subprocess.run(
            [*git, "status", "--porcelain", "--", "engine", "service"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return commit + (" + uncommitted changes in engine/ or service/" if dirty else "")


def _children_cpu() -> float:
    """CPU seconds of this process's finished children (the role processes)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _model_dims(model: str) -> int:
    return int(json.loads((Path(model) / "config.json").read_text())["hidden_size"])


def _reference(model: str, wait_quiet: float) -> dict[str, Any]:
    """The in-process reference, with what the rest of the machine used meanwhile."""
    from benchmarks import h2load

    if wait_quiet:
        h2load.wait_quiet(wait_quiet)
    busy, children, started = h2load.machine_busy(), _children_cpu(), time.perf_counter()
    (reference,) = _roles([("reference", model)])
    seconds = time.perf_counter() - started
    # The reference uses every core; whatever else ran took cores from it.
    reference["other_cores"] = (
        h2load.machine_busy() - busy - (_children_cpu() - children)
    ) / seconds
    return reference


def _least_noisy(measure: Callable[[], dict[str, Any]], args: argparse.Namespace) -> dict:
    """Measure again (--retries times at most) while other work took more than
    --max-other-cores of the machine; keep the quietest attempt. A shared 2-core machine
    otherwise hands whichever row ran during someone's test suite half the CPU."""
    attempts = [measure()]
    while (
        args.max_other_cores is not None
        and attempts[-1]["other_cores"] > args.max_other_cores
        and len(attempts) <= args.retries
    ):
        attempts.append(measure())
    best = min(attempts, key=lambda a: a["other_cores"])
    best["attempts"] = len(attempts)
    return best


def _selected_rows(text: str | None) -> set[str]:
    if not text:
        return set(H2LOAD_ROWS) - {"minilm-f1", *STAND_IN_ROWS, "memory"}
    only: set[str] = set()
    for name in text.split(","):
        only.update(ROW_GROUPS.get(name, (name,)))
    if unknown := only - set(H2LOAD_ROWS):
        raise SystemExit(
            f"--only: unknown rows {sorted(unknown)}; choose from {H2LOAD_ROWS} or the groups "
            f"{sorted(ROW_GROUPS)}"
        )
    return only


def _load_briefly(target: Target, body: bytes, args: argparse.Namespace) -> None:
    """A short h2load run at C=64: the server's memory as it serves, not as it started."""
    from benchmarks import h2load

    h2load.run(
        f"http://{target.address}{POOL_PATH}",
        body,
        concurrency=64,
        duration_s=args.memory_load,
        warmup_s=0.5,
        max_connections=args.h2load_connections,
        work_dir=Path(args.work_dir),
    )


def measure_memory(
    start: Callable[[list[str]], Target], text: str, body: bytes, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """`--frontends N` against N whole single-process servers (`--frontends 0`, each on its
    own port), for N in 1, 2: resident memory over every process, once each has answered one
    call (idle) and after a short load on each (loaded)."""
    rows = []
    for n in (1, 2):
        for layout in ("split", "whole"):
            flags = ["--frontends", str(n)] if layout == "split" else list(SINGLE_PROCESS)
            targets: list[Target] = []
            try:
                for _ in range(1 if layout == "split" else n):
                    targets.append(start(flags))
                for target in targets:
                    verify_pool(target, text)
                idle = tree_memory([t.pid for t in targets])
                for target in targets:
                    _load_briefly(target, body, args)
                loaded = tree_memory([t.pid for t in targets])
            finally:
                for target in targets:
                    target.stop()
            server = f"--frontends {n}" if layout == "split" else f"{n} x --frontends 0"
            rows.append(
                {"server": server, "n": n, "layout": layout, "idle": idle, "loaded": loaded}
            )
    return rows


def orchestrate_h2load(args: argparse.Namespace) -> dict[str, Any]:
    from benchmarks import cpu_profile, h2load, stand_in

    if not h2load.available():
        raise SystemExit("h2load not found: apt-get install nghttp2-client")
    only = _selected_rows(args.only)
    if args.profile and args.profile_row not in only:
        only.add(args.profile_row)
    levels = [int(c) for c in (args.concurrency or "64,1").split(",")]
    stand_in_levels = [int(c) for c in args.stand_in_concurrency.split(",")]
    work = Path(tempfile.mkdtemp(prefix="h2load-bench-"))
    args.work_dir = str(work)
    text = sentences(1, seed=1)[0]
    body = h2load.grpc_body(_pool_request(text))
    model = args.model or str(_default_model_path())
    load_before = os.getloadavg()[0]
    summary: dict[str, Any] = {
        "code": _code_version(),
        "cpus": os.cpu_count(),
        "loadavg_1m_before": load_before,
        "duration_s": args.duration,
        "warmup_s": args.warmup,
        "max_connections": args.h2load_connections,
        "work_dir": str(work),
    }
    if only & set(STAND_IN_ROWS):
        summary["stand_in_batch_ms"] = args.stand_in_batch_ms
    rows: list[dict[str, Any]] = []
    profile: dict[str, Any] = {}

    reference = None
    if "reference" in only:
        reference = _least_noisy(partial(_reference, model, args.wait_quiet), args)
        summary.update({f"reference_{k}": v for k, v in reference.items()})

    def minilm(name: str, flags: list[str]) -> Target:
        return start_project_server(
            name, model, _model_dims(model), [*flags, *args.server_arg], work
        )

    def loop_bound(flags: list[str]) -> Target:
        return start_project_server(
            "loop-bound",
            _roles([("build-loop-bound", str(work / "loop-bound-model"))])[0]["folder"],
            LOOP_BOUND_HIDDEN,
            [*flags, *args.server_arg],
            work,
        )

    def device_stand_in(frontends: int) -> Target:
        return start_project_server(
            "stand-in",
            model,
            _model_dims(model),
            ["--frontends", str(frontends), "--max-batch-size", "256", *args.server_arg],
            work,
            module="benchmarks.stand_in",
            env={stand_in.ENV: str(args.stand_in_batch_ms)},
        )

    starters: dict[str, Callable[[], Target]] = {
        "floor": lambda: start_floor(args.floor_dims),
        "floor-asyncio": lambda: start_floor(args.floor_dims, "asyncio"),
        "loop-bound": partial(loop_bound, [*SINGLE_PROCESS, *GRPCIO_DOOR]),
        "loop-bound-node": partial(loop_bound, [*SINGLE_PROCESS, *NODE_DOOR]),
        "loop-bound-node-f1": partial(loop_bound, ["--frontends", "1", *NODE_DOOR]),
        "loop-bound-node-f2": partial(loop_bound, ["--frontends", "2", *NODE_DOOR]),
        "minilm": lambda: minilm("minilm", list(SINGLE_PROCESS)),
        "minilm-f1": lambda: minilm("minilm", ["--frontends", "1"]),
        **{f"stand-in-f{n}": partial(device_stand_in, n) for n in (0, 1, 2)},
    }
    for name, start in starters.items():
        if name not in only:
            continue
        target = start()
        split = name.endswith(("-f1", "-f2"))
        try:
            verify_pool(target, text)
            row_levels = stand_in_levels if name in STAND_IN_ROWS else levels
            for c in row_levels:
                profiling = args.profile and name == args.profile_row and c == max(row_levels)
                threads = cpu_profile.ThreadCpu(target.pid) if profiling else None
                roles = RoleCpu(target.pid) if split else None
                probes = [p for p in (threads, roles) if p is not None]
                row = _least_noisy(partial(_measure, target, body, c, args, probes), args)
                reports = row.pop("probes")
                if roles:
                    row["server_cores_by_process"] = reports[probes.index(roles)]
                rows.append({"row": name, **row})
                if threads:
                    profile.update(row=name, concurrency=c, threads=reports[probes.index(threads)])
            if args.profile and name == args.profile_row:
                # A run of its own: sampling slows the server, the rows above stay clean.
                spy = cpu_profile.PySpy(
                    target.pid,
                    work / f"py-spy-{name}.raw",
                    seconds=max(1, int(args.duration - 2 * h2load.MARGIN_S)),
                    rate_hz=args.profile_rate,
                    native=args.profile_native,
                    gil=args.profile_gil,
                )
                spy_threads = cpu_profile.ThreadCpu(target.pid)
                c = max(stand_in_levels if name in STAND_IN_ROWS else levels)
                spied = _measure(target, body, c, args, [spy, spy_threads])
                profile["py_spy"], profile["py_spy_threads"] = spied.pop("probes")
                profile["py_spy_run"] = spied
                if not args.profile_gil:  # GIL samples are GIL time already
                    cpu_profile.calibrate(profile["py_spy"], profile["py_spy_threads"])
        finally:
            target.stop()
    shutil.rmtree(work / "loop-bound-model", ignore_errors=True)
    memory = measure_memory(partial(minilm, "minilm"), text, body, args) if "memory" in only else []

    by = {(r["row"], r["concurrency"]): r for r in rows}

    def ratio(a: str, b: str, c: int) -> float | None:
        if (a, c) in by and (b, c) in by:
            return by[(a, c)]["requests_per_s"] / by[(b, c)]["requests_per_s"]
        return None

    for c in levels:
        floors = [by[(f, c)]["requests_per_s"] for f in ("floor", "floor-asyncio") if (f, c) in by]
        for name in ("loop-bound", *NODE_ROWS):
            if (name, c) in by and floors:
                key = name.replace("-", "_")
                summary[f"{key}_over_floor_c{c}"] = by[(name, c)]["requests_per_s"] / max(floors)
        for name, key in (("minilm", "minilm"), ("minilm-f1", "minilm_f1")):
            if (name, c) in by and reference and c == max(levels):
                summary[f"{key}_c{c}_over_in_process_best"] = (
                    by[(name, c)]["requests_per_s"] / reference["best_sentences_per_s"]
                )
        if (value := ratio("minilm-f1", "minilm", c)) is not None:
            summary[f"minilm_f1_over_f0_c{c}"] = value
    for name, key in (("minilm", "minilm"), ("minilm-f1", "minilm_f1")):
        if (name, 1) in by and reference:
            summary[f"{key}_c1_mean_over_batch1_mean"] = (
                by[(name, 1)]["mean_ms"] / reference["batch1_mean_ms"]
            )
    for c in stand_in_levels:
        for a, b in ((2, 1), (1, 0), (2, 0)):
            value = ratio(f"stand-in-f{a}", f"stand-in-f{b}", c)
            if value is not None:
                summary[f"stand_in_f{a}_over_f{b}_c{c}"] = value
    for split, whole in zip(memory[::2], memory[1::2], strict=True):
        n = split["n"]
        for key in ("rss_mb", "pss_mb"):
            summary[f"memory_f{n}_over_{n}x_f0_loaded_{key.removesuffix('_mb')}"] = (
                split["loaded"][key] / whole["loaded"][key]
            )
    summary["loadavg_1m_after"] = os.getloadavg()[0]
    return {"summary": summary, "rows": rows, "memory": memory, "profile": profile}


def format_memory(memory: list[dict[str, Any]]) -> list[str]:
    lines = [
        "memory (MB over every process of the server(s); idle: after one call; loaded: after "
        "a short C=64 h2load run on each):",
        f"{'server':<22}{'procs':>6}{'RSS idle':>10}{'RSS loaded':>12}{'PSS loaded':>12}"
        f"{'USS loaded':>12}  RSS loaded by process",
    ]
    for m in memory:
        idle, loaded = m["idle"], m["loaded"]
        parts = ", ".join(f"{k} {v:.0f}" for k, v in loaded["rss_mb_by_process"].items())
        lines.append(
            f"{m['server']:<22}{loaded['processes']:>6}{idle['rss_mb']:>10.0f}"
            f"{loaded['rss_mb']:>12.0f}{loaded['pss_mb']:>12.0f}{loaded['uss_mb']:>12.0f}"
            f"  {parts}"
        )
    return lines


def format_h2load(result: dict[str, Any]) -> str:
    from benchmarks import cpu_profile

    summary, lines = result["summary"], []
    if "reference_best_sentences_per_s" in summary:
        lines.append(
            f"in-process sentence-transformers on {summary['reference_device']}/"
            f"{summary['reference_dtype']}: best {summary['reference_best_sentences_per_s']:.1f}/s"
            f" at batch {summary['reference_best_batch']}; batch 1 mean "
            f"{summary['reference_batch1_mean_ms']:.2f} ms, p50 "
            f"{summary['reference_batch1_p50_ms']:.2f} ms"
        )
    lines.append(
        f"{'row':<12}{'C':>4}{'conn':>6}{'req/s':>9}{'mean ms':>9}{'p50 ms':>8}{'p99 ms':>8}"
        f"{'ok/fail/err':>16}{'srv us/req':>11}{'srv cores':>10}{'h2l us/req':>11}"
        f"{'others':>7}"
    )
    for r in result["rows"]:
        status = f"{r['succeeded']}/{r['failed']}/{r['errored']}"
        lines.append(
            f"{r['row']:<12}{r['concurrency']:>4}"
            f"{str(r['connections']) + 'x' + str(r['streams_per_connection']):>6}"
            f"{r['requests_per_s']:>9.1f}{r['mean_ms']:>9.2f}{r.get('p50_ms', math.nan):>8.2f}"
            f"{r.get('p99_ms', math.nan):>8.2f}"
            f"{status:>16}"
            f"{r['server_cpu_us_per_request']:>11.0f}{r['server_cores']:>10.2f}"
            f"{r['h2load_cpu_us_per_request']:>11.0f}{r['other_cores']:>7.2f}"
        )
    lines.append(
        "conn: connections x streams each; ok/fail/err: h2load's succeeded/failed/errored (HTTP "
        "level); srv/h2l us/req: CPU of the server / h2load per request; others: cores the rest "
        "of the machine used meanwhile (noise)"
    )
    for r in result["rows"]:
        if by_process := r.get("server_cores_by_process"):
            parts = ", ".join(
                f"{k} {v['cores']:.2f} ({v['cpu_us_per_request'] or 0:.0f} us/req)"
                for k, v in by_process.items()
            )
            lines.append(f"{r['row']} C={r['concurrency']} server cores by process: {parts}")
    if result.get("memory"):
        lines.extend(format_memory(result["memory"]))
    for r in result["rows"]:
        codes = r.get("server_calls_by_code", {})
        # h2load ends its run with streams in flight: up to C calls end CANCELLED.
        bad = {k: v for k, v in codes.items() if k not in ("OK", "CANCELLED")}
        if codes.get("CANCELLED", 0) > r["concurrency"]:
            bad["CANCELLED"] = codes["CANCELLED"]
        if bad:
            lines.append(f"WARNING {r['row']}: the server answered non-OK codes {bad}")
    for key, value in summary.items():
        if key.startswith("reference_"):
            continue
        lines.append(f"{key}: {value:.3f}" if isinstance(value, float) else f"{key}: {value}")
    if result["profile"]:
        p = result["profile"]
        lines.append(f"profile of {p.get('row')} at C={p.get('concurrency')}:")
        if "py_spy_run" in p:
            lines.append(
                f"(the py-spy run: {p['py_spy_run']['requests_per_s']:.1f} req/s, "
                f"server {p['py_spy_run']['server_cpu_us_per_request']:.0f} us/request)"
            )
        lines.append(cpu_profile.format_report(p.get("threads"), p.get("py_spy")))
    return "\n".join(lines)


def main() -> None:
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
        help=f"comma-separated rows out of {','.join(H2LOAD_ROWS)}, or the groups "
        + "; ".join(f"{k} ({','.join(v)})" for k, v in ROW_GROUPS.items())
        + ". Default: reference,floor,loop-bound,loop-bound-node(-f1,-f2),minilm",
    )
    h2.add_argument("--warmup", type=float, default=2.0, help="h2load warm-up seconds per level")
    h2.add_argument(
        "--h2load-connections",
        type=int,
        default=8,
        help="at most this many connections, C/connections streams on each",
    )
    h2.add_argument("--floor-dims", type=int, default=LOOP_BOUND_HIDDEN, help="floor's floats")
    h2.add_argument(
        "--profile", action="store_true", help="where the --profile-row server's CPU goes"
    )
    h2.add_argument("--profile-row", default="loop-bound", choices=PROFILE_ROWS)
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
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    parser.add_argument("--mixed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument(
        "--shared-channel", action="store_true", help="all clients of a load process share one"
    )
    args = parser.parse_args()
    if args.role and args.role[0] == "reference":
        print(json.dumps(run_reference(args.role[1])))
    elif args.role and args.role[0] == "build-loop-bound":
        print(json.dumps(build_loop_bound_model(args.role[1])))
    elif args.role and args.role[0] == "load":
        address, mode, concurrency, duration = args.role[1:5]
        load = run_load(
            address, mode, int(concurrency), float(duration), args.mixed, args.shared_channel
        )
        print(json.dumps(load))
    elif args.backends:
        from benchmarks import backends

        args.work_dir = tempfile.mkdtemp(prefix="bench-backends-")
        result = backends.run(args)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(
            json.dumps(result, indent=2, default=str) if args.json else backends.format_rows(result)
        )
    elif args.load == "h2load":
        result = orchestrate_h2load(args)
        if args.json_out:
            Path(args.json_out).write_text(json.dumps(result, indent=2, default=str) + "\n")
        print(json.dumps(result, indent=2, default=str) if args.json else format_h2load(result))
    else:
        if args.only or args.profile:
            parser.error("--only and --profile go with --load h2load")
        orchestrate(args)


if __name__ == "__main__":
    main()
