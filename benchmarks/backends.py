"""Backend rows of benchmarks/throughput.py (`--backends`): MiniLM on torch, onnx and
openvino, fp32 and int8, in-process and through the server (h2load), with quality and
start-up figures.

In-process rows run the engine's own runner on each backend (batch 1 and 32) beside
sentence-transformers on torch; sentence-transformers' backend="onnx"/"openvino" need
optimum, which pins transformers below the project's version, so they are not measured.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.servers import _measure, start_project_server, verify_pool
from benchmarks.workload import _default_model_path, sentences

CONFIGS = (  # name, --backend, --quantize
    ("torch fp32", "torch", "none"),
    ("onnx fp32", "onnx", "none"),
    ("openvino fp32", "openvino", "none"),
    ("onnx int8", "onnx", "int8"),
    ("openvino int8", "openvino", "int8"),
    # What the server runs by default: on a CPU with bfloat16, OpenVINO inferring in it.
    ("auto", "auto", "none"),
)


def _load(kind: str, quantize: str, cache: Path, threads: int) -> Any:
    import torch

    from pooling_server.engine.backends import (
        BackendKind,
        BackendOptions,
        Quantize,
        RuntimeSettings,
    )
    from pooling_server.engine.models.loader import load_model
    from pooling_server.engine.models.model_spec import DEFAULT_MODEL, ModelSpec

    options = BackendOptions(
        BackendKind(kind), quantize=Quantize.INT8 if quantize == "int8" else None
    )
    return load_model(
        ModelSpec(DEFAULT_MODEL, backend=options),
        device=torch.device("cpu"),
        dtype=torch.float32,
        runtime=RuntimeSettings(cache_dir=cache),
        threads=threads,
    )


def _rate(model: Any, texts: list[str], batch: int, seconds: float) -> float:
    encoded = model.tokenizer.tokenize(texts)
    done, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for i in range(0, len(encoded), batch):
            chunk = encoded[i : i + batch]
            model.runner.forward(chunk, [False] * len(chunk))
            done += len(chunk)
    return done / (time.perf_counter() - started)


def _embed(model: Any, texts: list[str]) -> np.ndarray:
    vectors = np.stack(model.runner.forward(model.tokenizer.tokenize(texts), [False] * len(texts)))
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def in_process(args: argparse.Namespace, cache: Path) -> dict[str, Any]:
    """Per config: texts/s at batch 1 and 32, cosine to torch, top-1 agreement, export
    (cold) and cache-load (warm) seconds."""
    import os

    import torch
    from sentence_transformers import SentenceTransformer

    from tests.engine.backends.test_backends import RETRIEVAL

    threads = len(os.sched_getaffinity(0))
    torch.set_num_threads(threads)
    texts = sentences(256, seed=1, min_words=12, max_words=16)
    queries, documents = list(RETRIEVAL), list(RETRIEVAL.values())
    st = SentenceTransformer(str(_default_model_path()), device="cpu")
    rows: dict[str, Any] = {}
    for batch in (1, 32):
        started, done = time.perf_counter(), 0
        while time.perf_counter() - started < args.backend_seconds:
            st.encode(texts[: batch * 8], batch_size=batch)
            done += batch * 8
        rows.setdefault("sentence-transformers torch fp32", {})[f"batch{batch}_per_s"] = done / (
            time.perf_counter() - started
        )
    reference = _load("torch", "none", cache, threads)
    ref_texts, ref_q, ref_d = (_embed(reference, t) for t in (texts[:64], queries, documents))
    for name, kind, quantize in CONFIGS:
        started = time.perf_counter()
        model = _load(kind, quantize, cache, threads)
        cold = time.perf_counter() - started
        started = time.perf_counter()
        model = _load(kind, quantize, cache, threads)
        warm = time.perf_counter() - started
        cos = (_embed(model, texts[:64]) * ref_texts).sum(axis=1)
        top1 = (_embed(model, queries) @ _embed(model, documents).T).argmax(axis=1)
        rows[name] = {
            "runs": f"{model.info.backend} {model.info.precision}",
            "batch1_per_s": _rate(model, texts[:64], 1, args.backend_seconds),
            "batch32_per_s": _rate(model, texts, 32, args.backend_seconds),
            "min_cosine": float(cos.min()),
            "mean_cosine": float(cos.mean()),
            "top1_same": bool((top1 == (ref_q @ ref_d.T).argmax(axis=1)).all()),
            "load_cold_s": cold,
            "load_warm_s": warm,
        }
        del model
    return rows


def served(args: argparse.Namespace, cache: Path) -> dict[str, Any]:
    """Per config, the server (default front ends) under h2load: C=1 and C=64 with one text
    per call, C=8 with 32 texts per call."""
    from benchmarks import h2load
    from pooling_client.v1 import pooling_pb2 as pb

    one = h2load.grpc_body(pb.PoolRequest(embed=pb.TextInput(texts=sentences(1, seed=2)[:1])))
    many = h2load.grpc_body(pb.PoolRequest(embed=pb.TextInput(texts=sentences(32, seed=3))))
    work = Path(args.work_dir)
    rows: dict[str, Any] = {}
    for name, kind, quantize in CONFIGS:
        flags = ["--backend", kind, "--quantize", quantize, "--backend-cache-dir", str(cache)]
        target = start_project_server(
            "minilm", str(_default_model_path()), 384, flags, work, env={"POOLING_BACKEND": kind}
        )
        try:
            verify_pool(target, "warm up")
            row: dict[str, Any] = {}
            for label, body, concurrency in (("c1", one, 1), ("c64", one, 64), ("c8x32", many, 8)):
                result = _measure(target, body, concurrency, args, probes=[], watch=False)
                row[label] = {
                    "calls_per_s": result["requests_per_s"],
                    "mean_ms": result.get("mean_ms"),
                    "texts_per_s": result["requests_per_s"] * (32 if label == "c8x32" else 1),
                }
            rows[name] = row
        finally:
            target.stop(signal.SIGTERM)
    return rows


# The vector extensions the backends' speed turns on: OpenVINO led torch by 2x at batch 32
# on the AVX-512 VNNI host issue 19 was measured on, by 1.2-1.6x in later runs on hosts of
# the same name, and a host without AVX-512 was found among them.
SIMD_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_tile", "avx_vnni")


def cpu() -> dict[str, Any]:
    """Which CPU the figures are from: hosts of one name differ in their vector units."""
    model, flags = "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    return {
        "model": model,
        "cores": len(os.sched_getaffinity(0)),
        "simd": [flag for flag in SIMD_FLAGS if flag in flags],
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    logging.disable(logging.WARNING)
    cache = Path(tempfile.mkdtemp(prefix="bench-backend-cache-"))
    try:
        result: dict[str, Any] = {"cpu": cpu(), "in_process": in_process(args, cache), "server": {}}
        if args.json_out:  # kept should the server rows fail
            Path(args.json_out).write_text(json.dumps(result, indent=2, default=str) + "\n")
        result["server"] = served(args, cache)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return result


def format_rows(result: dict[str, Any]) -> str:
    host = result.get("cpu", {})
    simd = ", ".join(host.get("simd", [])) or "none of " + ", ".join(SIMD_FLAGS)
    lines = [
        f"{host.get('model', 'unknown CPU')}, {host.get('cores', '?')} cores; {simd}",
        "",
        "| in-process | batch 1 /s | batch 32 /s | min cos | mean cos | top-1 | cold s | warm s |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, r in result["in_process"].items():
        if "min_cosine" not in r:
            lines.append(f"| {name} | {r['batch1_per_s']:.0f} | {r['batch32_per_s']:.0f} |||||")
            continue
        label = f"{name} ({r['runs']})" if name == "auto" else name
        lines.append(
            f"| {label} | {r['batch1_per_s']:.0f} | {r['batch32_per_s']:.0f} | "
            f"{r['min_cosine']:.5f} | {r['mean_cosine']:.5f} | {r['top1_same']} | "
            f"{r['load_cold_s']:.1f} | {r['load_warm_s']:.1f} |"
        )
    lines += [
        "",
        "| server | C=1 calls/s | C=1 mean ms | C=64 calls/s | C=8 x32 texts/s |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, r in result["server"].items():
        lines.append(
            f"| {name} | {r['c1']['calls_per_s']:.0f} | {r['c1']['mean_ms']} | "
            f"{r['c64']['calls_per_s']:.0f} | {r['c8x32']['texts_per_s']:.0f} |"
        )
    return "\n".join(lines)
